"""HunyuanImage 2.1 on tiny files: the released file layouts read back exactly, the prompts as sd-scripts builds them,
sd-scripts' objective by its formulas, the LoRA rules, and hunyuan_image_train_network.py running
docs/hunyuan_image_train_network.md's command line unchanged but for the paths, its LoRA applied by ComfyUI's rule
equal to our injected network. sd-scripts' own code is the oracle of benchmarks/hunyuan_image_vs_sdscripts.py (the
DiT forward, the VAE, every --timestep_sampling), run by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from _networks_helpers import make_config, perturb
from _train_helpers import assert_comfyui_loads, write_dataset_toml

import hunyuan_image_train_network
from library.cli.problems import ConfigError
from library.families.encoders import qwen25vl
from library.families.hunyuan_image import HUNYUAN_IMAGE as FAMILY
from library.families.hunyuan_image import keys as K
from library.families.hunyuan_image import model as M
from library.families.hunyuan_image.comfy_lora import comfy_dit_key
from library.families.hunyuan_image.objective import HunyuanFlowConfig, HunyuanFlowObjective, sample_sigmas
from library.families.hunyuan_image.options import HunyuanOptions
from library.files.weights import load_state_dict, read_metadata
from library.objectives.flow import sigma_table
from library.objectives.losses import LossConfig
from networks import convert_hunyuan_image_lora_to_comfy
from networks.inject import inject


@pytest.fixture(scope="module")
def parts():
    return FAMILY.tiny.build(seed=0, blocks=4)


@pytest.fixture(scope="module")
def files(parts, tmp_path_factory):
    return FAMILY.tiny.write_files(parts, tmp_path_factory.mktemp("hunyuan_files"), "tiny")


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "my_hunyuan_dataset_config.toml")


def dit_inputs(seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    noisy = torch.randn(2, 4, 2, 3, generator=g)
    qwen = torch.randn(2, 6, 16, generator=g)
    qwen_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    byt5 = torch.randn(2, M.BYT5_MAX_LENGTH, 12, generator=g)
    byt5_mask = torch.zeros(2, M.BYT5_MAX_LENGTH, dtype=torch.long)
    byt5_mask[0, :5] = 1
    hidden, mask = M.pack(qwen, qwen_mask, byt5, byt5_mask)
    from library.families.base import Cond

    return noisy, torch.tensor([250, 917]), Cond(hidden, None, mask)


def run(denoiser, inputs) -> torch.Tensor:
    with torch.no_grad():
        return FAMILY.predict(denoiser, *inputs)


@pytest.mark.parametrize("quoted", [True, False])
def test_predict_trims_padding_rows_without_changing_the_output(parts, quoted):
    """predict cuts byT5's 128 rows to the batch's longest quoted text (none: no rows) and Qwen's to the longest
    caption; diffusers' transformer on every padded row (masked) gives the same velocity."""
    noisy, t, cond = dit_inputs()
    if not quoted:
        cond.mask[:, -M.BYT5_MAX_LENGTH :] = 0
    qwen, qwen_mask, byt5, byt5_mask = M.unpack(cond.hidden_states, cond.mask, 12)
    with torch.no_grad():
        full = parts.denoiser(noisy, t.float(), qwen, qwen_mask, encoder_hidden_states_2=byt5,
                              encoder_attention_mask_2=byt5_mask, return_dict=False)[0]  # fmt: skip
    seen = []
    hook = parts.denoiser.context_embedder_2.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    try:
        trimmed = run(parts.denoiser, (noisy, t, cond))
    finally:
        hook.remove()
    assert seen == [5 if quoted else 0]  # dit_inputs: 5 byT5 tokens in the first caption
    torch.testing.assert_close(trimmed, full, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- files
def test_released_layouts_read_back_exactly(parts, files):
    """Tencent's DiT and VAE names, Comfy-Org's Qwen2.5-VL (model.) and byT5 (encoder. + shared.weight) files load into
    the same tensors; the DiT's keys are Tencent's (strict names: fused qkv / linear1, the final modulation)."""
    loaded = FAMILY.load(files["dit"], vae=files["vae"],
                         options=HunyuanOptions(text_encoder=str(files["text_encoder"]), byt5=str(files["byt5"])))  # fmt: skip
    for a, b in ((parts.denoiser, loaded.denoiser), (parts.vae, loaded.vae),
                 (parts.text_encoders[0], loaded.text_encoders[0]), (parts.text_encoders[1], loaded.text_encoders[1])):  # fmt: skip
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), type(a).__name__
    tencent = load_state_dict(files["dit"])[0]
    assert "double_blocks.0.img_attn_qkv.weight" in tencent and "single_blocks.3.linear1.weight" in tencent
    assert K.block_counts(tencent) == {"double_blocks": 4, "single_blocks": 4, K._REFINER: 2}
    # the final modulation's halves: Tencent (shift, scale) = diffusers (scale, shift)
    w = parts.denoiser.norm_out.linear.weight
    assert torch.equal(tencent["final_layer.adaLN_modulation.1.weight"], torch.cat(w.chunk(2)[::-1]))
    assert read_metadata(files["dit"])["sdtrain.family"] == "hunyuan_image"


def test_missing_or_wrong_files_are_named(files, tmp_path):
    with pytest.raises(ValueError, match="needs --byt5"):
        FAMILY.load(files["dit"], vae=files["vae"], options=HunyuanOptions(text_encoder=str(files["text_encoder"])))
    with pytest.raises(ValueError, match="--pretrained_model_name_or_path .*no HunyuanImage 2.1 DiT"):
        FAMILY.load(files["vae"], vae=files["vae"],
                    options=HunyuanOptions(text_encoder=str(files["text_encoder"]), byt5=str(files["byt5"])))  # fmt: skip


# ----------------------------------------------------------------------------- prompts
def test_prompts_as_sd_scripts_builds_them(parts):
    """Qwen: the shared encoder's rule (template, hidden_states[-3], 34 template tokens dropped) equals ours after the
    batch is cut to its longest caption; byT5: the quoted texts as 'Text "t". ', zeros without any."""
    captions = ['a sign that says "OPEN" and “café”', "a dog"]
    cond = FAMILY.encode_prompt(parts, captions)
    qwen, qmask, byt5, bmask = M.unpack(cond.hidden_states, cond.mask, 12)
    qwen, qmask = M.trim_text(qwen, qmask)
    ref, ref_mask = qwen25vl.encode(parts.text_encoders[0], parts.tokenizers[0], captions, M.TEMPLATE, M.DROP, -3)
    assert torch.equal(qmask, ref_mask)
    torch.testing.assert_close(qwen * qmask[..., None], ref * ref_mask[..., None])
    assert M.glyph_text(captions[0]) == 'Text "OPEN". Text "café". ' and M.glyph_text(captions[1]) is None
    assert int(bmask[0].sum()) == len('Text "OPEN". Text "café". '.encode()) + 1 and int(bmask[1].sum()) == 0
    assert torch.count_nonzero(byt5[1]) == 0 and len(parts.tokenizers[1]) == 1510


# ----------------------------------------------------------------------------- objective
@pytest.mark.parametrize("sampling", ["sigma", "uniform", "sigmoid", "shift", "flux_shift"])
def test_objective_by_its_formulas(sampling):
    """x_σ = (1 − σ) x0 + σ ε, target ε − x0, timesteps int(1000 σ); σ by the law (same draws, one generator)."""
    x0 = torch.randn(3, 4, 2, 3)
    cfg = HunyuanFlowConfig(timestep_sampling=sampling, discrete_flow_shift=5.0)
    ex = HunyuanFlowObjective(cfg, LossConfig()).example(x0, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(x0.shape, generator=g)
    if sampling == "sigma":
        sig = sigma_table(5.0)[0][(torch.rand(3, generator=g) * 1000).long()]
    elif sampling == "uniform":
        sig = torch.rand(3, generator=g)
    else:
        v = torch.sigmoid(torch.randn(3, generator=g))
        mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (1 * 1 - 256)  # (h // 2)(w // 2) = 1 token
        sig = {"sigmoid": v, "shift": 5 * v / (1 + 4 * v),
               "flux_shift": torch.exp(torch.tensor(mu)) / (torch.exp(torch.tensor(mu)) + (1 / v - 1))}[sampling]  # fmt: skip
    torch.testing.assert_close(ex.sigmas, sig)
    assert torch.equal(ex.timesteps, (sig * 1000).long()) and ex.timesteps.dtype == torch.int64
    s = sig.view(-1, 1, 1, 1)
    torch.testing.assert_close(ex.noisy, (1 - s) * x0 + s * noise)
    torch.testing.assert_close(ex.target, noise - x0)
    sig2, _ = sample_sigmas(cfg, 3, (2, 3), torch.Generator().manual_seed(1))
    assert ((sig2 > 0) & (sig2 <= 1)).all()


# ----------------------------------------------------------------------------- LoRA
def names_and_ranks(parts, *args: str) -> dict[str, int]:
    cfg = make_config(*args, module="networks.lora_hunyuan_image", dim=4, alpha=4.0,
                      flags=("--network_train_unet_only",))  # fmt: skip
    network = inject(cfg, FAMILY.adapter_roots(parts), FAMILY.target_classes)
    state = network.state_dict_for_file()
    network.eject()
    return {k.split(".")[0]: v.shape[0] for k, v in state.items() if k.endswith("lora_down.weight")}


def test_lora_rules_follow_sd_scripts(parts):
    """Every Linear of the double and single blocks (10 + 3 per block, sd-scripts' MMDoubleStreamBlock /
    MMSingleStreamBlock), Tencent names; network_reg_dims by re.search on the name; split_qkv = rank 3r / 4r."""
    p = copy.deepcopy(parts)
    default = names_and_ranks(p)
    assert len(default) == 4 * 10 + 4 * 3 and all(n.startswith("lora_unet_") for n in default)
    assert {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_3_txt_mod_linear",
            "lora_unet_single_blocks_1_linear1", "lora_unet_single_blocks_2_modulation_linear"} <= set(default)  # fmt: skip
    ranks = names_and_ranks(p, "network_reg_dims=single.*linear2=2,txt_mlp=0")
    assert ranks["lora_unet_single_blocks_0_linear2"] == 2 and not any("txt_mlp" in n for n in ranks)
    split = names_and_ranks(p, "split_qkv=True")
    assert split["lora_unet_double_blocks_0_img_attn_qkv"] == 12 and split["lora_unet_single_blocks_0_linear1"] == 16
    with pytest.raises(ConfigError, match="GGPO"):
        make_config("ggpo_beta=0.01", module="networks.lora_hunyuan_image")


def test_comfyui_rule_merge_equals_our_network(parts, tmp_path):
    """A saved LoRA merged by ComfyUI's rule (lora_unet_ + Tencent key, (α/r)·up@down into that weight, then Tencent ->
    diffusers) gives the output of our injected network."""
    p = copy.deepcopy(parts)
    inputs = dit_inputs()
    plain = run(p.denoiser, inputs)
    cfg = make_config("split_qkv=True", module="networks.lora_hunyuan_image", dim=4, alpha=2.0,
                      flags=("--network_train_unet_only",))  # fmt: skip
    network = inject(cfg, FAMILY.adapter_roots(p), FAMILY.target_classes)
    with torch.no_grad():
        perturb(network)
    network.set_training(False)
    adapted = run(p.denoiser, inputs)
    assert (adapted - plain).abs().max() > 1e-2
    path = tmp_path / "lora.safetensors"
    network.save(path, metadata={})
    network.eject()
    state, _ = load_state_dict(path)
    tencent = K.diffusers_to_tencent(p.denoiser.state_dict())
    for module in {k.split(".")[0] for k in state}:
        key = module.removeprefix("lora_unet_")
        matches = [k for k in tencent if k.endswith(".weight") and k[: -len(".weight")].replace(".", "_") == key]
        assert len(matches) == 1, module
        down, up = state[f"{module}.lora_down.weight"], state[f"{module}.lora_up.weight"]
        tencent[matches[0]] = tencent[matches[0]] + float(state[f"{module}.alpha"]) / down.shape[0] * up @ down
    merged = copy.deepcopy(p.denoiser)
    merged.load_state_dict(K.tencent_to_diffusers(tencent))
    torch.testing.assert_close(run(merged, inputs), adapted, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the script
def doc_command(files: dict, toml, out) -> list[str]:
    """docs/hunyuan_image_train_network.md's example with the tiny files for its paths; changed: --max_train_epochs 1
    (2 steps), --blocks_to_swap 2 (the tiny DiT has 4 + 4 blocks; the doc's 18 is for 20 + 40), no loader workers
    and a seed."""
    return [
        f"--pretrained_model_name_or_path={files['dit']}", f"--text_encoder={files['text_encoder']}",
        f"--byt5={files['byt5']}", f"--vae={files['vae']}", f"--dataset_config={toml}", f"--output_dir={out}",
        "--output_name=my_hunyuan_lora", "--save_model_as=safetensors",
        "--network_module=networks.lora_hunyuan_image", "--network_dim=16", "--network_alpha=1",
        "--network_train_unet_only", "--learning_rate=1e-4", "--optimizer_type=AdamW8bit", "--lr_scheduler=constant",
        "--attn_mode=torch", "--split_attn", "--max_train_epochs=1", "--save_every_n_epochs=1",
        "--mixed_precision=bf16", "--gradient_checkpointing", "--model_prediction_type=raw",
        "--discrete_flow_shift=5.0", "--blocks_to_swap=2", "--cache_text_encoder_outputs", "--cache_latents",
        "--max_data_loader_n_workers", "0", "--seed", "1",
    ]  # fmt: skip


def test_docs_command_line_runs(files, dataset_toml, tmp_path):
    result = hunyuan_image_train_network.run(doc_command(files, dataset_toml, tmp_path))
    assert result.steps == 2 and not result.failed
    shapes = {k: tuple(v.shape) for k, v in load_state_dict(files["dit"])[0].items()}
    assert_comfyui_loads(str(result.output), shapes, names="Tencent", fused="img_attn_qkv")
    meta = read_metadata(result.output)
    assert meta["modelspec.architecture"] == "hunyuan-image-2.1/lora"
    assert meta["ss_network_module"] == "networks.lora_hunyuan_image" and meta["ss_timestep_sampling"] == "sigma"
    # networks/convert_hunyuan_image_lora_to_comfy.py: ComfyUI's names fit ComfyUI's DiT keys; --reverse restores
    comfy, back = tmp_path / "comfy.safetensors", tmp_path / "back.safetensors"
    convert_hunyuan_image_lora_to_comfy.run([str(result.output), str(comfy)])
    comfy_shapes = {comfy_dit_key(k): v for k, v in shapes.items()}
    assert comfy_shapes.keys() != shapes.keys()
    assert_comfyui_loads(str(comfy), comfy_shapes, names="ComfyUI", fused="img_attn_qkv")
    assert any("img_mlp_0" in k for k in load_state_dict(comfy)[0])
    convert_hunyuan_image_lora_to_comfy.run(["--reverse", str(comfy), str(back)])
    original, restored = load_state_dict(result.output)[0], load_state_dict(back)[0]
    assert original.keys() == restored.keys() and all(torch.equal(original[k], restored[k]) for k in original)


@pytest.mark.parametrize(
    "change, message",
    [
        (("--fp8_base",), "--fp8_base is not supported for HunyuanImage 2.1 .*--fp8_scaled"),
        (("--attn_mode=xformers",), "--attn_mode xformers is not supported"),
    ],
)
def test_refused_flags_are_named_before_training(files, dataset_toml, tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        hunyuan_image_train_network.run([*doc_command(files, dataset_toml, tmp_path), *change])


def test_network_train_unet_only_is_required(files, dataset_toml, tmp_path):
    argv = [a for a in doc_command(files, dataset_toml, tmp_path) if a != "--network_train_unet_only"]
    with pytest.raises(ConfigError, match="add --network_train_unet_only"):
        hunyuan_image_train_network.run(argv)


def train_loss(parts, latents, cond) -> float:
    """The flow loss of ``parts`` on fixed latents, conditioning, noise and timesteps (σ = 0.2 ... 0.8)."""
    objective = HunyuanFlowObjective(HunyuanFlowConfig(), LossConfig())
    total = 0.0
    for t in (200, 400, 600, 800):
        ex = objective.example(latents, torch.Generator().manual_seed(t), timesteps=torch.full((latents.shape[0],), t))
        with torch.no_grad():
            pred = objective.prediction(FAMILY.predict(parts.denoiser, ex.noisy, ex.timesteps, cond), ex)
        total += objective.loss_per_sample(pred, ex).mean().item()
    return total


def counted_tokenizers(monkeypatch) -> dict[str, int]:
    """How many Qwen2.5-VL and byT5 tokenizers the family's loader builds from now on."""
    built = {"qwen": 0, "byt5": 0}
    for key, module, name in (("qwen", qwen25vl, "load_tokenizer"), ("byt5", M, "load_byt5_tokenizer")):
        load = getattr(module, name)

        def counted(*args, _key=key, _load=load):
            built[_key] += 1
            return _load(*args)

        monkeypatch.setattr(module, name, counted)
    return built


def test_loss_falls_and_resume_equals_an_uninterrupted_run(files, dataset, dataset_toml, tmp_path, monkeypatch):
    """20 steps at lr 3e-3: the loss on the training images (fixed noise and timesteps) falls with the LoRA applied;
    the run's --save_state at step 10, resumed to 20 in another folder, gives the same LoRA, bit for bit (the state
    comes from the uninterrupted run itself: one run fewer). Both keep their caches in one --cache_dir: the first
    run tokenizes (Qwen2.5-VL's tokenizer built once; byT5's only for quoted text), the resumed one reads every text
    output from there and builds no tokenizer (Qwen2.5-VL's: ~135 MB of the process)."""
    import logging

    import numpy as np
    from PIL import Image

    from networks.apply import apply_adapter_files

    def argv(out, steps, *extra):
        base = [a for a in doc_command(files, dataset_toml, out) if not a.startswith(("--max_train_epochs",
                                                                                      "--learning_rate", "--optimizer"))]  # fmt: skip
        return [*base, "--optimizer_type=AdamW", "--learning_rate=3e-3", "--max_train_steps", str(steps),
                "--cache_dir", str(tmp_path / "cache"), *extra]  # fmt: skip

    built = counted_tokenizers(monkeypatch)
    full = hunyuan_image_train_network.run(argv(tmp_path / "full", 20, "--save_every_n_steps", "10", "--save_state"))
    assert built == {"qwen": 1, "byt5": 0}  # byT5 tokenizes quoted text only: these captions have none
    state_dir = next(p for p in (tmp_path / "full").iterdir() if p.is_dir() and p.name.endswith("step00000010-state"))
    resumed = hunyuan_image_train_network.run(argv(tmp_path / "a", 20, "--resume", str(state_dir)))
    assert built == {"qwen": 1, "byt5": 0}  # every text output came from --cache_dir
    (a, _), (b, _) = load_state_dict(full.output), load_state_dict(resumed.output)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    options = HunyuanOptions(text_encoder=str(files["text_encoder"]), byt5=str(files["byt5"]))
    parts = FAMILY.load(files["dit"], vae=files["vae"], options=options)
    folder = dataset / "10_sks shape"
    images = sorted(folder.glob("*.png"))
    pixels = torch.stack([torch.from_numpy(np.array(Image.open(p).convert("RGB").resize((64, 64)))).permute(2, 0, 1)
                          .float() / 127.5 - 1 for p in images])  # fmt: skip
    captions = [p.with_suffix(".txt").read_text().strip() for p in images]
    with torch.no_grad():
        latents = FAMILY.encode_latents(parts, pixels, torch.Generator().manual_seed(0))
        cond = FAMILY.encode_prompt(parts, captions)
    before = train_loss(parts, latents, cond)
    apply_adapter_files([(full.output, 1.0)], FAMILY.adapter_roots(parts), True, "cpu", logging.getLogger("test"))
    after = train_loss(parts, latents, cond)
    assert after < 0.97 * before, (before, after)
