"""Model families, files: single-file and diffusers loading/saving checked against diffusers itself.

Oracles: diffusers' ``from_single_file(config=<folder>, local_files_only=True)`` reads our single files; diffusers'
``save_pretrained`` (the ``tiny_dir`` fixture) and ``from_pretrained`` write/read the folders on the other side.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
from argparse import Namespace

import pytest
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline

from library.families import detect_family, get_family
from library.families.convert import vae_to_ldm
from library.families.loading import META_CONFIGS
from library.families.sd import SD1, SD2, SDXL
from library.families.sd.tiny import build_tiny
from library.files.weights import load_state_dict, save_state_dict

FAMILIES = ["sd1", "sd2", "sdxl"]


def modules(parts_or_pipe) -> list[torch.nn.Module]:
    if hasattr(parts_or_pipe, "text_encoders"):
        return [parts_or_pipe.denoiser, parts_or_pipe.vae, *parts_or_pipe.text_encoders]
    pipe = parts_or_pipe
    return [pipe.unet, pipe.vae, pipe.text_encoder] + ([pipe.text_encoder_2] if hasattr(pipe, "text_encoder_2") else [])


def assert_same_weights(expected, actual) -> None:
    """Every tensor of every module is bitwise equal (same keys, shapes, dtypes, values)."""
    exp, act = modules(expected), modules(actual)
    assert len(exp) == len(act)
    for a, b in zip(exp, act):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys(), sorted(set(sa) ^ set(sb))[:5]
        bad = [k for k in sa if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k])]
        assert not bad, f"{type(a).__name__}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def public(config) -> dict:
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def single_files(tiny_parts, tmp_path_factory):
    """Each tiny model written by us as .safetensors and .ckpt: {(family, suffix): path}."""
    root = tmp_path_factory.mktemp("single")
    return {
        (name, suffix): get_family(name).save(tiny_parts[name], root / f"{name}{suffix}")
        for name in FAMILIES
        for suffix in (".safetensors", ".ckpt")
    }


def from_single_file(path, config_dir):
    cls = StableDiffusionXLPipeline if (config_dir / "text_encoder_2").is_dir() else StableDiffusionPipeline
    return cls.from_single_file(str(path), config=str(config_dir), local_files_only=True)


# ------------------------------------------------------------------------------------------------ diffusers oracles
@pytest.mark.parametrize("suffix", [".safetensors", ".ckpt"])
@pytest.mark.parametrize("family", FAMILIES)
def test_our_single_file_loads_in_diffusers(family, suffix, tiny_parts, tiny_dir, single_files):
    pipe = from_single_file(single_files[family, suffix], tiny_dir / family)
    assert_same_weights(tiny_parts[family], pipe)


@pytest.mark.parametrize("family", FAMILIES)
def test_we_load_diffusers_save_and_our_single_file(family, tiny_parts, tiny_dir, single_files):
    F = get_family(family)
    assert_same_weights(tiny_parts[family], F.load(tiny_dir / family))
    for suffix in (".safetensors", ".ckpt"):
        loaded = F.load(single_files[family, suffix])
        assert_same_weights(tiny_parts[family], loaded)
        assert loaded.prediction_type == tiny_parts[family].prediction_type
        assert public(loaded.denoiser.config) == public(tiny_parts[family].denoiser.config)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_diffusers_single_diffusers(family, tiny_parts, tiny_dir, tmp_path):
    F = get_family(family)
    F.save(F.load(tiny_dir / family), tmp_path / "model.safetensors")
    out = F.save(F.load(tmp_path / "model.safetensors"), tmp_path / "model")
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert type(pipe).__name__ == F.spec.pipeline_class
    assert_same_weights(tiny_parts[family], pipe)
    original = DiffusionPipeline.from_pretrained(tiny_dir / family, local_files_only=True)
    assert pipe.scheduler.config.prediction_type == original.scheduler.config.prediction_type
    text = "a photo of an astronaut riding a horse"
    assert pipe.tokenizer(text).input_ids == original.tokenizer(text).input_ids
    # transformers 4 (sd-scripts pins 4.54) needs these; transformers 5 saves only tokenizer.json
    assert (out / "tokenizer" / "vocab.json").is_file() and (out / "tokenizer" / "merges.txt").is_file()
    te_keys = load_state_dict(out / "text_encoder" / "model.safetensors")[0]
    assert all(k.startswith("text_model.") for k in te_keys)


def test_sd2_stores_openclip_h_with_24_blocks_and_keeps_them(tiny_parts, tmp_path):
    """Real-depth SD2 (23 HF layers): the file has OpenCLIP-H's 24 blocks like every SD2 checkpoint (block 23 a copy
    of 22, as sd-scripts writes); loading keeps block 23 aside so that saving again reproduces the file."""
    from transformers import CLIPTextConfig, CLIPTextModel

    parts = copy.deepcopy(tiny_parts["sd2"])
    cfg = CLIPTextConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_hidden_layers=23,
                         hidden_act="gelu", vocab_size=49408, max_position_embeddings=77)  # fmt: skip
    torch.manual_seed(0)
    parts.text_encoders = [CLIPTextModel(cfg).eval()]
    first = SD2.save(parts, tmp_path / "a.safetensors")
    sd, _ = load_state_dict(first)
    block = "cond_stage_model.model.transformer.resblocks."
    assert {int(k[len(block) :].split(".")[0]) for k in sd if k.startswith(block)} == set(range(24))
    assert torch.equal(sd[block + "23.attn.in_proj_weight"], sd[block + "22.attn.in_proj_weight"])
    sd[block + "23.ln_1.weight"] = torch.randn(8)  # a real file's block 23 differs from 22: it must survive
    save_state_dict(sd, tmp_path / "b.safetensors", load_state_dict(first)[1])
    loaded = SD2.load(tmp_path / "b.safetensors")
    assert loaded.text_encoders[0].config.num_hidden_layers == 23
    again, _ = load_state_dict(SD2.save(loaded, tmp_path / "c.safetensors"))
    assert again.keys() == sd.keys()
    assert all(torch.equal(again[k], sd[k]) for k in sd)


def test_single_file_layout_and_metadata(tiny_parts, single_files):
    sd, meta = load_state_dict(single_files["sdxl", ".safetensors"])
    te2 = tiny_parts["sdxl"].text_encoders[1]
    # sgm stores the projection P of x @ P: the transpose of HF's Linear weight (diffusers and ComfyUI read it so)
    assert torch.equal(sd["conditioner.embedders.1.model.text_projection"], te2.text_projection.weight.T)
    q = te2.text_model.encoder.layers[1].self_attn
    stacked = torch.cat([q.q_proj.weight, q.k_proj.weight, q.v_proj.weight])
    assert torch.equal(sd["conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_weight"], stacked)
    assert "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight" in sd
    assert (
        meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base" and meta["modelspec.resolution"] == "1024x1024"
    )
    assert meta["sdtrain.family"] == "sdxl" and "v_pred" not in sd
    sd1, meta1 = load_state_dict(single_files["sd1", ".ckpt"])
    assert "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight" in sd1
    assert meta1["modelspec.architecture"] == "stable-diffusion-v1" and META_CONFIGS in meta1
    sd2, meta2 = load_state_dict(single_files["sd2", ".safetensors"])
    assert meta2["modelspec.architecture"] == "stable-diffusion-v2-768-v" and meta2["modelspec.prediction_type"] == "v"
    assert meta2["modelspec.resolution"] == "768x768" and "v_pred" in sd2


def test_save_precision_and_load_dtype(tiny_parts, tmp_path):
    path = SD1.save(tiny_parts["sd1"], tmp_path / "half.safetensors", dtype=torch.float16, metadata={"k": "v"})
    sd, meta = load_state_dict(path)
    assert {v.dtype for v in sd.values() if v.is_floating_point()} == {torch.float16} and meta["k"] == "v"
    loaded = SD1.load(path, dtype=torch.bfloat16)
    assert {p.dtype for m in modules(loaded) for p in m.parameters()} == {torch.bfloat16}
    expected = tiny_parts["sd1"].denoiser.conv_in.weight.half().to(torch.bfloat16)
    assert torch.equal(loaded.denoiser.conv_in.weight, expected)
    folder = SD1.save(tiny_parts["sd1"], tmp_path / "half_folder", dtype=torch.float16)
    assert (
        load_state_dict(folder / "unet" / "diffusion_pytorch_model.safetensors")[0]["conv_in.weight"].dtype
        == torch.float16
    )


# ------------------------------------------------------------------------------------------------ prediction type
def test_v_prediction_markers_round_trip(tiny_parts, tiny_dir, tmp_path):
    parts = copy.deepcopy(tiny_parts["sdxl"])
    parts.scheduler_config.update(prediction_type="v_prediction", rescale_betas_zero_snr=True)
    path = SDXL.save(parts, tmp_path / "vpred.safetensors")
    sd, meta = load_state_dict(path)
    assert "v_pred" in sd and "ztsnr" in sd and meta["modelspec.prediction_type"] == "v"
    # the marker (ComfyUI/Forge convention) wins over what the stored configs say
    configs = json.loads(meta[META_CONFIGS])
    configs["scheduler"] = {
        k: v for k, v in configs["scheduler"].items() if k not in ("prediction_type", "rescale_betas_zero_snr")
    }
    save_state_dict(sd, path, {**meta, META_CONFIGS: json.dumps(configs)})
    loaded = SDXL.load(path)
    assert loaded.prediction_type == "v_prediction" and loaded.scheduler_config["rescale_betas_zero_snr"]
    assert SDXL.load(path, v_parameterization=False).prediction_type == "epsilon"  # the flag wins
    assert_same_weights(parts, from_single_file(path, tiny_dir / "sdxl"))  # markers do not disturb diffusers


def test_prediction_from_modelspec_and_diffusers_folder(tiny_parts, tiny_dir, tmp_path):
    path = SD1.save(tiny_parts["sd1"], tmp_path / "m.safetensors")
    sd, meta = load_state_dict(path)
    configs = json.loads(meta[META_CONFIGS])
    del configs["scheduler"]["prediction_type"]
    save_state_dict(sd, path, {**meta, META_CONFIGS: json.dumps(configs), "modelspec.prediction_type": "v"})
    assert SD1.load(path).prediction_type == "v_prediction"
    assert SD2.load(tiny_dir / "sd2").prediction_type == "v_prediction"  # from scheduler/scheduler_config.json
    assert SD2.load(tiny_dir / "sd2", v_parameterization=False).prediction_type == "epsilon"


def test_sd2_v_prediction_guess_follows_comfyui():
    from library.families.sd import guess_sd2_prediction

    key = "model.diffusion_model.output_blocks.11.1.transformer_blocks.0.norm1.bias"
    conv_in = {"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(320, 4, 3, 3)}
    spread = torch.linspace(-1, 1, 320)
    assert guess_sd2_prediction({key: spread * 0.2, **conv_in}) == "v_prediction"  # std 0.116 > 0.09
    assert guess_sd2_prediction({key: spread * 0.1, **conv_in}) == "epsilon"  # std 0.058
    inpaint = {"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(320, 9, 3, 3)}
    assert guess_sd2_prediction({key: spread * 0.2, **inpaint}) is None


# ------------------------------------------------------------------------------------------------ released configs
def test_shipped_configs_build_the_released_architectures():
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from library.families.loading import shipped_configs
    from library.families.sd.unet_keys import unet_state_dict_to_ldm

    # UNet: diffusers docs (num_parameters of SD1.5's UNet) / SDXL training logs; VAE and text encoders: the sums
    # of the released checkpoints (SDXL conditioning 817,720,320 = CLIP-L + bigG with projection).
    expected = {
        "sd15": (859_520_964, 83_653_863, [123_060_480]),
        "sd2-512": (865_910_724, 83_653_863, [340_387_840]),
        "sd2-768-v": (865_910_724, 83_653_863, [340_387_840]),
        "sdxl-base": (2_567_463_684, 83_653_863, [123_060_480, 694_659_840]),
    }
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    for stem, (n_unet, n_vae, n_tes) in expected.items():
        cfg = shipped_configs(stem)
        with init_empty_weights():
            unet = UNet2DConditionModel.from_config(cfg["unet"])
            vae = AutoencoderKL.from_config(cfg["vae"])
            classes = [CLIPTextModel, CLIPTextModelWithProjection][: len(cfg["text_encoders"])]
            tes = [c(CLIPTextConfig.from_dict(t)) for c, t in zip(classes, cfg["text_encoders"])]
        assert (count(unet), count(vae), [count(t) for t in tes]) == (n_unet, n_vae, n_tes), stem
        ldm = unet_state_dict_to_ldm(unet.state_dict(), unet.config)
        if stem == "sd15":
            assert len(ldm) == 686 and tuple(ldm["model.diffusion_model.output_blocks.2.1.conv.weight"].shape) == (
                1280,
                1280,
                3,
                3,
            )
        if stem == "sdxl-base":
            to_k = ldm["model.diffusion_model.input_blocks.7.1.transformer_blocks.9.attn2.to_k.weight"]
            assert tuple(to_k.shape) == (1280, 2048) and "model.diffusion_model.output_blocks.2.2.conv.weight" in ldm


@pytest.mark.parametrize("stem", ["sd15", "sd2-768-v", "sdxl-base"])
def test_released_layout_at_full_size_on_meta(stem):
    """Full-size models on the meta device (no memory): the single file we write has the released checkpoints'
    layout, and the shipped-config loader accepts it with every key and shape checked."""
    from pathlib import Path

    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from library.families import Parts
    from library.families.loading import shipped_configs
    from library.families.sd.loading import parts_from_single_file
    from library.families.sd.saving import single_file_state_dict

    cfg = shipped_configs(stem)
    family = get_family(cfg["family"])
    with init_empty_weights():
        classes = [CLIPTextModel, CLIPTextModelWithProjection][: len(cfg["text_encoders"])]
        tes = [c(CLIPTextConfig.from_dict(t)) for c, t in zip(classes, cfg["text_encoders"])]
        unet, vae = UNet2DConditionModel.from_config(cfg["unet"]), AutoencoderKL.from_config(cfg["vae"])
    parts = Parts(unet, vae, tes, [], dict(cfg["scheduler"]), family.name)
    sd = single_file_state_dict(family.spec, parts)
    shape = lambda key: tuple(sd[key].shape)  # noqa: E731
    assert shape("first_stage_model.encoder.mid.attn_1.q.weight") == (512, 512, 1, 1)
    assert sum(k.startswith("model.diffusion_model.") for k in sd) == len(unet.state_dict())
    if stem == "sd15":
        assert sum(k.startswith("cond_stage_model.transformer.text_model.") for k in sd) == 196
    if stem == "sd2-768-v":  # OpenCLIP-H: 24 blocks, stacked q/k/v, text_projection kept for other readers
        blocks = {k.split(".")[4] for k in sd if k.startswith("cond_stage_model.model.transformer.resblocks.")}
        assert blocks == {str(i) for i in range(24)} and "v_pred" in sd
        assert shape("cond_stage_model.model.transformer.resblocks.23.attn.in_proj_weight") == (3072, 1024)
        assert shape("cond_stage_model.model.text_projection") == (1024, 1024)
    if stem == "sdxl-base":
        assert shape("conditioner.embedders.1.model.text_projection") == (1280, 1280)
        assert shape("conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight") == (3840, 1280)
        assert shape("model.diffusion_model.label_emb.0.0.weight") == (1280, 2816)
    v = parts.prediction_type == "v_prediction"
    loaded = parts_from_single_file(family.spec, sd, {}, Path(f"{stem}.safetensors"), torch.float16, v)
    for a, b in zip(modules(parts), modules(loaded)):
        assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
        assert {p.dtype for p in b.parameters()} == {torch.float16}
    assert public(loaded.denoiser.config) == public(unet.config)


def test_foreign_file_uses_shipped_config_and_reports_mismatch(tiny_parts, tmp_path):
    """A file without our stored configs is built with the released SD1.5 config; tiny weights do not fit it."""
    path = SD1.save(tiny_parts["sd1"], tmp_path / "foreign.safetensors")
    sd, _ = load_state_dict(path)
    save_state_dict(sd, path)
    with pytest.raises(ValueError, match=r"foreign\.safetensors: the UNet weights do not fit .*sd15\.json.*shape"):
        SD1.load(path)


# ------------------------------------------------------------------------------------------------ --vae, tokenizers
@pytest.mark.parametrize("kind", ["diffusers_folder", "ldm_checkpoint", "ldm_vae_file", "diffusers_vae_file"])
def test_vae_override(kind, tiny_parts, single_files, tmp_path):
    other = build_tiny("sd1", seed=1).vae
    if kind == "diffusers_folder":
        other.save_pretrained(tmp_path / "vae")
        source = tmp_path / "vae"
    else:
        sd = {
            "ldm_checkpoint": {
                f"first_stage_model.{k}": v for k, v in vae_to_ldm(other.state_dict(), other.config).items()
            },
            "ldm_vae_file": vae_to_ldm(other.state_dict(), other.config),
            "diffusers_vae_file": other.state_dict(),
        }[kind]
        source = save_state_dict(sd, tmp_path / "vae.safetensors")
    loaded = SD1.load(single_files["sd1", ".safetensors"], vae=source)
    ours, theirs = loaded.vae.state_dict(), other.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(
        loaded.denoiser.conv_in.weight, tiny_parts["sd1"].denoiser.conv_in.weight
    )  # the rest is the model's
    if kind == "ldm_vae_file":  # a checkpoint without a VAE needs --vae, and says so
        sd, meta = load_state_dict(single_files["sd1", ".safetensors"])
        no_vae = save_state_dict(
            {k: v for k, v in sd.items() if "first_stage_model" not in k}, tmp_path / "nv.ckpt", meta
        )
        assert torch.equal(SD1.load(no_vae, vae=source).vae.encoder.conv_in.weight, other.encoder.conv_in.weight)
        with pytest.raises(ValueError, match=r"nv\.ckpt: the checkpoint has no VAE.*--vae"):
            SD1.load(no_vae)


def test_tokenizer_cache_dir_in_sd_scripts_layout(single_files, tmp_path):
    from library.families.tokenizers import load_clip_tokenizer

    for hub_id in ("openai/clip-vit-large-patch14", "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k"):
        tok = load_clip_tokenizer()
        tok.add_tokens(["<cached-tokenizer>"])
        tok.save_pretrained(tmp_path / hub_id.replace("/", "_"))
    parts = SDXL.load(single_files["sdxl", ".safetensors"], tokenizer_cache_dir=str(tmp_path))
    assert [len(t) for t in parts.tokenizers] == [49409, 49409]
    assert [t.pad_token for t in parts.tokenizers] == ["<|endoftext|>", "!"]  # sd-scripts forces "!" for bigG
    assert len(SDXL.load(single_files["sdxl", ".safetensors"]).tokenizers[0]) == 49408  # bundled


# ------------------------------------------------------------------------------------------------ errors, security
class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_malicious_ckpt_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "evil.ckpt", "wb") as f:
        pickle.dump({"state_dict": {"model.diffusion_model.x": _Evil()}}, f)
    with pytest.raises(ValueError, match=r"evil\.ckpt.*weights_only=True.*safetensors"):
        SD1.load(tmp_path / "evil.ckpt")
    assert not (tmp_path / "PWNED").exists()


def test_clear_errors_for_bad_paths(tmp_path, single_files, tiny_dir):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.safetensors: no such file"):
        SD1.load(tmp_path / "nowhere.safetensors")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"notes: this folder is not a diffusers Stable Diffusion model"):
        SD1.load(tmp_path / "notes")
    (tmp_path / "model.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"model\.txt: unsupported model file type"):
        SD1.load(tmp_path / "model.txt")
    save_state_dict({"some.weight": torch.ones(2)}, tmp_path / "lora.safetensors")
    with pytest.raises(ValueError, match=r"lora\.safetensors: no Stable Diffusion model found.*SD1\.x"):
        SD1.load(tmp_path / "lora.safetensors")


def test_wrong_family_names_file_and_family(single_files, tiny_dir, tiny_parts, tmp_path):
    with pytest.raises(ValueError, match=r"sdxl\.safetensors: this is an SDXL model, but an SD1\.x model.*sdxl_"):
        SD1.load(single_files["sdxl", ".safetensors"])
    with pytest.raises(ValueError, match=r"sd2\.ckpt: this is an SD2\.x model, but an SD1\.x model.*--v2"):
        SD1.load(single_files["sd2", ".ckpt"])
    with pytest.raises(ValueError, match=r"sd1: this is an SD1\.x model, but an SDXL model was expected"):
        SDXL.load(tiny_dir / "sd1")
    with pytest.raises(ValueError, match="cannot save a sdxl model with the sd1 family"):
        SD1.save(tiny_parts["sdxl"], tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match=r"x\.pt: save a full model as \.safetensors or \.ckpt"):
        SD1.save(tiny_parts["sd1"], tmp_path / "x.pt")


def test_detect_family(single_files, tiny_dir, tiny_parts):
    for name in FAMILIES:
        assert detect_family(single_files[name, ".safetensors"]) is get_family(name)
        assert detect_family(single_files[name, ".ckpt"]) is get_family(name)
        assert detect_family(tiny_dir / name) is get_family(name)
    sd, _ = load_state_dict(single_files["sd2", ".safetensors"])  # no metadata: from the OpenCLIP keys
    assert detect_family(sd) is SD2
    with pytest.raises(ValueError, match="unknown model family 'lumina'"):
        get_family("lumina")
    with pytest.raises(ValueError, match="no Stable Diffusion model"):
        detect_family({"w": torch.ones(1)})


def test_make_tiny_model_cli(tmp_path, tiny_parts, capsys):
    from tools.make_tiny_model import run

    written = run(["--out", str(tmp_path), "--family", "sd1", "sdxl"])
    assert [p.name for p in written] == ["sd1", "sd1.safetensors", "sdxl", "sdxl.safetensors"]
    assert "sdxl:" in capsys.readouterr().out
    assert_same_weights(tiny_parts["sdxl"], SDXL.load(tmp_path / "sdxl.safetensors"))
    assert_same_weights(tiny_parts["sd1"], DiffusionPipeline.from_pretrained(tmp_path / "sd1", local_files_only=True))


def test_select_family_for_a_script(tiny_dir):
    from library.families import select_family

    assert select_family(tiny_dir / "sd2", ("sd1", "sd2")).name == "sd2"  # the file says SD2, no --v2 needed
    assert select_family(tiny_dir / "sd1", ("sd1", "sd2")).name == "sd1"
    assert select_family(None, ("sd1", "sd2"), flagged="sd2").name == "sd2"
    with pytest.raises(ValueError, match="use sdxl_train_network.py"):
        select_family(tiny_dir / "sdxl", ("sd1", "sd2"))
    with pytest.raises(ValueError, match="use train_network.py"):
        select_family(tiny_dir / "sd1", ("sdxl",))
    with pytest.raises(ValueError, match="remove --v2"):
        select_family(tiny_dir / "sd1", ("sd1", "sd2"), flagged="sd2")


def test_family_as_flagged(tiny_dir):
    from library.families import family_as_flagged

    assert family_as_flagged(tiny_dir / "sd2").name == "sd2"
    assert family_as_flagged(tiny_dir / "sdxl", Namespace(sdxl=True)).name == "sdxl"
    with pytest.raises(ValueError, match="sd1 model but --v2 says sd2; remove the flag"):
        family_as_flagged(tiny_dir / "sd1", Namespace(v2=True))
    with pytest.raises(ValueError, match="contradict"):
        family_as_flagged(tiny_dir / "sd1", Namespace(v2=True, sdxl=True))
