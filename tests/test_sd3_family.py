"""The SD3 / SD3.5 family against independent oracles: diffusers' single-file converter
(``convert_sd3_transformer_checkpoint_to_diffusers``) at tiny and at the real widths (index tensors, no memory),
diffusers' ``SD3Transformer2DModel`` / ``StableDiffusion3Pipeline`` on the same weights, sd-scripts' formulas
re-typed from its source (text-encoder dropout, the MMDiT's positional-embedding crops), and load/save round trips of
every input layout (tiny files written here from the tiny models)."""

from __future__ import annotations

import pytest
import torch

from library.families.sd3 import keys as K

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


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_sai_map_equals_diffusers_converter_at_real_width(variant):
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers as convert

    from library.families.sd3.configs import released, transformer_factory

    with init_empty_weights():
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
