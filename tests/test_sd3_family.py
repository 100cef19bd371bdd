"""The SD3 / SD3.5 family against independent oracles: diffusers' single-file converter
(``convert_sd3_transformer_checkpoint_to_diffusers``) at tiny and at the real widths (index tensors, no memory),
diffusers' ``SD3Transformer2DModel`` / ``StableDiffusion3Pipeline`` on the same weights, sd-scripts' formulas
re-typed from its source (text-encoder dropout, the MMDiT's positional-embedding crops), and load/save round trips of
every input layout (tiny files written here from the tiny models)."""

from __future__ import annotations

import pytest
import torch

from library.families import FAMILIES, Cond, block_layout, detect_family
from library.families.protocol import missing_members
from library.families.sd3 import SD3_MEDIUM, SD35_LARGE, SD35_MEDIUM
from library.families.sd3 import keys as K
from library.families.sd3.options import SD3Options
from library.families.sd3.tiny import build_tiny_sd3, write_tiny_files

TINY_DIT = dict(sample_size=32, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=8,
                num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64,
                out_channels=16, pos_embed_max_size=16)  # fmt: skip
LAYOUTS = {"sd3": ((), None), "sd3.5-medium": ((0, 1), "rms_norm"), "sd3.5-large": ((), "rms_norm")}


def _tiny_dit(variant: str) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    dual, qk_norm = LAYOUTS[variant]
    torch.manual_seed(0)
    return SD3Transformer2DModel(**TINY_DIT, dual_attention_layers=dual, qk_norm=qk_norm)


# ------------------------------------------------------------------------------------------------ key maps
@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_sai_map_equals_diffusers_converter_at_tiny_width(variant):
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers as convert

    wanted = _tiny_dit(variant).state_dict()
    sai = K.diffusers_to_sai(wanted, prefix=K.SAI_PREFIX)
    assert K.is_sai(sai) and not K.is_diffusers(sai) and K.is_diffusers(wanted)
    assert K.sai_layout(sai).variant == K.diffusers_layout(wanted).variant == variant
    theirs_input = dict(sai)
    theirs = convert(theirs_input)
    assert theirs_input == {}  # diffusers consumed every SAI key we wrote
    ours = K.sai_to_diffusers(sai)
    assert set(ours) == set(theirs) == set(wanted)
    for key in wanted:
        assert torch.equal(theirs[key], wanted[key]), key
        assert torch.equal(ours[key], wanted[key]), key
    view = K.SaiToDiffusers(sai)
    assert all(view.shape(k) == wanted[k].shape for k in wanted)
    assert view.missing_sources() == [] and view.unused_sources() == []


@pytest.mark.parametrize("variant", ["sd3.5-medium"])  # dual attention and q/k norms: every kind of entry
def test_sai_map_equals_diffusers_converter_at_real_width(variant):
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers as convert

    from library.families.sd3.configs import released, transformer_factory

    with init_empty_weights(include_buffers=True):
        real = transformer_factory(released(variant)["transformer"])()
    wanted = real.state_dict()
    # one index tensor per SAI key: (key number, row) identifies every row; width 1 so no real-size copies
    sai = {}
    for i, (key, value) in enumerate(K.diffusers_to_sai(wanted).items()):
        rows = i * 10**6 + torch.arange(
            value.shape[1 if value.ndim == 3 else 0], dtype=torch.float64
        )  # pos_embed: (1, N, D)
        sai[key] = rows.view(1, -1, 1) if value.ndim == 3 else (rows.view(-1, 1) if value.ndim >= 2 else rows)
    theirs_input = dict(sai)
    theirs = convert(theirs_input)
    assert theirs_input == {}
    ours = K.sai_to_diffusers(sai)
    assert set(ours) == set(theirs) == set(wanted)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
        dim = 1 if wanted[key].ndim == 3 else 0
        assert ours[key].shape[dim] == wanted[key].shape[dim], key
    assert K.sai_layout(sai).variant == variant
    assert K.sai_layout(sai).num_layers == released(variant)["transformer"]["num_layers"]


def test_adapter_renames_and_fused_modules_cover_every_linear():
    """Every Linear of the diffusers transformer is named once: either renamed to its SAI module, or a segment of a
    fused SAI module; the swapped modulations take rows D: then :D."""
    model = _tiny_dit("sd3.5-medium")
    layout = K.diffusers_layout(model.state_dict())
    renames, fused = K.module_renames(layout), K.fused_modules(layout, 32)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    in_fused = [s.path for f in fused for s in f.segments if s.start == 0 and s.stop is None]
    swapped = {f.name: f.segments for f in fused if len(f.segments) == 2}
    assert set(swapped) == {"final_layer.adaLN_modulation.1", "joint_blocks.2.context_block.adaLN_modulation.1"}
    for segments in swapped.values():
        assert [(s.start, s.stop) for s in segments] == [(32, None), (0, 32)]
    swapped_paths = {s.path for segs in swapped.values() for s in segs}
    assert linears == (set(renames) & linears) | set(in_fused) | swapped_paths
    assert len(in_fused) == len(set(in_fused))
    assert renames["transformer_blocks.0.attn2.to_out.0"] == "joint_blocks.0.x_block.attn2.proj"
    assert renames["pos_embed.proj"] == "x_embedder.proj"


# ------------------------------------------------------------------------------------------------ tiny models, files
VARIANTS = {"sd3": SD3_MEDIUM, "sd3.5-medium": SD35_MEDIUM, "sd3.5-large": SD35_LARGE}


@pytest.fixture(scope="module")
def tiny():
    return {name: build_tiny_sd3(name, blocks=3 if name == "sd3.5-large" else None) for name in VARIANTS}


class _Files(dict):
    """Per variant, written when first asked: the SAI file with encoders, the separate clip_l / clip_g / t5xxl / vae
    files, a diffusers folder (written by diffusers itself), and an SAI file of the transformer alone."""

    def __init__(self, tiny, factory):
        super().__init__()
        self.tiny, self.factory = tiny, factory

    def __missing__(self, name):
        from safetensors.torch import save_file

        parts = self.tiny[name]
        folder = self.factory.mktemp(name.replace(".", "_"))
        written = write_tiny_files(parts, folder)
        bare = folder / "transformer_only.safetensors"
        save_file({k: v.contiguous() for k, v in K.diffusers_to_sai(parts.denoiser.state_dict()).items()}, bare)
        written["bare"] = bare
        self[name] = written
        return written


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory):
    return _Files(tiny, tmp_path_factory)


def _states_equal(a: torch.nn.Module, b: torch.nn.Module, dtype=None) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        want = sb[k] if dtype is None else sb[k].to(dtype)
        assert torch.equal(sa[k].float(), want.float()), k


def _parts_equal(loaded, parts) -> None:
    _states_equal(loaded.denoiser, parts.denoiser)
    _states_equal(loaded.vae, parts.vae)
    assert len(loaded.text_encoders) == 3
    for a, b in zip(loaded.text_encoders, parts.text_encoders):
        _states_equal(a, b)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_input_layout_loads_the_same_parts(tiny, files, name, tmp_path):
    family, parts, f = VARIANTS[name], tiny[name], files[name]
    _parts_equal(family.load(f["model"]), parts)  # SAI file with its encoders and VAE
    assert detect_family(f["model"]) is family and detect_family(f["bare"]) is family
    if name != "sd3.5-medium":
        return  # the other layouts are read by the same code for every variant: checked on the richest one
    separate = family.load(
        f["bare"], vae=f["vae"], options=SD3Options(clip_l=f["clip_l"], clip_g=f["clip_g"], t5xxl=f["t5xxl"])
    )
    _parts_equal(separate, parts)
    folder = family.load(f["diffusers"])
    _parts_equal(folder, parts)
    assert [type(t).__name__ for t in folder.tokenizers[:2]] == [type(t).__name__ for t in separate.tokenizers[:2]]
    # our own writers: the SAI file (with configs) and a diffusers folder, read back equal
    ours = family.save(parts, tmp_path / "ours.safetensors")
    _parts_equal(family.load(ours), parts)
    _parts_equal(family.load(family.save(parts, tmp_path / "folder")), parts)
    with_folders = family.load(f["bare"], vae=f["diffusers"], options=SD3Options(clip_l=f["clip_l"], clip_g=f["diffusers"] / "text_encoder_2", t5xxl=f["diffusers"]))  # fmt: skip
    _parts_equal(with_folders, parts)
    assert detect_family(f["diffusers"]) is family and detect_family(ours) is family


def test_fp8_file_and_flags_replace_embedded_parts(tiny, files, tmp_path):
    family, parts, f = SD3_MEDIUM, tiny["sd3"], files["sd3"]
    fp8 = write_tiny_files(parts, tmp_path, fp8=True)["model"]
    loaded = family.load(fp8, dtype=torch.bfloat16)
    want = {k: v.to(torch.float8_e4m3fn).to(torch.bfloat16) for k, v in parts.denoiser.state_dict().items()}
    assert all(torch.equal(v, want[k]) for k, v in loaded.denoiser.state_dict().items())
    # a diffusers-named transformer single file ("transformer." prefix, as some exports have)
    from safetensors.torch import save_file

    named = tmp_path / "diffusers_transformer.safetensors"
    save_file({f"transformer.{k}": v.contiguous() for k, v in parts.denoiser.state_dict().items()}, named)
    assert detect_family(named) is family
    _states_equal(family.load(named, vae=f["vae"], options=SD3Options(clip_l=f["clip_l"], clip_g=f["clip_g"], t5xxl=f["t5xxl"])).denoiser,
                  parts.denoiser)  # fmt: skip
    other = build_tiny_sd3("sd3", seed=1)
    other_files = write_tiny_files(other, tmp_path / "other")
    mixed = family.load(
        f["model"], options=SD3Options(clip_g=other_files["clip_g"])
    )  # the flag wins over the embedded CLIP-G
    _states_equal(mixed.text_encoders[1], other.text_encoders[1])
    _states_equal(mixed.text_encoders[0], parts.text_encoders[0])


def test_clear_errors_name_the_missing_flag_and_the_wrong_file(files, tiny):
    f = files["sd3"]
    with pytest.raises(ValueError, match=r"--clip_l, --clip_g, --t5xxl, --vae are required"):
        SD3_MEDIUM.load(f["bare"])
    with pytest.raises(ValueError, match=r"--clip_g is required"):
        SD3_MEDIUM.load(f["bare"], vae=f["vae"], options=SD3Options(clip_l=f["clip_l"], t5xxl=f["t5xxl"]))
    with pytest.raises(ValueError, match=r"this is an sd3.5-medium model, but sd3 was expected"):
        SD3_MEDIUM.load(files["sd3.5-medium"]["model"])
    with pytest.raises(ValueError, match=r"--clip_l .*clip_g.safetensors|no CLIP-L weights|CLIP-L \(--clip_l\)"):
        SD3_MEDIUM.load(
            f["bare"], vae=f["vae"], options=SD3Options(clip_l=f["t5xxl"], clip_g=f["clip_g"], t5xxl=f["t5xxl"])
        )
    with pytest.raises(ValueError, match=r"--t5_dropout_rate 1.5"):
        SD3_MEDIUM.load(f["model"], options=SD3Options(t5_dropout_rate=1.5))
    with pytest.raises(FileNotFoundError, match=r"--clip_g .*nothing.safetensors"):
        SD3_MEDIUM.load(f["model"], options=SD3Options(clip_g=f["model"].parent / "nothing.safetensors"))


def test_diffusers_reads_our_sai_file(tiny, files, tmp_path):
    """diffusers' own single-file loaders (the SAI converters for the transformer, CLIP-L/G, T5 and VAE) read what
    our writer saves as the parts."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    parts = tiny["sd3.5-medium"]
    path = SD35_MEDIUM.save(parts, tmp_path / "ours.safetensors")
    config = str(files["sd3.5-medium"]["diffusers"])
    transformer = SD3Transformer2DModel.from_single_file(str(path), config=config, subfolder="transformer",
                                                         local_files_only=True)  # fmt: skip
    _states_equal(transformer, parts.denoiser)
    pipe = StableDiffusion3Pipeline.from_single_file(str(path), config=config, local_files_only=True)
    _states_equal(pipe.vae, parts.vae)
    for theirs, ours in zip((pipe.text_encoder_2, pipe.text_encoder_3), parts.text_encoders[1:]):
        _states_equal(theirs, ours)
    # diffusers' SAI reader always gives CLIP-L an identity text_projection (single_file_utils: "clip_sd3"), even
    # where the file holds one; every other CLIP-L tensor is ours (sd-scripts, and we, read the stored projection)
    theirs, ours = pipe.text_encoder.state_dict(), parts.text_encoders[0].state_dict()
    assert torch.equal(theirs.pop("text_projection.weight"), torch.eye(32)) and set(theirs) < set(ours)
    assert all(torch.equal(v, ours[k]) for k, v in theirs.items())


# ------------------------------------------------------------------------------------------------ text, predict
def _pipeline(parts):
    return SD35_MEDIUM.pipeline(parts, None)


@pytest.mark.parametrize("name", ["sd3", "sd3.5-medium"])
def test_text_encoding_equals_the_pipelines_encode_prompt(tiny, name):
    parts, family = tiny[name], VARIANTS[name]
    prompts = ["a photo of a cat", "a dog on a hill, oil painting"]
    ours = family.encode_prompt(parts, prompts)
    embeds, _, pooled, _ = _pipeline(parts).encode_prompt(prompts, prompts, prompts, do_classifier_free_guidance=False,
                                                          max_sequence_length=256)  # fmt: skip
    assert ours.hidden_states.shape == (2, 77 + 256, 80) and ours.mask is None
    assert (ours.hidden_states - embeds).abs().max() < 1e-6
    assert (ours.pooled - pooled).abs().max() < 1e-6
    # CLIP-G pads with "!" (id 0), CLIP-L with <|endoftext|>, as sd-scripts' Sd3TokenizeStrategy
    tokens = family.tokenize(parts, ["a cat"])
    assert tokens[1][0, -1] == 0 and tokens[0][0, -1] == 49407 and tokens[2].shape == (1, 256)
    # the masks reach the encoders only when asked, and then change what they return
    masked = family.encode_prompt(parts, prompts, apply_lg_attn_mask=True, apply_t5_attn_mask=True)
    assert not torch.allclose(masked.hidden_states[:, :77], ours.hidden_states[:, :77])
    assert not torch.allclose(masked.hidden_states[:, 77:], ours.hidden_states[:, 77:])
    short = family.encode_prompt(parts, prompts, t5xxl_max_token_length=32)
    assert short.hidden_states.shape[1] == 77 + 32
    # the partial text cache: CLIP-L/G recomputed over cached T5 tokens gives the full encoding back
    cached = Cond(torch.cat([torch.zeros_like(ours.hidden_states[:, :77]), ours.hidden_states[:, 77:]], 1))
    again = family.cond_with_trained_encoders(parts, prompts, cached)
    assert torch.allclose(again.hidden_states, ours.hidden_states, atol=1e-6)
    assert torch.allclose(again.pooled, ours.pooled, atol=1e-6)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_predict_equals_the_pipelines_transformer_call(tiny, name):
    """One Euler step of StableDiffusion3Pipeline (σ 1 -> 0, no CFG) from given latents is latents - v, v the
    transformer's output at timestep 1000: our predict on the same inputs gives the same v."""
    parts, family = tiny[name], VARIANTS[name]
    cond = family.encode_prompt(parts, ["a cat", "a house"])
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    out = _pipeline(parts)(prompt_embeds=cond.hidden_states, pooled_prompt_embeds=cond.pooled, latents=latents,
                           num_inference_steps=1, guidance_scale=1.0, output_type="latent", height=64,
                           width=64).images  # fmt: skip
    with torch.no_grad():
        v = family.predict(parts.denoiser, latents, torch.full((2,), 1000.0), cond)
    assert (out - (latents - v)).abs().max() < 1e-5
    assert family.flow_sampling(parts).latent_channels == 16 and parts.scheduler_config["shift"] == 3.0


def _dropout_law_sd_scripts(batch, rl, rg, rt, draw):
    """sd-scripts' Sd3TextEncodingStrategy.drop_cached_text_encoder_outputs draw order, re-typed: per sample L then
    G, then per sample T5 (``rate > 0 and random.random() < rate``)."""
    drop_l, drop_g = [], []
    for _ in range(batch):
        drop_l.append(rl > 0.0 and draw() < rl)
        drop_g.append(rg > 0.0 and draw() < rg)
    drop_t5 = [rt > 0.0 and draw() < rt for _ in range(batch)]
    return drop_l, drop_g, drop_t5


def test_text_dropout_follows_sd_scripts_and_acts_only_in_training_steps(tiny, files):
    import dataclasses
    import random

    from library.families.sd3.family import text_dropout_of
    from library.families.sd3.objective import SD3FlowConfig
    from library.families.sd3.text import drop_encoders
    from library.objectives.losses import LossConfig
    from library.objectives.noising import NoiseConfig

    parts = SD3_MEDIUM.load(files["sd3"]["model"], options=SD3Options(clip_l_dropout_rate=0.5, clip_g_dropout_rate=0.3, t5_dropout_rate=0.4))  # fmt: skip
    cond = SD3_MEDIUM.encode_prompt(parts, [f"prompt {i}" for i in range(16)])
    dropout = text_dropout_of(parts)
    assert (dropout.l_width, dropout.g_width, dropout.l_pooled) == (32, 48, 32)
    dropped = drop_encoders(cond, dropout, random.Random(7))
    drop_l, drop_g, drop_t5 = _dropout_law_sd_scripts(16, 0.5, 0.3, 0.4, random.Random(7).random)
    assert any(drop_l) and any(drop_g) and any(drop_t5) and not all(drop_l)
    h, p = dropped.hidden_states, dropped.pooled
    for i in range(16):
        assert bool((h[i, :77, :32] == 0).all()) == drop_l[i] and bool((p[i, :32] == 0).all()) == drop_l[i]
        assert bool((h[i, :77, 32:80] == 0).all()) == drop_g[i] and bool((p[i, 32:] == 0).all()) == drop_g[i]
        assert bool((h[i, 77:] == 0).all()) == drop_t5[i]
        kept = ~torch.tensor([drop_l[i]] * 32 + [drop_g[i]] * 48)
        assert torch.equal(h[i, :77, kept], cond.hidden_states[i, :77, kept])
    # every training step's predict gets the dropout; with gradients off (validation, sampling) it does nothing
    parts.options = dataclasses.replace(parts.options, flow=SD3FlowConfig())  # what a training script reads
    objective = SD3_MEDIUM.training_objective(parts, NoiseConfig(), LossConfig())
    assert objective.predict_options["text_dropout"] == dropout
    plain = dataclasses.replace(tiny["sd3"], options=SD3Options(flow=SD3FlowConfig()))  # no dropout rates
    assert "text_dropout" not in SD3_MEDIUM.training_objective(plain, NoiseConfig(), LossConfig()).predict_options
    x, t = torch.randn(16, 16, 8, 8), torch.full((16,), 500.0)
    with torch.no_grad():
        plain = SD3_MEDIUM.predict(parts.denoiser, x, t, cond)
        assert torch.equal(SD3_MEDIUM.predict(parts.denoiser, x, t, cond, **objective.predict_options), plain)
    random.seed(3)
    trained = SD3_MEDIUM.predict(parts.denoiser, x, t, cond, **objective.predict_options)
    random.seed(3)
    with torch.no_grad():
        expected = SD3_MEDIUM.predict(parts.denoiser, x, t, drop_encoders(cond, dropout))
    assert torch.allclose(trained, expected, atol=1e-6) and not torch.allclose(trained, plain, atol=1e-4)


# ------------------------------------------------------------------------------------------------ positional embedding
def _sd_scripts_scaled_table(embed_dim, grid_size, sample_size, base_size=16):
    """sd-scripts' get_scaled_2d_sincos_pos_embed (library/sd3_models.py), re-typed in numpy."""
    import numpy as np

    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64)
        omega /= dim / 2.0
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid_h = np.arange(grid_size, dtype=np.float32) / grid_size
    grid_w = np.arange(grid_size, dtype=np.float32) / grid_size
    scale = base_size * grid_size / sample_size
    shift = scale * (grid_size - sample_size) / (2 * grid_size)
    grid_h, grid_w = grid_h * scale - shift, grid_w * scale - shift
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])
    emb = np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)
    return torch.from_numpy(emb).float().unsqueeze(0)


def test_positional_embedding_options_follow_sd_scripts(tiny, files):
    """Random crop: sd-scripts' draws (torch.rand(1) < rate, then randint top, left) pick the window the forward
    uses; scaled tables equal sd-scripts' numpy formula and are chosen by area; neither acts on the state dict."""

    parts = SD3_MEDIUM.load(files["sd3"]["model"], options=SD3Options(pos_emb_random_crop_rate=1.0))
    embed = parts.denoiser.pos_embed
    size = embed.pos_embed_max_size
    table = embed.pos_embed.reshape(1, size, size, -1)
    torch.manual_seed(5)
    with torch.enable_grad():
        got = embed.cropped_pos_embed(8, 12)  # latent pixels: 4 × 6 patches
    torch.manual_seed(5)
    assert torch.rand(1).item() < 1.0
    top, left = torch.randint(0, size - 4 + 1, (1,)).item(), torch.randint(0, size - 6 + 1, (1,)).item()
    assert torch.equal(got, table[:, top : top + 4, left : left + 6].reshape(1, 24, -1))
    with torch.no_grad():  # sampling / validation: the centred crop, as diffusers
        centred = embed.cropped_pos_embed(8, 12)
    c_top, c_left = (size - 4) // 2, (size - 6) // 2
    assert torch.equal(centred, table[:, c_top : c_top + 4, c_left : c_left + 6].reshape(1, 24, -1))
    assert set(parts.denoiser.state_dict()) == set(tiny["sd3"].denoiser.state_dict())
    # scaled tables: resolutions 64 and 128 px -> latent 8, 16 -> patched 4, 8 -> grids 6, 12
    SD3_MEDIUM.set_pos_embed(parts, 0.0, [64, (128, 128)])
    assert embed.area_bounds == [((16 + 64) // 2, 4), (144, 8)]
    for n, grid in ((4, 6), (8, 12)):
        assert torch.allclose(embed.scaled[n], _sd_scripts_scaled_table(32, grid, n), atol=1e-6)
    small = embed.cropped_pos_embed(8, 8)  # 4 × 4 patches: area 16 <= 40 -> the n = 4 table, centred in 6 × 6
    assert torch.equal(small, embed.scaled[4].reshape(1, 6, 6, -1)[:, 1:5, 1:5].reshape(1, 16, -1))
    wide = embed.cropped_pos_embed(8, 24)  # 4 × 12 patches: area 48 -> n = 8 (12 × 12 grid)
    assert torch.equal(wide, embed.scaled[8].reshape(1, 12, 12, -1)[:, 4:8, 0:12].reshape(1, 48, -1))
    x = torch.randn(1, 16, 8, 8)
    cond = SD3_MEDIUM.encode_prompt(parts, ["a cat"])
    with torch.no_grad():
        scaled_out = SD3_MEDIUM.predict(parts.denoiser, x, torch.full((1,), 500.0), cond)
        SD3_MEDIUM.set_pos_embed(parts)
        plain_out = SD3_MEDIUM.predict(parts.denoiser, x, torch.full((1,), 500.0), cond)
    assert not torch.allclose(scaled_out, plain_out)


# ------------------------------------------------------------------------------------------------ contract, names
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_satisfies_the_family_contract(tiny, name):
    from tests.test_family_contract import signature_problems

    family, parts = VARIANTS[name], tiny[name]
    assert FAMILIES[name] is family and missing_members(family) == [] and signature_problems(family) == []
    assert family.objective(parts) == parts.prediction_type == "flow_matching"
    assert len(family.ti_embedding_keys) == family.num_text_encoders == len(parts.text_encoders) == 3
    assert tuple(r.prefix for r in family.adapter_roots(parts)) == family.adapter_prefixes
    assert family.spec.training_script == "sd3_train_network.py" and family.size_multiple == 16
    model_type = {"sd3": "medium", "sd3.5-medium": "5-medium", "sd3.5-large": "5-large"}[name]
    assert family.base_model_version() == model_type
    assert family.modelspec_architecture("lora") == f"stable-diffusion-3-{model_type}/lora"
    assert family.modelspec_implementation("lora") == "diffusers" and family.default_resolution() == 1024
    assert family.size_conditioning(None, None, None) is None
    assert [len(b.blocks) for b in family.swap_blocks(parts.denoiser)] == [parts.denoiser.config.num_layers]
    assert family.blocks.index("lora_unet_joint_blocks_2_x_block_attn_qkv") == 2
    assert block_layout(["lora_unet_joint_blocks_0_context_block_mlp_fc1"]) is family.blocks
    if name != "sd3.5-large":
        return  # the released configs of all three are checked by the real-width key-map tests
    reference = family.reference_parts()
    assert reference.vae is None and {p.device.type for p in reference.denoiser.parameters()} == {"meta"}
    config = reference.denoiser.config
    assert (config.num_layers, config.num_attention_heads * config.attention_head_dim) == (38, 2432)
    assert K.diffusers_layout(reference.denoiser.state_dict()).variant == name
    assert reference.text_encoders[2].config.d_model == 4096


def test_adapter_roots_name_every_linear_by_its_sai_module(tiny):
    """Every Linear of the transformer gets exactly one SAI name (a rename or a fused module) and the fused
    weights equal the SAI tensors, so kohya names follow ComfyUI's rule (lora_unet_ + SAI key, dots as _)."""
    import re

    parts = tiny["sd3.5-medium"]
    unet = SD35_MEDIUM.adapter_roots(parts)[0]
    sai = K.diffusers_to_sai(parts.denoiser.state_dict())
    linears = {p: m for p, m in unet.module.named_modules() if isinstance(m, torch.nn.Linear)}
    fused_paths = {s.path for f in unet.fused for s in f.segments}
    named = {unet.rename(p): m.weight for p, m in linears.items() if p not in fused_paths}
    for fused in unet.fused:
        named[fused.name] = torch.cat([linears[s.path].weight[s.start : s.stop] for s in fused.segments])
    sai_linears = {k.removesuffix(".weight") for k, v in sai.items() if k.endswith(".weight") and v.ndim == 2}
    assert set(named) == sai_linears
    for name, weight in named.items():
        assert torch.equal(weight, sai[name + ".weight"]), name
        assert re.fullmatch(r"lora_unet_[A-Za-z0-9_]+", "lora_unet_" + name.replace(".", "_"))
    assert "joint_blocks.0.x_block.attn2.qkv" in named and "joint_blocks.1.context_block.adaLN_modulation.1" in named


def test_make_tiny_model_writes_every_sd3_layout(tmp_path):
    """tools/make_tiny_model.py --family sd3.5-large: the diffusers folder, the SAI file with encoders, the SAI file
    without them plus the --clip_l/--clip_g/--t5xxl/--vae files; all load the same model. By default the tiny
    3.5-large has 34 blocks (sd-scripts' documented --blocks_to_swap 32 keeps 2 blocks on the device); 3 here."""
    from library.families.sd3.tiny import transformer_config
    from tools.make_tiny_model import run

    assert transformer_config("sd3.5-large")["num_layers"] == 34
    run(["--out", str(tmp_path), "--family", "sd3.5-large", "--sd3_blocks", "3"])
    full = SD35_LARGE.load(tmp_path / "sd3.5-large.safetensors")
    assert full.denoiser.config.num_layers == 3 and full.denoiser.config.qk_norm == "rms_norm"
    split = {flag: tmp_path / f"sd3.5-large_{flag}.safetensors" for flag in ("clip_l", "clip_g", "t5xxl")}
    vae = tmp_path / "sd3.5-large_vae.safetensors"
    _parts_equal(SD35_LARGE.load(tmp_path / "sd3.5-large_dit.safetensors", vae=vae, options=SD3Options(**split)), full)
    _parts_equal(SD35_LARGE.load(tmp_path / "sd3.5-large"), full)
    from library.families.tiny import tiny_model_folder  # what the demo builds

    assert detect_family(tiny_model_folder("sd3", tmp_path / "demo")) is SD3_MEDIUM


def test_attention_backends_keep_sd3s_joint_attention(tiny):
    """The run layer's --sdpa / --xformers switch (library/runtime.set_attention) leaves SD3's joint attention
    processors alone (AttnProcessor2_0 cannot return the two streams): the prediction is unchanged."""
    from library.run.runtime import set_attention

    parts = build_tiny_sd3("sd3.5-medium")
    cond = SD35_MEDIUM.encode_prompt(parts, ["a cat"])
    x, t = torch.randn(1, 16, 8, 8), torch.full((1,), 500.0)
    with torch.no_grad():
        before = SD35_MEDIUM.predict(parts.denoiser, x, t, cond)
        for backend in ("sdpa", "xformers"):
            set_attention([parts.denoiser], backend)
            assert torch.equal(SD35_MEDIUM.predict(parts.denoiser, x, t, cond), before)
