"""``--network_module networks.lora_flux`` (networks/lora_flux.py) and LyCORIS on the FLUX family.

Oracles: sd-scripts' ``create_network`` / ``LoRANetwork.create_modules`` selection and rank rules and its
``assemble_params`` lr rule, re-typed below from networks/lora_flux.py (v0.10.1) over the BFL module names of the
model (``library.families.flux.keys.module_table``) and the text encoders' own module classes; sd-scripts' split-qkv
forward re-typed; ComfyUI's key rule (``lora_unet_`` + BFL key minus ``.weight``, dots as underscores) with a merge
by it into the BFL weights, converted by diffusers' own single-file converter; diffusers' kohya FLUX LoRA converter
at the real width (3072) and ``FluxPipeline.load_lora_weights`` at the tiny width.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from _flux_helpers import flux_inputs
from _networks_helpers import lycoris_delta, make_config, single_thread  # noqa: F401

from library.families import get_family
from library.families.base import Parts
from library.families.flux import keys as K
from library.families.flux.tiny import TRANSFORMER, build_tiny_flux, tiny_clip_l, tiny_t5
from library.files.weights import load_state_dict
from networks import inject, network_from_file
from networks.fused import block_diagonal_mask
from networks.inject import prepare_network

FAMILY = get_family("flux-dev")
DIM, ALPHA = 4, 2.0


def tiny_parts(num_double: int = 4, num_single: int = 6, seed: int = 0) -> Parts:
    """The tiny FLUX.1-dev parts with more blocks (for block-index selections) and no zero weights."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    config = {**TRANSFORMER, "num_layers": num_double, "num_single_layers": num_single}
    model = FluxTransformer2DModel(**config, pooled_projection_dim=32, guidance_embeds=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    encoders = [tiny_clip_l(), tiny_t5()]
    for module in (model, *encoders):
        module.eval().requires_grad_(False)
    return Parts(model, None, encoders, [None, None], {}, family="flux-dev")


inputs = flux_inputs  # tests/_flux_helpers.py


def run(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(), return_dict=False)[0]


def randomize(network, seed: int = 3) -> None:
    """Non-zero adapters; a split module's lora_up stays block-diagonal (its off-diagonal gradient is masked, so the
    values are written through the same mask)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, adapter in network.adapters.items():
            for key, p in adapter.params.items():
                noise = torch.randn(p.shape, generator=g) * 0.1
                p.add_(noise * (p != 0) if key == "lora_up" and is_split(network, name) else noise)


def is_split(network, name: str) -> bool:
    cfg = network.config
    return bool(cfg is not None and cfg.module_args.split_qkv and
                re.search(r"double_blocks_\d+_.*qkv|single_blocks_\d+_linear1", name))  # fmt: skip


def flux_config(*args, flags=()):
    return make_config(*args, module="networks.lora_flux", dim=DIM, alpha=ALPHA, flags=flags)


# --------------------------------------------------------------------------- sd-scripts' rules, re-typed
def sd_scripts_blocks(selection: str | None, total: int):
    if selection is None:
        return None
    if selection == "all":
        return [True] * total
    if selection in ("none", ""):
        return [False] * total
    selected = [False] * total
    for r in selection.split(","):
        if "-" in r:
            start, end = (int(x.strip()) for x in r.split("-"))
            for i in range(start, end + 1):
                selected[i] = True
        else:
            selected[int(r)] = True
    return selected


def sd_scripts_network(kwargs: dict, parts: Parts, num_double: int, num_single: int) -> dict[str, tuple[int, float]]:
    """{kohya name: (dim, alpha)} that sd-scripts' LoRANetwork (networks/lora_flux.py) builds for these
    network_args, from the BFL module names of the model and the text encoders' module classes."""
    type_keys = ["img_attn_dim", "txt_attn_dim", "img_mlp_dim", "txt_mlp_dim", "img_mod_dim", "txt_mod_dim",
                 "single_dim", "single_mod_dim"]  # fmt: skip
    type_dims = [int(kwargs[k]) if k in kwargs else None for k in type_keys]
    if all(d is None for d in type_dims):
        type_dims = None
    in_dims = None
    if "in_dims" in kwargs:
        in_dims = [int(d) for d in kwargs["in_dims"].strip("[]").split(",")]
    double = sd_scripts_blocks(kwargs.get("train_double_block_indices"), num_double)
    single = sd_scripts_blocks(kwargs.get("train_single_block_indices"), num_single)
    reg_dims = None
    if "network_reg_dims" in kwargs:
        reg_dims = {k: int(v) for k, v in (p.split("=") for p in kwargs["network_reg_dims"].split(","))}
    train_blocks = kwargs.get("train_blocks", "all")
    out: dict[str, tuple[int, float]] = {}

    def create(is_flux: bool, names: list[str], default_dim=None):
        for lora_name in names:
            dim = alpha = None
            if reg_dims is not None:
                for reg, d in reg_dims.items():
                    if re.search(reg, lora_name):
                        dim, alpha = d, ALPHA
                        break
            if dim is None:
                dim = default_dim if default_dim is not None else DIM
                alpha = ALPHA
                if is_flux and type_dims is not None:
                    identifier = [("img_attn",), ("txt_attn",), ("img_mlp",), ("txt_mlp",), ("img_mod",),
                                  ("txt_mod",), ("single_blocks", "linear"), ("modulation",)]  # fmt: skip
                    for i, d in enumerate(type_dims):
                        if d is not None and all(id in lora_name for id in identifier[i]):
                            dim = d
                            break
                if (is_flux and dim and (double is not None or single is not None)
                        and ("double" in lora_name or "single" in lora_name)):  # fmt: skip
                    block_index = int(lora_name.split("_")[4])
                    if "double" in lora_name and double is not None and not double[block_index]:
                        dim = 0
                    elif "single" in lora_name and single is not None and not single[block_index]:
                        dim = 0
            if dim:
                assert lora_name not in out
                out[lora_name] = (dim, alpha)

    # text encoders: CLIPAttention / CLIPSdpaAttention / CLIPMLP (lora_te1); T5 only with train_t5xxl (lora_te3)
    te_classes = ["CLIPAttention", "CLIPSdpaAttention", "CLIPMLP", "T5Attention", "T5DenseGatedActDense"]
    for index, encoder in enumerate(parts.text_encoders):
        if index > 0 and kwargs.get("train_t5xxl") != "True":
            break
        prefix = "lora_te1" if index == 0 else "lora_te3"
        level = "text_model." if index == 0 and not hasattr(encoder, "text_model") else ""
        names = []
        for name, module in encoder.named_modules():
            if type(module).__name__ in te_classes:
                for child, leaf in module.named_modules():
                    if type(leaf).__name__ == "Linear":
                        names.append(f"{prefix}.{level}{name}.{child}".replace(".", "_"))
        create(False, names)
    # the transformer: the Linear modules of the BFL model (module_table), by block class
    layout = K.Layout(K.FLUX, num_double, num_single, True)
    linears = [e.bfl for e in layout.table if e.params[0][0] == "weight"]
    blocks = {"all": ("double_blocks.", "single_blocks."), "single": ("single_blocks.",),
              "double": ("double_blocks.",)}[train_blocks]  # fmt: skip
    create(True, [f"lora_unet.{b}".replace(".", "_") for b in linears if b.startswith(blocks)])
    if in_dims:
        for flt, in_dim in zip(["_img_in", "_time_in", "_vector_in", "_guidance_in", "_txt_in"], in_dims):
            create(True, [n for b in linears if flt in (n := f"lora_unet.{b}".replace(".", "_"))], default_dim=in_dim)
    return out


def ours(network) -> dict[str, tuple[int, float]]:
    """{name: (rank, alpha)} per part: a split module's rank k·r and alpha k·α back to (r, α)."""
    out = {}
    for name in network.names:
        adapter = network.layer(name).adapter
        k = len(network.layer(name).base_layer.segments) if is_split(network, name) else 1
        out[name] = (adapter.rank // k, float(adapter.alpha) / k)
    return out


CASES = [
    (),
    ("train_blocks=single",),
    ("train_blocks=double", "train_t5xxl=True"),
    ("img_attn_dim=8", "txt_mlp_dim=0", "single_dim=6", "single_mod_dim=0", "img_mod_dim=2", "txt_mod_dim=3"),
    ("in_dims=[2,0,3,4,5]", "txt_attn_dim=5"),
    ("train_double_block_indices=0,2-3", "train_single_block_indices=none"),
    ("train_double_block_indices=1", "train_single_block_indices=0-2,5", "single_dim=3"),
    (
        "network_reg_dims=double_blocks_1_.*=16,te1.*mlp=2,_img_in=7",
        "train_double_block_indices=0",
        "in_dims=[0,2,0,0,0]",
    ),
    ("split_qkv=True", "img_attn_dim=3", "train_single_block_indices=1-4"),
]


@pytest.mark.parametrize("args", CASES, ids=lambda a: " ".join(a) or "default")
def test_modules_and_ranks_equal_sd_scripts_create_modules(args):
    parts = tiny_parts()
    kwargs = dict(a.split("=", 1) for a in args)
    expected = sd_scripts_network(kwargs, parts, 4, 6)
    network = inject(flux_config(*args), FAMILY.adapter_roots(parts), FAMILY.target_classes)
    got = ours(network)
    assert sorted(got) == sorted(expected)
    assert got == expected


def test_every_argument_changes_what_is_built():
    parts = tiny_parts()
    roots = FAMILY.adapter_roots(parts)
    default = inject(flux_config(), roots, FAMILY.target_classes)
    base = ours(default)
    default.eject()
    assert not any(n.startswith("lora_te3") for n in base)
    for args in CASES[1:]:
        network = inject(flux_config(*args), roots, FAMILY.target_classes)
        assert ours(network) != base, args
        network.eject()


def test_verbose_lists_every_module_and_the_skipped_ones(caplog):
    parts = tiny_parts(2, 2)
    with caplog.at_level("INFO"):
        inject(flux_config("verbose=True", "txt_mlp_dim=0"), FAMILY.adapter_roots(parts), FAMILY.target_classes)
    assert "lora_unet_double_blocks_0_img_attn_qkv" in caplog.text
    assert "modules are skipped" in caplog.text and "lora_unet_double_blocks_1_txt_mlp_2" in caplog.text


def test_dropouts_reach_every_module_and_act_in_training_only(caplog):
    parts = tiny_parts(1, 1)
    cfg = flux_config("rank_dropout=0.5", "module_dropout=0.25", "conv_dim=8", flags=("--network_dropout", "0.1"))
    assert "no convolution" in caplog.text  # conv_dim: accepted, FLUX has nothing it applies to (sd-scripts too)
    network = inject(cfg, FAMILY.adapter_roots(parts), FAMILY.target_classes)
    layers = [network.layer(n) for n in network.names]
    assert all((lay.rank_dropout, lay.module_dropout, lay.dropout) == (0.5, 0.25, 0.1) for lay in layers)
    randomize(network)
    network.set_training(False)
    a, b = run(parts.denoiser), run(parts.denoiser)
    torch.testing.assert_close(a, b)
    network.set_training(True)
    torch.manual_seed(0)
    assert (run(parts.denoiser) - a).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------- lr groups
def test_reg_lrs_and_loraplus_give_sd_scripts_learning_rates():
    parts = tiny_parts(2, 2)
    args = ("network_reg_lrs=img_attn=2e-3,te1.*mlp=7e-5,single_blocks_1=0", "loraplus_unet_lr_ratio=4",
            "loraplus_text_encoder_lr_ratio=2", "train_t5xxl=True")  # fmt: skip
    network = inject(flux_config(*args), FAMILY.adapter_roots(parts), FAMILY.target_classes)
    groups = network.param_groups(unet_lr=1e-3, text_encoder_lr=[1e-4, 5e-5], learning_rate=3e-4)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    regs = [("img_attn", 2e-3), ("te1.*mlp", 7e-5), ("single_blocks_1", 0.0)]
    checked = 0
    for name, adapter in network.adapters.items():  # sd-scripts' assemble_params, re-typed
        part_lr = 1e-3 if name.startswith("lora_unet") else (1e-4 if name.startswith("lora_te1") else 5e-5)
        ratio = 4 if name.startswith("lora_unet") else 2
        lr = next((v for r, v in regs if re.search(r, name)), part_lr)
        for key, p in adapter.params.items():
            want = lr * ratio if "lora_up" in key else lr
            if want == 0:  # sd-scripts drops a group whose lr is 0
                assert id(p) not in lr_of and not p.requires_grad
            else:
                assert lr_of[id(p)] == pytest.approx(want), (name, key)
            checked += 1
    assert checked == sum(len(a.params) for a in network.adapters.values())
    names = {g["name"] for g in groups}
    assert {"unet reg_lr_0", "unet reg_lr_0 plus", "textencoder1 reg_lr_1", "unet", "unet plus"} <= names


# --------------------------------------------------------------------------------------------- split_qkv
def test_split_qkv_is_sd_scripts_split_forward_saved_fused_at_the_trained_strength(tmp_path):
    parts = tiny_parts(1, 1)
    network = inject(flux_config("split_qkv=True"), FAMILY.adapter_roots(parts), FAMILY.target_classes)
    randomize(network)
    network.set_training(False)
    network.save(tmp_path / "split.safetensors")
    sd, _ = load_state_dict(tmp_path / "split.safetensors")
    width, mlp = 32, 128
    for name, rows in (("lora_unet_double_blocks_0_img_attn_qkv", [width] * 3),
                       ("lora_unet_single_blocks_0_linear1", [width] * 3 + [mlp])):  # fmt: skip
        k = len(rows)
        down, up, alpha = sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"], float(sd[f"{name}.alpha"])
        assert tuple(down.shape) == (k * DIM, width) and tuple(up.shape) == (sum(rows), k * DIM)
        assert alpha == k * ALPHA  # sd-scripts writes ALPHA: k× weaker in every reader
        # sd-scripts' split forward: org + cat_i(up_i(down_i(x))) · α/r, with the parts cut from the file as its
        # load_state_dict cuts them (down chunked, up's diagonal blocks)
        x = torch.randn(3, width)
        downs = down.chunk(k)
        ups, start = [], 0
        for j, n in enumerate(rows):
            block = up[start : start + n]
            ups.append(block[:, j * DIM : (j + 1) * DIM])
            assert block[:, : j * DIM].abs().sum() == 0 and block[:, (j + 1) * DIM :].abs().sum() == 0
            start += n
        layer = network.layer(name)
        expected = layer.base_layer(x) + torch.cat([x @ d.T @ u.T for d, u in zip(downs, ups)], -1) * ALPHA / DIM
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_split_qkv_training_keeps_the_parts_separate():
    parts = tiny_parts(1, 1)
    network = inject(flux_config("split_qkv=True"), FAMILY.adapter_roots(parts), FAMILY.target_classes)
    network.set_training(True)
    params = [p for a in network.adapters.values() for p in a.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        out = parts.denoiser(**inputs(), return_dict=False)[0]
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    up = network.adapters["lora_unet_single_blocks_0_linear1"].params["lora_up"].detach()
    assert up[:32, :DIM].abs().sum() > 0  # trained
    assert up[:32, DIM:].abs().sum() == 0 and up[96:, : 3 * DIM].abs().sum() == 0  # off-diagonal blocks stay 0


def test_a_plain_file_loaded_into_a_split_network_is_kept_and_named(tmp_path, caplog):
    """--network_weights of a plain LoRA with rank 3r on qkv (4r on linear1) into a split_qkv network: the file's ΔW
    exactly, with a warning naming the modules that are not block-diagonal."""
    parts = tiny_parts(1, 1)
    cfg = flux_config("network_reg_dims=qkv=12,linear1=16", flags=("--network_train_unet_only",))
    plain = inject(cfg, FAMILY.adapter_roots(parts), FAMILY.target_classes)
    randomize(plain)
    plain.set_training(False)
    adapted = run(parts.denoiser)
    plain.save(tmp_path / "plain.safetensors")
    plain.eject()
    flags = ("--network_train_unet_only", "--network_weights", str(tmp_path / "plain.safetensors"))
    network = prepare_network(flux_config("split_qkv=True", flags=flags), FAMILY.adapter_roots(parts),
                              FAMILY.target_classes)  # fmt: skip
    network.set_training(False)
    assert "3 split_qkv module(s) hold a lora_up that is not block-diagonal" in caplog.text
    torch.testing.assert_close(run(parts.denoiser), adapted, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the files: ComfyUI's rule
def lora_delta(state: dict, module: str) -> torch.Tensor:
    down, up = state[f"{module}.lora_down.weight"], state[f"{module}.lora_up.weight"]
    return float(state[f"{module}.alpha"]) / down.shape[0] * up @ down


def comfy_merge(parts: Parts, state: dict, delta=lora_delta) -> torch.nn.Module:
    """ComfyUI's rule: ``lora_unet_`` + BFL key minus ``.weight`` (dots as underscores) -> that BFL weight, merged
    with ``delta`` ((α/r)·up@down); then BFL -> diffusers by ``keys.bfl_to_diffusers`` (checked against diffusers' and
    sd-scripts' converters in test_flux_family.py; diffusers' single-file converter hard-codes the width 3072)."""
    bfl = K.diffusers_to_bfl(parts.denoiser.state_dict())
    by_name = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): k for k in bfl if k.endswith(".weight")}
    modules = {k.split(".")[0] for k in state if k.startswith("lora_unet_")}
    for module in modules:
        assert module in by_name, module  # every saved module maps onto the BFL state dict
        weight = bfl[by_name[module]]
        change = delta(state, module)
        assert tuple(change.shape) == tuple(weight.shape)  # shapes fit
        bfl[by_name[module]] = weight + change
    converted = K.bfl_to_diffusers(bfl)
    fresh = copy.deepcopy(parts.denoiser)
    fresh.load_state_dict(converted)
    return fresh


@pytest.mark.parametrize("args", [("in_dims=[2,2,2,2,2]",), ("split_qkv=True",)], ids=["in_dims", "split_qkv"])
def test_comfyui_rule_merge_equals_our_adapter_and_network_weights_reload(args, tmp_path):
    parts = tiny_parts(2, 2)
    plain = run(parts.denoiser)
    network = inject(flux_config(*args, flags=("--network_train_unet_only",)), FAMILY.adapter_roots(parts),
                     FAMILY.target_classes)  # fmt: skip
    randomize(network)
    network.set_training(False)
    adapted = run(parts.denoiser)
    assert (adapted - plain).abs().max() > 1e-2
    path = tmp_path / "lora.safetensors"
    network.save(path, metadata={"ss_base_model_version": FAMILY.base_model_version()})
    state, _ = load_state_dict(path)
    network.eject()
    merged = comfy_merge(parts, state)
    torch.testing.assert_close(run(merged), adapted, rtol=1e-4, atol=1e-5)
    # --network_weights into a network built from the same flags, and --dim_from_weights (the file's ranks)
    for flags in (("--network_weights", str(path)), ("--network_weights", str(path), "--dim_from_weights")):
        cfg = flux_config(*args, flags=("--network_train_unet_only", *flags))
        loaded = prepare_network(cfg, FAMILY.adapter_roots(parts), FAMILY.target_classes)
        loaded.set_training(False)
        torch.testing.assert_close(run(parts.denoiser), adapted, rtol=1e-4, atol=1e-5)
        loaded.eject()


# ------------------------------------------------------------------------ the files: diffusers' converter
def test_diffusers_kohya_converter_reads_our_file_at_the_real_width():
    """diffusers' kohya FLUX converter hard-codes width 3072 for linear1: a real-width model (1 double, 1 single
    block) on the meta device, its adapters made real on the CPU; every leaf's ΔW·x from diffusers' PEFT tensors
    equals our file's (α/r)·up@down rows."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    with torch.device("meta"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=64,
                                       pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(16, 56, 56))  # fmt: skip
    roots = [r for r in FAMILY.adapter_roots(Parts(model, None, [None, None], [], {}, "flux-dev")) if
             r.prefix == "lora_unet"]  # fmt: skip
    for args in ((), ("split_qkv=True",)):
        network = inject(flux_config(*args, "in_dims=[2,2,2,2,2]"), roots, FAMILY.target_classes)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, adapter in network.adapters.items():
                k = len(network.layer(name).base_layer.segments) if is_split(network, name) else 1
                adapter.to_empty(device="cpu")
                adapter.alpha.fill_(ALPHA * k)  # what inject wrote (lost on the meta device)
                for key, p in adapter.params.items():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                    if key == "lora_up" and k > 1:
                        p.mul_(block_diagonal_mask(_rows(network, name), DIM))
        state = network.state_dict_for_file()
        converted = _convert_kohya_flux_lora_to_diffusers({k: v.clone() for k, v in state.items()})
        converted = {k.removeprefix("transformer."): v for k, v in converted.items()}
        x = torch.randn(2, 5 * 3072, generator=g)
        for name in network.names:
            down, up = state[f"{name}.lora_down.weight"], state[f"{name}.lora_up.weight"]
            scale = float(state[f"{name}.alpha"]) / down.shape[0]
            ours_out = x[:, : down.shape[1]] @ down.T @ up.T * scale
            layer = network.layer(name).base_layer
            leaves = layer.paths if hasattr(layer, "paths") else [_path_of(network, name)]
            theirs = torch.cat([x[:, : down.shape[1]] @ converted[f"{p}.lora_A.weight"].T @
                                converted[f"{p}.lora_B.weight"].T for p in leaves], -1)  # fmt: skip
            torch.testing.assert_close(theirs, ours_out, rtol=1e-4, atol=1e-5)
        assert any(".proj_mlp.lora_B" in k for k in converted)
        network.eject()


def _rows(network, name: str) -> list[int]:
    base = network.layer(name).base_layer
    return [stop - start for _, start, stop, _ in base.segments]


def _path_of(network, name: str) -> str:
    return network._slots[name].target.path


def test_flux_pipeline_load_lora_weights_gives_our_output(tmp_path):
    """diffusers' FluxPipeline.load_lora_weights on our file gives the transformer and CLIP-L outputs our injected
    adapters give (tiny width: every module but linear1, whose split diffusers hard-codes at 3072, and no in_dims
    modules: diffusers 0.42's kohya converter names them without the ``transformer.`` prefix and drops them)."""
    parts = tiny_parts(2, 2)
    cfg = flux_config("single_mod_dim=4", "single_dim=0", "split_qkv=True")
    network = inject(cfg, FAMILY.adapter_roots(parts), FAMILY.target_classes)
    assert not any("linear1" in n for n in network.names) and any(n.startswith("lora_te1") for n in network.names)
    ids = torch.randint(0, 1000, (1, 77), generator=torch.Generator().manual_seed(0))
    plain_clip = parts.text_encoders[0](ids).last_hidden_state
    randomize(network)
    network.set_training(False)
    adapted = run(parts.denoiser)
    adapted_clip = parts.text_encoders[0](ids).last_hidden_state
    assert (adapted_clip - plain_clip).abs().max() > 1e-2
    network.save(tmp_path / "lora.safetensors")
    network.eject()
    pipe = FAMILY.pipeline(parts, None)
    pipe.load_lora_weights(str(tmp_path / "lora.safetensors"))
    torch.testing.assert_close(run(pipe.transformer), adapted, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(pipe.text_encoder(ids).last_hidden_state, adapted_clip, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ LyCORIS
@pytest.mark.parametrize("algo", ["locon", "loha", "lokr", "dora", "full"])
def test_lycoris_algorithms_train_save_and_reload_on_flux(algo, tmp_path):
    parts = tiny_parts(1, 1)
    args = {"locon": ("algo=locon",), "loha": ("algo=loha",), "lokr": ("algo=lokr", "factor=4"),
            "dora": ("algo=lora", "dora_wd=True"), "full": ("algo=full",)}[algo]  # fmt: skip
    cfg = make_config(*args, module="lycoris.kohya", dim=DIM, alpha=ALPHA, flags=("--network_train_unet_only",))
    network = inject(cfg, FAMILY.adapter_roots(parts), FAMILY.target_classes)
    names = set(network.names)
    # LyCORIS' full preset on FLUX: the block Linears (fused by the file's layout) and the in / final modules
    assert {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1", "lora_unet_img_in",
            "lora_unet_time_in_in_layer"} <= names  # fmt: skip
    network.set_training(True)
    opt = torch.optim.SGD([p for a in network.adapters.values() for p in a.parameters() if p.requires_grad], lr=0.5)
    before = run(parts.denoiser)
    for _ in range(2):
        parts.denoiser(**inputs(), return_dict=False)[0].square().mean().backward()
        opt.step()
        opt.zero_grad()
    network.set_training(False)
    adapted = run(parts.denoiser)
    assert (adapted - before).abs().max() > 1e-5  # it trained
    network.merge()  # merged (dense ΔW over the fused weight, split into the leaves) == unmerged
    torch.testing.assert_close(run(parts.denoiser), adapted, rtol=1e-4, atol=1e-5)
    network.unmerge()
    network.save(tmp_path / "a.safetensors")
    network.eject()
    bfl = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): v.shape
           for k, v in K.diffusers_to_bfl(parts.denoiser.state_dict()).items() if k.endswith(".weight")}  # fmt: skip
    loaded = network_from_file(tmp_path / "a.safetensors", FAMILY.adapter_roots(parts))
    for name in loaded.names:  # ComfyUI's rule: every module is a BFL weight, and its ΔW has that weight's shape
        assert tuple(loaded.layer(name).delta().shape) == tuple(bfl[name]), name
    loaded.set_training(False)
    torch.testing.assert_close(run(parts.denoiser), adapted, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ["loha", "lokr"])
def test_loha_lokr_files_merge_by_comfyui_rule_with_lycoris_formulas(algo, tmp_path):
    """LoHa / LoKr over the fused modules (qkv, linear1): the file's ΔW by lycoris-lora's functional formulas,
    merged into the BFL weights by ComfyUI's rule, gives our injected adapter's output."""
    parts = tiny_parts(1, 1)
    args = ("algo=loha",) if algo == "loha" else ("algo=lokr", "factor=4")
    cfg = make_config(*args, module="lycoris.kohya", dim=DIM, alpha=ALPHA, flags=("--network_train_unet_only",))
    network = inject(cfg, FAMILY.adapter_roots(parts), FAMILY.target_classes)
    randomize(network)
    network.set_training(False)
    adapted = run(parts.denoiser)
    network.save(tmp_path / "a.safetensors")
    network.eject()
    state, _ = load_state_dict(tmp_path / "a.safetensors")
    assert f"lora_unet_single_blocks_0_linear1.{'hada_w1_a' if algo == 'loha' else 'lokr_w1'}" in state
    torch.testing.assert_close(run(comfy_merge(parts, state, lycoris_delta)), adapted, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ flag checking
@pytest.mark.parametrize(
    "args, message",
    [
        (("train_blocks=both",), "train_blocks=both: expected one of all, single, double"),
        (("in_dims=[1,2,3]",), "in_dims=[1,2,3]: 3 values given"),
        (("train_double_block_indices=0-x",), "expected all, none, or indices"),
        (("network_reg_dims=(=4",), "is not a regular expression"),
        (("network_reg_lrs=img=fast",), "'fast' is not a number"),
        (("ggpo_beta=0.01", "ggpo_sigma=0.03"), "LoRA-GGPO is not supported"),
        (("algo=loha",), "networks.lora_flux (sd-scripts' FLUX LoRA) does not read it"),
        (("block_dims=1,2",), "does not read it"),
        (("split_qkvv=True",), "unknown argument of networks.lora_flux; did you mean 'split_qkv'"),
        (("img_attn_dim=-1",), "must not be negative"),
        (("single_dim=big",), "single_dim=big: expected an integer rank"),
    ],
)
def test_bad_network_args_are_refused_before_training(args, message):
    with pytest.raises(ValueError) as e:
        flux_config(*args)
    assert message in str(e.value)


def test_block_index_outside_the_model_is_named():
    parts = tiny_parts(2, 2)
    with pytest.raises(ValueError, match=r"train_single_block_indices=0-5: index 5 is outside this model's 2 blocks"):
        inject(flux_config("train_single_block_indices=0-5"), FAMILY.adapter_roots(parts), FAMILY.target_classes)


def test_lora_flux_keys_under_another_module_are_refused():
    with pytest.raises(ValueError, match="only --network_module networks.lora_flux / networks.lora_sd3 .*read it"):
        make_config("split_qkv=True", module="networks.lora")  # (and the modules of families registered after SD3)


def test_chroma_targets_its_blocks_and_t5_by_bfl_names(tmp_path):
    """Chroma (no modulation Linears, no CLIP): the double / single blocks' Linears and, with train_t5xxl, T5; every
    module maps by ComfyUI's rule onto Chroma's BFL weights."""
    family = get_family("chroma")
    parts = build_chroma()
    cfg = make_config("train_t5xxl=True", "in_dims=[2,0,0,0,2]", module="networks.lora_flux", dim=DIM, alpha=ALPHA)
    network = inject(cfg, family.adapter_roots(parts), family.target_classes)
    names = set(network.names)
    assert "lora_unet_double_blocks_0_img_attn_qkv" in names and "lora_unet_single_blocks_1_linear2" in names
    assert {"lora_unet_img_in", "lora_unet_txt_in"} <= names and not any("_mod" in n for n in names)
    assert any(n.startswith("lora_te3_encoder_block_0_layer_0_SelfAttention") for n in names)
    unet = {n for n in names if n.startswith("lora_unet")}
    assert len(unet) == 2 * 8 + 2 * 2 + 2  # double: qkv, proj, mlp.0, mlp.2 per side; single: linear1, linear2
    network.eject()
    bfl = K.diffusers_to_bfl(parts.denoiser.state_dict())
    comfy = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_") for k in bfl if k.endswith(".weight")}
    assert unet <= comfy


def build_chroma() -> Parts:
    from diffusers import ChromaTransformer2DModel

    from library.families.flux.tiny import CHROMA_EXTRA

    torch.manual_seed(0)
    model = ChromaTransformer2DModel(**TRANSFORMER, **CHROMA_EXTRA).eval().requires_grad_(False)
    return Parts(model, None, [tiny_t5().eval().requires_grad_(False)], [None], {}, family="chroma")


# ------------------------------------------------------------------------------------------ a training run
def test_a_lora_flux_run_through_train_network_saves_a_split_file_at_the_trained_strength(dataset, tmp_path,
                                                                                        monkeypatch):  # fmt: skip
    """train_network.run with the FLUX family (flux_train_network.py is its own piece): split_qkv + in_dims train,
    the file's split modules keep their off-diagonal blocks 0 and alpha k·α, and the metadata names the module."""
    import library.run.setup as run_setup
    import train_network

    # the run layer's SD attention processor (AttnProcessor2_0) does not fit diffusers' FluxAttention: keep FLUX's own
    monkeypatch.setattr(run_setup, "set_attention", lambda modules, backend: None)
    model = FAMILY.save(build_tiny_flux("flux-dev"), tmp_path / "model")
    argv = [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(dataset), "--caption_extension", ".txt",
        "--output_dir", str(tmp_path / "out"), "--output_name", "t", "--network_module", "networks.lora_flux",
        "--network_dim", "4", "--network_alpha", "2", "--network_args", "split_qkv=True", "in_dims=[2,0,0,0,2]",
        "network_reg_lrs=txt_in=0", "--train_batch_size", "2", "--resolution", "64", "--max_train_steps", "2",
        "--max_data_loader_n_workers", "0", "--seed", "1", "--optimizer_type", "AdamW", "--learning_rate", "3e-3",
    ]  # fmt: skip
    result = train_network.run(argv, family_names=("flux-dev",))
    assert result.steps == 2 and result.failed is None
    state, meta = load_state_dict(result.output)
    assert meta["ss_network_module"] == "networks.lora_flux" and meta["ss_base_model_version"] == "flux1"
    up = state["lora_unet_single_blocks_0_linear1.lora_up.weight"].float()
    assert float(state["lora_unet_single_blocks_0_linear1.alpha"]) == 4 * 2.0
    assert up[:32, :4].abs().sum() > 0 and up[:32, 4:].abs().sum() == 0 and up[96:, :12].abs().sum() == 0
    assert float(state["lora_unet_double_blocks_0_img_attn_qkv.alpha"]) == 3 * 2.0
    assert state["lora_unet_img_in.lora_up.weight"].abs().sum() > 0
    assert state["lora_unet_txt_in.lora_up.weight"].abs().sum() == 0  # its reg lr 0: not trained


def test_a_peft_file_or_another_familys_file_is_named_for_what_it_is(tmp_path):
    """--network_weights with a PEFT / ai-toolkit FLUX LoRA: the message says PEFT and gives the converter (it split
    the keys at the first dot and hinted at "not a kohya-format adapter for SD1/SD2/SDXL"); a FLUX file given to SD3
    names FLUX (it hinted "SD1 vs SD2 vs SDXL?")."""
    from library.families.sd3.tiny import build_tiny_sd3
    from networks.inject import network_from_state_dict

    parts = build_tiny_flux("flux-dev", blocks=(1, 1))
    family = get_family("flux-dev")
    network = prepare_network(make_config(dim=2), family.adapter_roots(parts), family.target_classes)
    kohya = {k: v.clone() for k, v in network.state_dict_for_file().items()}
    network.eject()
    peft = {"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8),
            "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 2)}  # fmt: skip
    for load in (lambda sd: network_from_state_dict(sd, family.adapter_roots(parts), source="ai.safetensors"),
                 lambda sd: network.load_kohya_state_dict(sd, source="ai.safetensors")):  # fmt: skip
        with pytest.raises(ValueError) as e:
            load(peft)
        assert "a PEFT / diffusers-format LoRA" in str(e.value)
        assert "networks/convert_flux_lora.py --src ai-toolkit --dst sd-scripts" in str(e.value)
    sd3 = build_tiny_sd3()
    sd3_family = get_family(sd3.family)
    with pytest.raises(ValueError) as e:
        network_from_state_dict(kohya, sd3_family.adapter_roots(sd3), source="flux_lora.safetensors")
    assert "the file looks made for FLUX" in str(e.value) and "SD1" not in str(e.value)
