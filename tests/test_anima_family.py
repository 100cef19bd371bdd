"""The Anima family on its tiny model: the contract, the key maps against diffusers' own Cosmos conversion and
AnimaTextConditioner, every file layout users have (net. or not, the adapter inside or apart, Qwen3 as a file or a
folder, the VAE in ComfyUI's or diffusers' names) loading to the same weights, save -> load, the ComfyUI LoRA names,
the packed conditioning and caption dropout over cached outputs as sd-scripts drops them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_family_contract import signature_problems

from library.families import FAMILIES, ModelFamily, detect_family
from library.families.anima import ANIMA, comfy_lora, keys, text
from library.families.anima.options import AnimaOptions
from library.families.autoencoders import qwen_image
from library.families.protocol import missing_members

pytest_plugins = ["_anima_helpers"]  # the shared tiny files (anima_files)


def _weights(parts):
    return [m.state_dict() for m in (parts.denoiser, parts.vae, *parts.text_encoders)]


def _same(a, b) -> None:
    for sa, sb in zip(_weights(a), _weights(b)):
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])][:3]


def _load(files, dit=None, vae=None, **kw):
    options = AnimaOptions(qwen3=kw.pop("qwen3", files["qwen3"]), qwen3_max_token_length=16, t5_max_token_length=16,
                           **kw)  # fmt: skip
    return ANIMA.load(dit or files["dit"], vae=vae or files["vae"], options=options)


def test_contract(anima_files):
    parts = anima_files["parts"]
    assert isinstance(ANIMA, ModelFamily) and missing_members(ANIMA) == [] and signature_problems(ANIMA) == []
    assert FAMILIES["anima"] is ANIMA and detect_family(anima_files["dit"]) is ANIMA
    assert tuple(r.prefix for r in ANIMA.adapter_roots(parts)) == ANIMA.adapter_prefixes
    reference = ANIMA.reference_parts()
    assert {p.device.type for p in reference.denoiser.parameters()} == {"meta"}
    assert reference.denoiser.config.num_layers == 28 and reference.text_encoders[0].config.hidden_size == 1024
    # every module of the released layout has an sd-scripts name and back
    for name, module in reference.denoiser.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert keys.module_to_diffusers(keys.module_to_sd(name)) == name


def test_key_map_is_diffusers_cosmos_conversion(anima_files):
    """Our sd-scripts -> diffusers names equal diffusers' single-file conversion for Cosmos-Predict2 on the same
    file; the adapter's names are diffusers' AnimaTextConditioner's (strict load)."""
    from diffusers import AnimaTextConditioner
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    sd = {k[len("net.") :]: v for k, v in load_file(anima_files["dit"]).items()}
    dit = {k: v for k, v in sd.items() if not k.startswith("llm_adapter.")}
    theirs = convert_cosmos_transformer_checkpoint_to_diffusers(dict(dit))
    ours = {d: dit[s] for d, s in keys.sd_to_diffusers_names(list(dit)).items()}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    model = _load(anima_files).denoiser
    conditioner = AnimaTextConditioner(**model.config.text_conditioner)
    conditioner.load_state_dict({k[len("llm_adapter.") :]: v for k, v in sd.items() if k.startswith("llm_adapter.")})


def test_every_layout_loads_the_same(anima_files, tmp_path):
    files, parts = anima_files, anima_files["parts"]
    base = _load(files)
    _same(parts, base)
    sd = load_file(files["dit"])
    bare = {k[len("net.") :]: v for k, v in sd.items() if not k.startswith("net.llm_adapter.")}
    save_file(bare, tmp_path / "no_adapter.safetensors")  # no net., no adapter: --llm_adapter_path
    save_file({k[len("net.llm_adapter."):]: v for k, v in sd.items() if k.startswith("net.llm_adapter.")},
              tmp_path / "adapter.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match="--llm_adapter_path"):
        _load(files, dit=str(tmp_path / "no_adapter.safetensors"))
    qwen3_dir = tmp_path / "qwen3"  # a transformers folder (Qwen3ForCausalLM names under model.)
    qwen3_dir.mkdir()
    save_file(load_file(files["qwen3"]), qwen3_dir / "model.safetensors")
    (qwen3_dir / "config.json").write_text(json.dumps(text.TINY_QWEN3))
    save_file(parts.vae.state_dict(), tmp_path / "vae_diffusers.safetensors")
    other = _load(files, dit=str(tmp_path / "no_adapter.safetensors"), llm_adapter_path=str(tmp_path /
                  "adapter.safetensors"), qwen3=str(qwen3_dir), vae=str(tmp_path / "vae_diffusers.safetensors"))  # fmt: skip
    _same(parts, other)
    folder = ANIMA.save(base, tmp_path / "folder")  # an Anima folder loads without --qwen3 / --vae
    _same(parts, ANIMA.load(folder))
    assert load_file(ANIMA.save(base, tmp_path / "again.safetensors")).keys() == sd.keys()


def test_vae_comfy_names_round_trip():
    from accelerate import init_empty_weights

    with init_empty_weights():
        vae = qwen_image.factory(qwen_image.RELEASED)()
    names = list(vae.state_dict())
    comfy = [qwen_image.diffusers_to_comfy_name(k, 2) for k in names]
    assert len(set(comfy)) == len(names) and qwen_image.is_comfy(comfy)
    assert qwen_image.comfy_to_diffusers(comfy, 2) == dict(zip(names, comfy))


def test_comfy_lora_names_rebuild_every_module_path(tmp_path):
    reference = ANIMA.reference_parts()
    paths = [keys.module_to_sd(n) for n, m in reference.denoiser.named_modules() if isinstance(m, torch.nn.Linear)]
    paths += [n for n, m in reference.text_encoders[0].named_modules() if isinstance(m, torch.nn.Linear)]
    assert all(comfy_lora.module_path(p.replace(".", "_")) == p for p in paths)
    lora = {"lora_unet_llm_adapter_blocks_0_self_attn_q_proj.lora_down.weight": torch.ones(2, 4),
            "lora_te_layers_1_mlp_gate_proj.alpha": torch.tensor(1.0)}  # fmt: skip
    comfy = comfy_lora.to_comfy(lora)
    assert set(comfy) == {"diffusion_model.llm_adapter.blocks.0.self_attn.q_proj.lora_A.weight",
                          "text_encoders.qwen3_06b.transformer.model.layers.1.mlp.gate_proj.alpha"}  # fmt: skip
    assert comfy_lora.from_comfy(comfy).keys() == lora.keys()


def test_packed_conditioning_and_caption_dropout(anima_files):
    """The packed mask survives the float32 text cache; the encoding of "" (what the shared cache stores for a
    dropped caption) is sd-scripts' drop_cached_text_encoder_outputs: zero states and Qwen3 mask, T5 ids
    [</s>, 0, ...] with mask [1, 0, ...]."""
    parts = anima_files["parts"]
    with torch.no_grad():
        cond = ANIMA.encode_prompt(parts, ["1girl, smile", ""])
    q_mask, t5_ids, t5_mask = text.unpack(cond.mask.float(), cond.hidden_states.shape[1])
    assert torch.equal(text.pack(q_mask, t5_ids, t5_mask), cond.mask)
    assert q_mask[0].sum() > 0 and t5_ids[0, 0] != 1
    assert torch.count_nonzero(cond.hidden_states[1]) == 0 and torch.count_nonzero(q_mask[1]) == 0
    assert t5_ids[1, 0] == 1 and torch.count_nonzero(t5_ids[1, 1:]) == 0
    assert t5_mask[1, 0] == 1 and torch.count_nonzero(t5_mask[1, 1:]) == 0
    with pytest.raises(ValueError, match="Anima's conditioning mask"):
        text.unpack(cond.mask[:, :-1], cond.hidden_states.shape[1])


def test_comfy_lora_reads_in_diffusers_anima_loader(anima_files):
    """Our ComfyUI-named file (convert_anima_lora_to_comfy.py's rule) through diffusers' AnimaLoraLoaderMixin: every
    lora_A / lora_B names a Linear of the transformer or of the text conditioner with fitting shapes."""
    from diffusers.loaders.lora_pipeline import AnimaLoraLoaderMixin

    denoiser = anima_files["parts"].denoiser
    lora = {}
    for name, module in denoiser.named_modules():
        if isinstance(module, torch.nn.Linear) and (".attn" in name or ".ff." in name or ".mlp." in name):
            kohya = "lora_unet_" + keys.module_to_sd(name).replace(".", "_")
            lora[kohya + ".lora_down.weight"] = torch.zeros(2, module.in_features)
            lora[kohya + ".lora_up.weight"] = torch.zeros(module.out_features, 2)
    assert any("llm_adapter" in k for k in lora)
    state = AnimaLoraLoaderMixin.lora_state_dict(comfy_lora.to_comfy(lora))
    modules = dict(denoiser.named_modules())
    assert len(state) == len(lora)
    for key, value in state.items():
        part, path = key.split(".", 1)
        path, _, which = path.rpartition(".lora_")
        target = modules[path if part == "transformer" else "llm_adapter." + path]
        expected = (2, target.in_features) if which.startswith("A") else (target.out_features, 2)
        assert tuple(value.shape) == expected, key


def test_flags_read_or_refused(tmp_path):
    """The issue's Anima flags parse in both training scripts; the family reads its own with sd-scripts' defaults
    (timestep_sampling sigmoid, discrete_flow_shift 1.0, 512 tokens); unsupported values are refused naming the flag."""
    import anima_train
    import anima_train_network

    qwen3 = tmp_path / "q.safetensors"
    qwen3.write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    flags = ["--qwen3", str(qwen3), "--vae", str(qwen3), "--llm_adapter_path", str(qwen3), "--llm_adapter_lr", "0",
             "--self_attn_lr", "1e-5", "--cross_attn_lr", "1e-5", "--mlp_lr", "1e-5", "--mod_lr", "0",
             "--t5_tokenizer_path", str(tmp_path), "--qwen3_max_token_length", "256", "--t5_max_token_length", "128",
             "--discrete_flow_shift", "3.0", "--timestep_sampling", "shift", "--sigmoid_scale", "1.5",
             "--attn_mode", "sdpa", "--split_attn", "--vae_chunk_size", "64", "--vae_disable_cache",
             "--blocks_to_swap", "4", "--cpu_offload_checkpointing"]  # fmt: skip
    for script in (anima_train_network, anima_train):
        args = script.build_parser().parse_args(flags)
        options = AnimaOptions.from_args(args, training=True)
        assert (options.qwen3_max_token_length, options.t5_max_token_length) == (256, 128)
        assert (options.flow.timestep_sampling, options.flow.discrete_flow_shift, options.flow.sigmoid_scale) == (
            "shift", 3.0, 1.5)  # fmt: skip
        assert args.blocks_to_swap == 4 and args.cpu_offload_checkpointing and args.mod_lr == 0
        defaults = AnimaOptions.from_args(script.build_parser().parse_args([]), training=True)
        assert (defaults.flow.timestep_sampling, defaults.flow.discrete_flow_shift) == ("sigmoid", 1.0)
        assert defaults.qwen3_max_token_length == defaults.t5_max_token_length == 512
    from library.cli.problems import ConfigError

    for bad, match in ((["--attn_mode", "xformers"], "--attn_mode xformers"), (["--sigmoid_scale", "0"],
                       "--sigmoid_scale"), (["--qwen3", str(tmp_path / "missing")], "--qwen3")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            AnimaOptions.from_args(anima_train_network.build_parser().parse_args(bad), training=True)
    rules = ANIMA.full_training.read(anima_train.build_parser().parse_args(flags), train_text_encoder=False)
    denoiser = anima_files_denoiser()
    groups = rules.denoiser_groups(denoiser, 1e-4)
    assert sorted(g["lr"] for g in groups) == [1e-5, 1e-5, 1e-5, 1e-4]  # base, self, cross, mlp; mod and adapter frozen


def anima_files_denoiser():
    from accelerate import init_empty_weights

    from library.families.anima.model import build
    from library.families.anima.tiny import TINY_DIT

    with init_empty_weights():
        return build(TINY_DIT)
