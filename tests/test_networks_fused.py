"""Fused adapter targets on a tiny diffusers FluxTransformer2DModel (networks/fused.py).

The Root here is hand-written with BFL names (the FLUX family builds the real one): ``double_blocks.0.img_attn.qkv``
= attn.to_q | to_k | to_v, ``double_blocks.0.txt_attn.qkv`` = add_q/k/v_proj, ``single_blocks.0.linear1`` =
to_q | to_k | to_v | proj_mlp, ``final_layer.adaLN_modulation.1`` = norm_out.linear with its halves swapped.

Oracle: the same model, un-adapted, whose leaves got the dense ΔW written into their weights, where ΔW is computed
here from the adapter's own tensors by the algorithm's pure ``delta_weight`` on the stacked weight (DoRA re-typed:
m·(W+ΔW)/‖W+ΔW‖ over the *stacked* weight), then split by rows with the test's own BFL table.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from _flux_helpers import run_flux
from _networks_helpers import make_config, single_thread  # noqa: F401

from library.families.base import Fused, Root, Segment, TargetClasses
from networks import inject, merge_files_into_base, network_from_file
from networks.fused import FusedLeaf
from networks.targets import builtin_preset, find_targets

INNER = 32  # 2 heads x 16
MLP = 128

# fused kohya module -> [(leaf path, leaf rows), ...] in the BFL weight's row order (the test's own table)
FUSED = {
    "double_blocks.0.img_attn.qkv": [(f"transformer_blocks.0.attn.to_{x}", slice(None)) for x in "qkv"],
    "double_blocks.0.txt_attn.qkv": [(f"transformer_blocks.0.attn.add_{x}_proj", slice(None)) for x in "qkv"],
    "single_blocks.0.linear1": [(f"single_transformer_blocks.0.attn.to_{x}", slice(None)) for x in "qkv"]
    + [("single_transformer_blocks.0.proj_mlp", slice(None))],
    # BFL's final layer holds (shift, scale), diffusers' norm_out.linear (scale, shift)
    "final_layer.adaLN_modulation.1": [("norm_out.linear", slice(INNER, None)), ("norm_out.linear", slice(0, INNER))],
}
RENAME = {
    "transformer_blocks.0.attn.to_out.0": "double_blocks.0.img_attn.proj",
    "transformer_blocks.0.attn.to_add_out": "double_blocks.0.txt_attn.proj",
    "transformer_blocks.0.ff.net.0.proj": "double_blocks.0.img_mlp.0",
    "transformer_blocks.0.ff.net.2": "double_blocks.0.img_mlp.2",
    "transformer_blocks.0.ff_context.net.0.proj": "double_blocks.0.txt_mlp.0",
    "transformer_blocks.0.ff_context.net.2": "double_blocks.0.txt_mlp.2",
    "transformer_blocks.0.norm1.linear": "double_blocks.0.img_mod.lin",
    "transformer_blocks.0.norm1_context.linear": "double_blocks.0.txt_mod.lin",
    "single_transformer_blocks.0.norm.linear": "single_blocks.0.modulation.lin",
    "single_transformer_blocks.0.proj_out": "single_blocks.0.linear2",
}
CLASSES = TargetClasses(
    transformer=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    attention=("FluxAttention",),
    full_names=("norm_out.linear",),
)


def rename(path: str) -> str:
    return RENAME[path]


def flux_root(model) -> Root:
    fused = tuple(
        Fused(name, tuple(Segment(p, rows.start or 0, rows.stop) for p, rows in leaves))
        for name, leaves in FUSED.items()
    )
    return Root("lora_unet", model, rename, fused)


def tiny_flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))  # fmt: skip
    with torch.no_grad():  # diffusers zero-inits some projections: give every weight a value
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


run = run_flux  # the tiny transformer's output on the shared inputs (tests/_flux_helpers.py)


def randomize(network, seed: int = 3) -> None:
    """Non-zero adapters (a fresh one has ΔW = 0): every tensor gets a random value (OFT blocks stay small)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in network.adapters.values():
            for p in adapter.parameters():
                p.copy_(p + torch.randn(p.shape, generator=g) * 0.1)


def dense_delta(adapter, shape, base: torch.Tensor) -> torch.Tensor:
    """W' − W from the adapter's own tensors: the algorithm's pure ΔW on the (stacked) weight, DoRA re-typed."""
    algo = adapter.algo
    kw = {"multiplier": 1.0} if algo.multiplier_inside else {}
    delta = algo.delta_weight(dict(adapter.tensors()), adapter.scale(), shape, base=base, alpha=adapter.alpha, **kw)
    if adapter.magnitude is not None:
        merged = base + delta
        m = adapter.magnitude
        axis = 1 if m.shape[0] == shape[0] else 0  # (out, 1): norm of each row; (1, in): of each column
        norm = merged.norm(dim=axis, keepdim=True) + torch.finfo(merged.dtype).eps
        delta = m * merged / norm - base
    return delta


def oracle(model, network):
    """Eject ``network`` and return a copy of the un-adapted ``model`` with every adapter's dense ΔW (and bias
    change) written into its leaves."""
    adapters = dict(network.adapters.items())
    network.eject()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, adapter in adapters.items():
            if name.startswith("lora_unet_") and name[10:] in {k.replace(".", "_") for k in FUSED}:
                fused = next(k for k in FUSED if k.replace(".", "_") == name[10:])
                leaves = [(ref.get_submodule(p), rows) for p, rows in FUSED[fused]]
                base = torch.cat([leaf.weight[rows] for leaf, rows in leaves])
                delta = dense_delta(adapter, tuple(base.shape), base)
                bias = adapter.delta_bias()
                start = 0
                for leaf, rows in leaves:
                    n = leaf.weight[rows].shape[0]
                    leaf.weight[rows] += delta[start : start + n]
                    if bias is not None:
                        leaf.bias[rows] += bias[start : start + n]
                    start += n
            else:
                path = next(p for p, b in RENAME.items() if f"lora_unet_{b}".replace(".", "_") == name)
                leaf = ref.get_submodule(path)
                leaf.weight += dense_delta(adapter, tuple(leaf.weight.shape), leaf.weight.detach().clone())
                bias = adapter.delta_bias()
                if bias is not None:
                    leaf.bias += bias
    return ref


ALGOS = {
    "lora": ((), "networks.lora"),
    "loha": (("algo=loha",), "lycoris.kohya"),
    "lokr": (("algo=lokr", "factor=4"), "lycoris.kohya"),
    "dora": (("algo=lora", "dora_wd=True"), "lycoris.kohya"),
    "dora_per_input": (("algo=lora", "dora_wd=True", "wd_on_output=False"), "lycoris.kohya"),
    "lokr_dora": (("algo=lokr", "factor=4", "dora_wd=True"), "lycoris.kohya"),
    "loha_dora": (("algo=loha", "dora_wd=True"), "lycoris.kohya"),
    "full": (("algo=full",), "lycoris.kohya"),
    "ia3": (("algo=ia3",), "lycoris.kohya"),
    "glora": (("algo=glora",), "lycoris.kohya"),
    "diag-oft": (("algo=diag-oft",), "lycoris.kohya"),
    "boft": (("algo=boft",), "lycoris.kohya"),
    "lora_fa": ((), "networks.lora_fa"),
}


def build(case: str, model, preset: str = "full"):
    args, module = ALGOS[case]
    dim = 16 if case == "boft" else 4  # BOFT: a power-of-two count of even blocks of size <= dim (96 = 8 x 12)
    cfg = make_config(*args, f"preset={preset}", module=module, dim=dim, alpha=2.0)
    return inject(cfg, [flux_root(model)], CLASSES)


# ---------------------------------------------------------------------------------------------- targets
def test_fused_targets_are_named_by_the_file_layout_and_their_leaves_never_alone():
    model = tiny_flux()
    targets = find_targets([flux_root(model)], builtin_preset("full", CLASSES), conv=False, train_norm=False)
    names = [t.name for t in targets]
    assert len(names) == len(set(names))
    expected = {"lora_unet_" + k.replace(".", "_") for k in (*FUSED, *RENAME.values())}
    assert set(names) == expected  # every Linear of the blocks + the final layer, no leaf of a fused module alone
    by_name = {t.name: t for t in targets}
    assert tuple(by_name["lora_unet_double_blocks_0_img_attn_qkv"].module.weight.shape) == (3 * INNER, INNER)
    assert tuple(by_name["lora_unet_single_blocks_0_linear1"].module.weight.shape) == (3 * INNER + MLP, INNER)
    final = by_name["lora_unet_final_layer_adaLN_modulation_1"].module.weight
    torch.testing.assert_close(
        final, torch.cat([model.norm_out.linear.weight[INNER:], model.norm_out.linear.weight[:INNER]])
    )
    # the kohya preset (blocks only) leaves the final layer out; the SD classes find nothing in a FLUX model
    kohya = {t.name for t in find_targets([flux_root(model)], builtin_preset("kohya", CLASSES), conv=False,
                                          train_norm=False)}  # fmt: skip
    assert kohya == expected - {"lora_unet_final_layer_adaLN_modulation_1"}
    assert find_targets([flux_root(model)], builtin_preset("kohya"), conv=False, train_norm=False) == []
    only = find_targets([flux_root(model)], builtin_preset("attn-only", CLASSES), conv=False, train_norm=False)
    assert {t.name for t in only} == {
        "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_attn_qkv",
        "lora_unet_double_blocks_0_img_attn_proj", "lora_unet_double_blocks_0_txt_attn_proj",
        "lora_unet_single_blocks_0_linear1",  # one leaf (to_q) is in the attention: the fused module is one target
    }  # fmt: skip


def test_saved_file_holds_fused_names_and_shapes(tmp_path):
    model = tiny_flux()
    network = build("lora", model)
    randomize(network)
    network.save(tmp_path / "f.safetensors")
    from library.files.weights import load_state_dict

    sd, _ = load_state_dict(tmp_path / "f.safetensors")
    assert tuple(sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].shape) == (3 * INNER, 4)
    assert tuple(sd["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape) == (4, INNER)
    assert tuple(sd["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape) == (3 * INNER + MLP, 4)
    assert tuple(sd["lora_unet_final_layer_adaLN_modulation_1.lora_up.weight"].shape) == (2 * INNER, 4)
    assert float(sd["lora_unet_single_blocks_0_linear2.alpha"]) == 2.0
    assert not any("to_q" in k or "norm_out" in k for k in sd)
    # the leaves are wrapped in the model, the fused adapter is one set of tensors
    assert isinstance(model.transformer_blocks[0].attn.to_q, FusedLeaf)
    assert model.transformer_blocks[0].attn.to_q.adapter is model.transformer_blocks[0].attn.to_v.adapter


# ------------------------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("case", list(ALGOS))
def test_fused_forward_merge_and_reload_equal_the_dense_delta_on_the_stacked_weight(case, tmp_path):
    model = tiny_flux()
    plain = run(model)
    network = build(case, model)
    randomize(network)
    network.set_training(False)
    adapted = run(model)
    assert (adapted - plain).abs().max() > 1e-3  # the adapters do something
    # merged forward == unmerged forward; unmerge restores every leaf exactly
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "adapter" not in n}
    network.merge()
    torch.testing.assert_close(run(model), adapted, rtol=1e-4, atol=2e-5)
    network.unmerge()
    after = {n: p for n, p in model.named_parameters() if "adapter" not in n}
    assert all(torch.equal(before[n], after[n]) for n in before)
    # save -> load into a fresh model gives the same forward
    network.save(tmp_path / "f.safetensors")
    fresh = tiny_flux()
    loaded = network_from_file(tmp_path / "f.safetensors", [flux_root(fresh)])
    loaded.set_training(False)
    torch.testing.assert_close(run(fresh), adapted, rtol=1e-4, atol=2e-5)
    # the oracle: dense ΔW on the stacked weight, split by rows into an un-adapted copy
    ref = oracle(model, network)
    torch.testing.assert_close(run(ref), adapted, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(run(model), plain)  # eject() gave the original model back


def test_lora_on_a_fused_module_is_the_lora_formula_at_any_multiplier():
    """LoRA re-typed (ΔW = α/r · up @ down over the stacked rows), at multiplier 0.5, with the fused module's own
    forward (y = W_stacked x + b + m ΔW x)."""
    model = tiny_flux()
    network = build("lora", model)
    randomize(network)
    network.set_multiplier(0.5)
    network.set_training(False)
    layer = network.layer("lora_unet_single_blocks_0_linear1")
    x = torch.randn(3, INNER)
    up, down = layer.adapter.params["lora_up"], layer.adapter.params["lora_down"]
    base = torch.cat([model.get_submodule(p).base_layer.weight for p, _ in FUSED["single_blocks.0.linear1"]])
    bias = torch.cat([model.get_submodule(p).base_layer.bias for p, _ in FUSED["single_blocks.0.linear1"]])
    expected = x @ (base + 0.5 * (2.0 / 4) * up @ down).T + bias
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
        mlp = model.single_transformer_blocks[0].proj_mlp
        torch.testing.assert_close(mlp(x), expected[:, 3 * INNER :], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ tools
def test_extract_diffs_the_stacked_weights():
    from networks.extract import ExtractOptions, extract

    org, tuned = tiny_flux(0).requires_grad_(False), tiny_flux(0).requires_grad_(False)  # frozen, as loaded
    with torch.no_grad():
        for p, _ in FUSED["double_blocks.0.img_attn.qkv"]:
            tuned.get_submodule(p).weight.add_(torch.randn(INNER, INNER) * 0.1)
    family = SimpleNamespace(adapter_roots=lambda model: [flux_root(model)], target_classes=CLASSES)
    state, _ = extract(family, org, tuned, ExtractOptions(dim=INNER, clamp_quantile=None, min_diff=0.0))
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    delta = state[f"{name}.lora_up.weight"] @ state[f"{name}.lora_down.weight"]
    leaves = FUSED["double_blocks.0.img_attn.qkv"]
    stacked = [tuned.get_submodule(p).weight - org.get_submodule(p).weight for p, _ in leaves]
    torch.testing.assert_close(delta, torch.cat(stacked), rtol=1e-4, atol=1e-5)
    assert float(state["lora_unet_single_blocks_0_linear1.lora_up.weight"].abs().max()) < 1e-5  # unchanged weights


def test_fp8_stored_leaves(tmp_path):
    """DoRA (ΔW and the norm over the stacked weight) on float8-stored leaves equals the same adapter on a float32
    model holding the float8-rounded weights; merge and unmerge work on float8 storage."""
    from library.device.fp8 import store_in_fp8

    model = tiny_flux().requires_grad_(False)
    rounded = tiny_flux()
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.to(torch.float8_e4m3fn).float())
    assert store_in_fp8(model, torch.float32, skip=()) > 0
    to_q = model.transformer_blocks[0].attn.to_q
    assert to_q.weight.dtype == torch.float8_e4m3fn
    network = build("dora", model)
    randomize(network)
    network.set_training(False)
    adapted = run(model)
    network.save(tmp_path / "d.safetensors")
    network_from_file(tmp_path / "d.safetensors", [flux_root(rounded)]).set_training(False)
    torch.testing.assert_close(adapted, run(rounded), rtol=1e-4, atol=2e-5)
    stored = to_q.weight.detach().clone()
    network.merge()
    assert to_q.weight.dtype == torch.float8_e4m3fn
    assert not torch.equal(to_q.weight.float(), stored.float())
    assert (run(model) - adapted).abs().max() < 0.05  # the merged weights are rounded to float8 again
    network.unmerge()
    assert torch.equal(to_q.weight.float(), stored.float())
    torch.testing.assert_close(run(model), adapted)


def test_refusals_name_the_module():
    model = tiny_flux()
    with pytest.raises(ValueError, match="DyLoRA is not supported on a fused module"):
        inject(make_config("algo=dylora", "preset=full", module="lycoris.kohya", dim=4), [flux_root(model)], CLASSES)
    bad = Root("lora_unet", model, rename, (Fused("x.qkv", (Segment("transformer_blocks.0.attn.to_q", 0, 16),)),))
    with pytest.raises(ValueError, match="x.qkv: the segments of transformer_blocks.0.attn.to_q cover rows"):
        find_targets([bad], builtin_preset("full", CLASSES), conv=False, train_norm=False)
    bad = Root("lora_unet", model, rename, (Fused("x.qkv", (Segment("transformer_blocks.0.norm1", 0, None),)),))
    with pytest.raises(ValueError, match="x.qkv: segment 'transformer_blocks.0.norm1' is a AdaLayerNormZero"):
        find_targets([bad], builtin_preset("full", CLASSES), conv=False, train_norm=False)


@pytest.mark.parametrize("case", ["lokr", "dora"])
def test_network_weights_and_the_tools_read_fused_modules(case, tmp_path):
    """``--network_weights`` into a network built from flags, and the tools' per-module ΔW (``networks.deltas``,
    resize / SVD merge) with the base model's index: the same ΔW as the layer's over the stacked weight."""
    from networks.deltas import file_deltas, load_adapter
    from networks.files import module_index

    model = tiny_flux()
    network = build(case, model)
    randomize(network)
    network.set_training(False)
    adapted = run(model)
    network.save(tmp_path / "f.safetensors")
    fresh = tiny_flux()
    again = build(case, fresh)
    report = again.load_file(tmp_path / "f.safetensors")
    assert not report.missing and not report.unexpected
    again.set_training(False)
    torch.testing.assert_close(run(fresh), adapted, rtol=1e-4, atol=2e-5)
    baked = tiny_flux()  # --base_weights / merge tools: baked into the leaves, no wrapper left
    merge_files_into_base([str(tmp_path / "f.safetensors")], [1.0], [flux_root(baked)])
    assert not any(isinstance(m, FusedLeaf) for m in baked.modules())
    torch.testing.assert_close(run(baked), adapted, rtol=1e-4, atol=2e-5)
    index = module_index([flux_root(tiny_flux())])
    assert (
        "lora_unet_single_blocks_0_linear1" in index and "lora_unet_single_transformer_blocks_0_proj_mlp" not in index
    )
    deltas, _ = file_deltas(load_adapter(tmp_path / "f.safetensors"), index)
    for name in ("lora_unet_single_blocks_0_linear1", "lora_unet_final_layer_adaLN_modulation_1"):
        layer = network.layer(name)
        torch.testing.assert_close(deltas[name].dense, layer.delta(1.0).reshape(layer.weight_shape[0], -1))


def test_one_delta_weight_per_forward_of_a_fused_module():
    model = tiny_flux()
    network = build("lokr", model)
    randomize(network)
    network.set_training(False)
    calls = {}
    for name, adapter in network.adapters.items():

        def counted(*args, _inner=adapter.delta_weight, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _inner(*args, **kwargs)

        adapter.delta_weight = counted
    run(model)
    assert calls["lora_unet_single_blocks_0_linear1"] == 1 and calls["lora_unet_double_blocks_0_img_attn_qkv"] == 1
    assert set(calls.values()) == {1}
    assert all(getattr(layer, "_cache", None) is None for layer in network.layers())  # every leaf took it


def test_lora_dropouts_act_as_on_the_fused_linear():
    """rank_dropout (one (B, r) mask for every leaf, rescaled by 1/(1-p)) re-typed from sd-scripts' LoRAModule
    forward on the fused Linear, with the same draw: the leaves share one mask."""
    model = tiny_flux()
    cfg = make_config("preset=full", "rank_dropout=0.5", dim=4, alpha=2.0)
    network = inject(cfg, [flux_root(model)], CLASSES)
    randomize(network)
    network.set_training(True)
    layer = network.layer("lora_unet_single_blocks_0_linear1")
    x = torch.randn(2, 5, INNER)
    torch.manual_seed(7)
    with torch.no_grad():
        got = layer(x)
    torch.manual_seed(7)
    mask = (torch.rand((2, 4)) > 0.5).float()[:, None, :]
    up, down = layer.adapter.params["lora_up"], layer.adapter.params["lora_down"]
    leaves = [model.get_submodule(p).base_layer for p, _ in FUSED["single_blocks.0.linear1"]]
    base = torch.cat([leaf.weight for leaf in leaves])
    bias = torch.cat([leaf.bias for leaf in leaves])
    expected = x @ base.T + bias + ((x @ down.T) * mask / 0.5) @ up.T * (2.0 / 4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_sd_presets_resolve_to_the_classes_they_always_named():
    """The built-in presets written in class groups give SD1/SD2/SDXL the literal tuples they had before."""
    from library.families.sd import SD1, SDXL

    te = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2", "CLIPMLP")
    conv = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
    full = ("conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2")
    assert SD1.target_classes == SDXL.target_classes
    classes = SD1.target_classes
    got = {name: builtin_preset(name, classes) for name in ("kohya", "full", "attn-only", "unet-convblock-only")}
    assert (got["kohya"].unet_classes, got["kohya"].te_classes) == (("Transformer2DModel",), te)
    assert (got["full"].unet_classes, got["full"].unet_names) == (("Transformer2DModel", *conv), full)
    assert got["full"].enable_conv and got["full"].te_classes == te
    assert (got["attn-only"].unet_classes, got["attn-only"].te_classes) == (("Attention",), te[:3])
    assert got["unet-convblock-only"].unet_classes == conv and got["unet-convblock-only"].te_classes == ()
    assert got["unet-convblock-only"].unet_name_kind == "conv"


def test_text_encoder_classes_per_prefix_select_t5():
    from transformers import T5Config, T5EncoderModel

    t5 = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                 feed_forward_proj="gated-gelu"))  # fmt: skip
    classes = TargetClasses(transformer=CLASSES.transformer, text_encoder={"lora_te3": ("T5Attention", "T5LayerFF")})
    targets = find_targets([Root("lora_te3", t5, lambda p: p)], builtin_preset("kohya", classes), conv=False,
                           train_norm=False)  # fmt: skip
    names = {t.name for t in targets}
    per_layer = {"SelfAttention_q", "SelfAttention_k", "SelfAttention_v", "SelfAttention_o", "DenseReluDense_wi_0",
                 "DenseReluDense_wi_1", "DenseReluDense_wo"}  # fmt: skip
    assert names == {f"lora_te3_encoder_block_{i}_layer_{0 if n.startswith('Self') else 1}_{n}" for i in range(2)
                     for n in per_layer}  # fmt: skip
    # per prefix: each text encoder gets its own classes only (here the same model under two prefixes)
    classes = TargetClasses(transformer=(), text_encoder={"lora_te1": ("T5LayerFF",), "lora_te3": ("T5Attention",)})
    roots = [Root("lora_te1", t5, lambda p: p), Root("lora_te3", t5, lambda p: p)]
    split = [t.name for t in find_targets(roots, builtin_preset("kohya", classes), conv=False, train_norm=False)]
    assert split and all(("DenseReluDense" in n) == n.startswith("lora_te1_") for n in split)
    assert len(split) == len(names)


def test_forgotten_target_classes_are_reported(caplog):
    """Without the family's classes the SD presets select nothing in a DiT: said, naming the root and classes."""
    model = tiny_flux()
    with caplog.at_level("WARNING", logger="networks.inject"):
        network = inject(make_config(), [flux_root(model)])
    assert len(network) == 0
    assert "lora_unet (FluxTransformer2DModel): no module is selected by the preset's classes Transformer2DModel" in (
        caplog.text
    )
    assert len(inject(make_config(), [flux_root(model)], CLASSES)) > 0


@pytest.mark.parametrize("case", ["lora", "loha"])
def test_gradients_with_dropouts_and_gradient_checkpointing(case):
    """A training step through the leaves: the adapters get gradients, and diffusers' gradient checkpointing (the
    recompute replays the RNG; the leaves share one draw per call) gives the same gradients as without it."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_flux().requires_grad_(False)
        args, module = ALGOS[case]
        cfg = make_config(*args, "preset=full", "rank_dropout=0.3", "module_dropout=0.2", module=module, dim=4)
        network = inject(cfg, [flux_root(model)], CLASSES)
        randomize(network)
        network.set_training(True)
        model.train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(5)
        out = model(hidden_states=torch.randn(2, 16, 64, generator=g), encoder_hidden_states=torch.randn(2, 5, 32,
                    generator=g), pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.3, 0.7]),
                    img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3), guidance=torch.tensor([3.5, 3.5]),
                    return_dict=False)[0]  # fmt: skip
        out.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in network.named_parameters() if p.grad is not None})
        assert all(getattr(layer, "_cache", None) is None for layer in network.layers())
    fused = [n for n in grads[0] if "img_attn_qkv" in n or "linear1" in n]
    assert fused and all(grads[0][n].abs().max() > 0 for n in fused)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)
