"""``--network_module networks.lora_sd3`` (networks/lora_sd3.py), its files, networks/convert_sd3_lora.py, and LyCORIS
on SD3 / SD3.5.

Oracles: sd-scripts' ``create_network`` / ``LoRANetwork.create_modules`` selection and rank rules, re-typed below
from networks/lora_sd3.py (v0.10.1) over the SAI module names of the model and the text encoders' module classes;
sd-scripts' split-qkv forward re-typed; ComfyUI's key rule (``lora_unet_`` + SAI key minus ``.weight``, dots as
underscores) with a merge by it into the SAI weights, converted by diffusers' own single-file converter
(``convert_sd3_transformer_checkpoint_to_diffusers``); diffusers' ``StableDiffusion3Pipeline.load_lora_weights`` on
the converted (PEFT) file; lycoris-lora's functional ΔW formulas for LoHa / LoKr.
"""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from _networks_helpers import lycoris_delta, make_config, single_thread  # noqa: F401

from library.families import get_family
from library.families.base import Parts, Root
from library.families.sd3 import keys as K
from library.files.weights import load_state_dict, save_state_dict
from networks import inject, network_from_file
from networks.inject import prepare_network

DIM, ALPHA = 4, 2.0
WIDTH = 32
FAMILY = get_family("sd3.5-medium")
CLASSES = FAMILY.target_classes


def tiny_parts(num_layers: int = 3, dual: tuple[int, ...] = (0,), seed: int = 0) -> Parts:
    """A tiny SD3.5-medium-like transformer (dual attention in ``dual``, q/k RMS norms; the last block's context side
    pre-only) with CLIP-L, CLIP-G (with projection) and T5; no zero weights."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=num_layers,
                                  attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
                                  caption_projection_dim=32, pooled_projection_dim=64, out_channels=16,
                                  qk_norm="rms_norm", dual_attention_layers=dual)  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    clip = dict(vocab_size=1000, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                projection_dim=32, max_position_embeddings=77)  # fmt: skip
    encoders = [
        CLIPTextModelWithProjection(CLIPTextConfig(**clip)),
        CLIPTextModelWithProjection(CLIPTextConfig(**clip)),
        T5EncoderModel(T5Config(vocab_size=1000, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                feed_forward_proj="gated-gelu")),
    ]  # fmt: skip
    for module in (model, *encoders):
        module.eval().requires_grad_(False)
    return Parts(model, None, encoders, [None, None, None], {}, family="sd3.5-medium")


def sd3_roots(parts: Parts) -> list[Root]:
    """The family's adapter roots: the transformer under SAI module names with its fused qkv / swapped modulations,
    CLIP-L / CLIP-G with ``text_model.``, T5 as it is."""
    return FAMILY.adapter_roots(parts)


def inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(2, 16, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 7, 32, generator=g),
        "pooled_projections": torch.randn(2, 64, generator=g),
        "timestep": torch.tensor([100.0, 700.0]),
    }


def run(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(), return_dict=False)[0]


def is_split(network, name: str) -> bool:
    cfg = network.config
    return bool(cfg is not None and cfg.module_args.split_qkv and re.search(r"joint_blocks_\d+_.*qkv", name))


def randomize(network, seed: int = 3) -> None:
    """Non-zero adapters; a split module's lora_up stays block-diagonal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, adapter in network.adapters.items():
            for key, p in adapter.params.items():
                noise = torch.randn(p.shape, generator=g) * 0.1
                p.add_(noise * (p != 0) if key == "lora_up" and is_split(network, name) else noise)


def sd3_config(*args, flags=(), module="networks.lora_sd3"):
    return make_config(*args, module=module, dim=DIM, alpha=ALPHA, flags=flags)


# --------------------------------------------------------------------------- sd-scripts' rules, re-typed
def sd_scripts_network(kwargs: dict, parts: Parts) -> dict[str, tuple[int, float]]:
    """{kohya name: (dim, alpha)} that sd-scripts' LoRANetwork (networks/lora_sd3.py) builds for these network_args,
    from the SAI module names of the model (its MMDiT's Linear / Conv2d weights) and the text encoders' classes."""
    keys = ["context_attn_dim", "context_mlp_dim", "context_mod_dim", "x_attn_dim", "x_mlp_dim", "x_mod_dim"]
    type_dims = [int(kwargs[k]) if k in kwargs else None for k in keys]
    if all(d is None for d in type_dims):
        type_dims = None
    emb_dims = [int(d) for d in kwargs["emb_dims"].strip("[]").split(",")] if "emb_dims" in kwargs else None
    blocks = None
    if "train_block_indices" in kwargs:
        blocks = [False] * 999
        for r in kwargs["train_block_indices"].split(","):
            start, _, end = r.partition("-")
            for i in range(int(start), int(end or start) + 1):
                blocks[i] = True
    conv_dim = int(kwargs["conv_dim"]) if "conv_dim" in kwargs else None
    conv_alpha = float(kwargs.get("conv_alpha", 1.0))
    out: dict[str, tuple[int, float]] = {}

    def create(is_mmdit: bool, names: list[tuple[str, bool]], flt=None, default_dim=None, force_conv=False):
        for lora_name, is_linear in names:
            if flt is not None and flt not in lora_name:
                continue
            dim = None
            alpha = ALPHA
            if is_linear:
                dim = default_dim if default_dim is not None else DIM
                if is_mmdit and type_dims is not None:
                    identifier = [("context_block", "attn"), ("context_block", "mlp"),
                                  ("context_block", "adaLN_modulation"), ("x_block", "attn"), ("x_block", "mlp"),
                                  ("x_block", "adaLN_modulation")]  # fmt: skip
                    for i, d in enumerate(type_dims):
                        if d is not None and all(id in lora_name for id in identifier[i]):
                            dim = d
                            break
                if is_mmdit and dim and blocks is not None and "joint_blocks" in lora_name:
                    if not blocks[int(lora_name.split("_")[4])]:
                        dim = 0
            elif conv_dim is not None:
                dim, alpha = conv_dim, conv_alpha
            elif force_conv:
                dim = default_dim if default_dim is not None else DIM
            if dim:
                assert lora_name not in out
                out[lora_name] = (dim, alpha)

    te_classes = ["CLIPAttention", "CLIPSdpaAttention", "CLIPMLP", "T5Attention", "T5DenseGatedActDense"]
    for index, encoder in enumerate(parts.text_encoders):
        if index >= 2 and kwargs.get("train_t5xxl") != "True":
            break
        prefix = ["lora_te1", "lora_te2", "lora_te3"][index]
        level = "text_model." if index < 2 and not hasattr(encoder, "text_model") else ""
        names = []
        for name, module in encoder.named_modules():
            if type(module).__name__ in te_classes:
                for child, leaf in module.named_modules():
                    if type(leaf).__name__ == "Linear":
                        names.append((f"{prefix}.{level}{name}.{child}".replace(".", "_"), True))
        create(False, names)
    sai = K.diffusers_to_sai(parts.denoiser.state_dict())
    modules = [
        (k.removesuffix(".weight"), v.dim() == 2) for k, v in sai.items() if k.endswith(".weight") and v.dim() > 1
    ]
    # SingleDiTBlock = joint_blocks.N.{x_block,context_block}: every Linear in it
    create(True, [(f"lora_unet.{m}".replace(".", "_"), lin) for m, lin in modules if m.startswith("joint_blocks.")])
    if emb_dims:
        filters = ["context_embedder", "_t_embedder", "x_embedder", "y_embedder", "final_layer_adaLN_modulation",
                   "final_layer_linear"]  # fmt: skip
        for flt, in_dim in zip(filters, emb_dims):
            names = [(f"lora_unet.{m}".replace(".", "_"), lin) for m, lin in modules]
            create(True, names, flt, in_dim, force_conv=flt == "x_embedder")
    return out


def ours(network) -> dict[str, tuple[int, float]]:
    """{name: (rank, alpha)}: a split module's rank 3r and alpha 3α back to (r, α)."""
    out = {}
    for name in network.names:
        adapter = network.layer(name).adapter
        k = 3 if is_split(network, name) else 1
        out[name] = (adapter.rank // k, float(adapter.alpha) / k)
    return out


CASES = [
    (),
    ("train_t5xxl=True",),
    ("context_attn_dim=8", "context_mlp_dim=0", "context_mod_dim=2", "x_attn_dim=6", "x_mlp_dim=3", "x_mod_dim=0"),
    ("emb_dims=[2,3,4,5,6,7]", "x_attn_dim=5"),
    ("emb_dims=[0,2,1,0,0,3]", "conv_dim=5", "conv_alpha=3"),
    ("train_block_indices=0,2", "x_mlp_dim=7"),
    ("split_qkv=True", "context_attn_dim=3", "train_block_indices=1-2"),
]


@pytest.mark.parametrize("args", CASES, ids=lambda a: " ".join(a) or "default")
def test_modules_and_ranks_equal_sd_scripts_create_modules(args):
    parts = tiny_parts()
    kwargs = dict(a.split("=", 1) for a in args)
    expected = sd_scripts_network(kwargs, parts)
    default = sd_scripts_network({}, parts)
    network = inject(sd3_config(*args), sd3_roots(parts), CLASSES)
    got = ours(network)
    assert sorted(got) == sorted(expected)
    assert got == expected
    if args:  # every case changes what the default builds
        assert expected != default


def test_default_targets_are_every_joint_block_linear_and_both_clips():
    parts = tiny_parts()
    names = set(inject(sd3_config(), sd3_roots(parts), CLASSES).names)
    for name in ("lora_unet_joint_blocks_0_x_block_attn_qkv", "lora_unet_joint_blocks_0_x_block_attn2_qkv",
                 "lora_unet_joint_blocks_0_x_block_attn2_proj", "lora_unet_joint_blocks_1_context_block_mlp_fc2",
                 "lora_unet_joint_blocks_2_context_block_adaLN_modulation_1", "lora_unet_joint_blocks_2_x_block_mlp_fc1",
                 "lora_te1_text_model_encoder_layers_0_self_attn_q_proj", "lora_te2_text_model_encoder_layers_1_mlp_fc2"):  # fmt: skip
        assert name in names, name
    assert not any(n.startswith("lora_te3") or "embedder" in n or "final_layer" in n for n in names)
    assert "lora_unet_joint_blocks_2_context_block_attn_proj" not in names  # the last context side is pre-only


def test_verbose_dropouts_and_loraplus_as_sd_scripts(caplog):
    """verbose lists every module and the skipped ones; rank / module / neuron dropout reach every module and act in
    training only; LoRA+ puts each part's lora_up at lr × its ratio (sd-scripts' assemble_params: the transformer at
    --unet_lr, CLIP-L / CLIP-G / T5 at their --text_encoder_lr entries)."""
    parts = tiny_parts(2)
    args = ("verbose=True", "x_mlp_dim=0", "rank_dropout=0.5", "module_dropout=0.25", "loraplus_unet_lr_ratio=4",
            "loraplus_text_encoder_lr_ratio=2", "train_t5xxl=True")  # fmt: skip
    with caplog.at_level("INFO"):
        network = inject(sd3_config(*args, flags=("--network_dropout", "0.1")), sd3_roots(parts), CLASSES)
    assert "lora_unet_joint_blocks_0_x_block_attn_qkv" in caplog.text
    assert "modules are skipped" in caplog.text and "lora_unet_joint_blocks_1_x_block_mlp_fc2" in caplog.text
    layers = [network.layer(n) for n in network.names]
    assert all((lay.rank_dropout, lay.module_dropout, lay.dropout) == (0.5, 0.25, 0.1) for lay in layers)
    randomize(network)
    network.set_training(False)
    a = run(parts.denoiser)
    torch.testing.assert_close(run(parts.denoiser), a)
    network.set_training(True)
    torch.manual_seed(0)
    assert (run(parts.denoiser) - a).abs().max() > 1e-3
    groups = network.param_groups(unet_lr=1e-3, text_encoder_lr=[1e-4, 5e-5, 2e-5], learning_rate=3e-4)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    part_lr = {"lora_unet": 1e-3, "lora_te1": 1e-4, "lora_te2": 5e-5, "lora_te3": 2e-5}
    for name, adapter in network.adapters.items():
        lr = part_lr[name[:9].rstrip("_")]
        ratio = 4 if name.startswith("lora_unet") else 2
        for key, p in adapter.params.items():
            assert lr_of[id(p)] == pytest.approx(lr * ratio if key == "lora_up" else lr), (name, key)
    assert {n[:8] for n in network.names} == {"lora_une", "lora_te1", "lora_te2", "lora_te3"}


# ------------------------------------------------------------------------------------------------ split_qkv
def test_split_qkv_is_sd_scripts_split_forward_saved_fused_at_the_trained_strength(tmp_path):
    parts = tiny_parts(2)
    network = inject(sd3_config("split_qkv=True"), sd3_roots(parts), CLASSES)
    randomize(network)
    network.set_training(False)
    network.save(tmp_path / "split.safetensors")
    sd, _ = load_state_dict(tmp_path / "split.safetensors")
    for name in ("lora_unet_joint_blocks_0_x_block_attn_qkv", "lora_unet_joint_blocks_0_x_block_attn2_qkv",
                 "lora_unet_joint_blocks_1_context_block_attn_qkv"):  # fmt: skip
        down, up, alpha = sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"], float(sd[f"{name}.alpha"])
        assert tuple(down.shape) == (3 * DIM, WIDTH) and tuple(up.shape) == (3 * WIDTH, 3 * DIM)
        assert alpha == 3 * ALPHA  # sd-scripts writes ALPHA: 3x weaker in every reader
        # sd-scripts' split forward (LoRAModule with split_dims): org + cat_i(up_i(down_i(x))) · α/r, the parts cut
        # from the file as its load_state_dict cuts them (down chunked, up's diagonal blocks)
        x = torch.randn(3, WIDTH)
        downs = down.chunk(3)
        ups = []
        for j in range(3):
            block = up[j * WIDTH : (j + 1) * WIDTH]
            ups.append(block[:, j * DIM : (j + 1) * DIM])
            assert block[:, : j * DIM].abs().sum() == 0 and block[:, (j + 1) * DIM :].abs().sum() == 0
        layer = network.layer(name)
        expected = layer.base_layer(x) + torch.cat([x @ d.T @ u.T for d, u in zip(downs, ups)], -1) * ALPHA / DIM
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the files: ComfyUI's rule
def lora_delta(state: dict, module: str) -> torch.Tensor:
    down, up = state[f"{module}.lora_down.weight"], state[f"{module}.lora_up.weight"]
    scale = float(state[f"{module}.alpha"]) / down.shape[0]
    if down.dim() == 4:  # ComfyUI: conv LoRA, (out, r) @ (r, in·kh·kw)
        return scale * (up.flatten(1) @ down.flatten(1)).reshape(up.shape[0], *down.shape[1:])
    return scale * up @ down


def comfy_merge(parts: Parts, state: dict, delta=lora_delta) -> torch.nn.Module:
    """ComfyUI's rule: ``lora_unet_`` + SAI key minus ``.weight`` (dots as underscores) -> that weight of the SAI
    single file (``model.diffusion_model.`` keys), merged with ``delta``; then diffusers' own single-file converter
    and a fresh SD3Transformer2DModel."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    sai = K.diffusers_to_sai(parts.denoiser.state_dict(), prefix=K.SAI_PREFIX)
    by_name = {"lora_unet_" + k.removeprefix(K.SAI_PREFIX).removesuffix(".weight").replace(".", "_"): k
               for k in sai if k.endswith(".weight")}  # fmt: skip
    modules = {k.split(".")[0] for k in state if k.startswith("lora_unet_")}
    for module in modules:
        assert module in by_name, module  # every saved module maps onto the SAI state dict
        weight = sai[by_name[module]]
        change = delta(state, module)
        if delta is lycoris_delta:  # ComfyUI reshapes a LoHa / LoKr ΔW to the weight (x_embedder's is (out, in·k·k))
            change = change.reshape(weight.shape)
        assert tuple(change.shape) == tuple(weight.shape), module  # shapes fit
        sai[by_name[module]] = weight + change
    converted = convert_sd3_transformer_checkpoint_to_diffusers({k: v.clone() for k, v in sai.items()})
    fresh = copy.deepcopy(parts.denoiser)
    fresh.load_state_dict(converted)
    return fresh


@pytest.mark.parametrize("args", [("emb_dims=[2,2,2,2,2,2]",), ("split_qkv=True", "emb_dims=[0,0,3,0,2,0]")],
                         ids=["emb_dims", "split_qkv"])  # fmt: skip
def test_comfyui_rule_merge_equals_our_adapter_merged_and_reloaded(args, tmp_path):
    parts = tiny_parts()
    plain = run(parts.denoiser)
    network = inject(sd3_config(*args, flags=("--network_train_unet_only",)), sd3_roots(parts), CLASSES)
    randomize(network)
    network.set_training(False)
    adapted = run(parts.denoiser)
    assert (adapted - plain).abs().max() > 1e-2
    network.merge()  # merged (ΔW into the weights, fused modules split into the leaves) == unmerged
    torch.testing.assert_close(run(parts.denoiser), adapted, rtol=1e-4, atol=1e-5)
    network.unmerge()
    path = tmp_path / "lora.safetensors"
    network.save(path)
    state, _ = load_state_dict(path)
    kinds = {"x_block_attn_qkv", "x_block_attn2_qkv", "context_block_attn_qkv", "context_block_mlp_fc1",
             "x_block_adaLN_modulation_1", "joint_blocks_2_context_block_adaLN_modulation_1", "x_embedder_proj",
             "final_layer_adaLN_modulation_1"}  # fmt: skip
    assert all(any(kind in k for k in state) for kind in kinds)
    network.eject()
    torch.testing.assert_close(run(comfy_merge(parts, state)), adapted, rtol=1e-4, atol=1e-5)
    # --network_weights into a network built from the same flags, and --dim_from_weights (the file's ranks)
    for flags in (("--network_weights", str(path)), ("--network_weights", str(path), "--dim_from_weights")):
        cfg = sd3_config(*args, flags=("--network_train_unet_only", *flags))
        loaded = prepare_network(cfg, sd3_roots(parts), CLASSES)
        loaded.set_training(False)
        torch.testing.assert_close(run(parts.denoiser), adapted, rtol=1e-4, atol=1e-5)
        loaded.eject()


# ------------------------------------------------------------------------------------------------ diffusers
def pipeline(parts: Parts):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    te1, te2, _ = parts.text_encoders
    return StableDiffusion3Pipeline(transformer=parts.denoiser, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    vae=None, text_encoder=te1, tokenizer=None, text_encoder_2=te2, tokenizer_2=None,
                                    text_encoder_3=None, tokenizer_3=None)  # fmt: skip


def test_diffusers_loads_our_file_only_once_converted(tmp_path, caplog, capsys):
    """StableDiffusion3Pipeline.load_lora_weights: a kohya SD3 file changes nothing (what the docs warn of); the file
    converted by networks/convert_sd3_lora.py gives the transformer and CLIP-L / CLIP-G outputs our injected adapters
    give, for every module kind (fused qkv, attn2, the pre-only context block, the embedders, the final layer).
    T5's modules are left out with a warning; converted back, every module's ΔW is the original."""
    from networks import convert_sd3_lora, resize_lora

    parts = tiny_parts()
    ids = torch.randint(0, 1000, (1, 77), generator=torch.Generator().manual_seed(0))
    plain = run(parts.denoiser)
    plain_clip = [te(ids).text_embeds for te in parts.text_encoders[:2]]
    cfg = sd3_config("emb_dims=[2,3,4,3,2,3]", "train_t5xxl=True", "x_attn_dim=5")
    network = inject(cfg, sd3_roots(parts), CLASSES)
    randomize(network)
    network.set_training(False)
    adapted = run(parts.denoiser)
    adapted_clip = [te(ids).text_embeds for te in parts.text_encoders[:2]]
    assert all((a - p).abs().max() > 1e-2 for a, p in zip(adapted_clip, plain_clip))
    kohya = tmp_path / "kohya.safetensors"
    network.save(kohya)
    network.eject()
    pipe = pipeline(parts)
    pipe.load_lora_weights(str(kohya))
    torch.testing.assert_close(run(pipe.transformer), plain)  # loads nothing
    pipe.unload_lora_weights()
    peft = tmp_path / "peft.safetensors"
    with caplog.at_level(logging.WARNING):
        assert convert_sd3_lora.main(["--src_path", str(kohya), "--dst_path", str(peft)]) == 0
    assert "T5-XXL module(s) (lora_te3_" in caplog.text
    pipe.load_lora_weights(str(peft))
    torch.testing.assert_close(run(pipe.transformer), adapted, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        for te, expected in zip((pipe.text_encoder, pipe.text_encoder_2), adapted_clip):
            torch.testing.assert_close(te(ids).text_embeds, expected, rtol=1e-4, atol=1e-5)
    pipe.unload_lora_weights()
    # a PEFT file given to a kohya tool: the message names the converter
    assert resize_lora.main(["--model", str(peft), "--save_to", str(tmp_path / "r.safetensors")]) == 2
    assert "networks/convert_sd3_lora.py --src diffusers --dst sd-scripts" in capsys.readouterr().err
    back = tmp_path / "back.safetensors"
    assert convert_sd3_lora.main(["--src", "diffusers", "--dst", "sd-scripts", "--src_path", str(peft),
                                  "--dst_path", str(back)]) == 0  # fmt: skip
    original, _ = load_state_dict(kohya)
    again, _ = load_state_dict(back)
    modules = {k.split(".")[0] for k in original if not k.startswith("lora_te3")}
    assert modules == {k.split(".")[0] for k in again}
    for m in modules:
        assert again[f"{m}.lora_down.weight"].shape == original[f"{m}.lora_down.weight"].shape  # the rank is kept
        torch.testing.assert_close(lora_delta(again, m), lora_delta(original, m), rtol=1e-5, atol=1e-6)


def test_converter_refuses_what_has_no_peft_form(tmp_path, capsys):
    from networks import convert_sd3_lora

    parts = tiny_parts(2)
    cfg = make_config("algo=loha", module="lycoris.kohya", dim=DIM, alpha=ALPHA, flags=("--network_train_unet_only",))
    network = inject(cfg, sd3_roots(parts), CLASSES)
    network.save(tmp_path / "loha.safetensors")
    code = convert_sd3_lora.main(["--src_path", str(tmp_path / "loha.safetensors"), "--dst_path",
                                  str(tmp_path / "out.safetensors")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "is not a plain LoRA module" in err and "(hada_w1_a, hada_w1_b" in err and "svd_merge_lora.py" in err
    bad = {"lora_unet_joint_blocks_0_x_block_ffn.lora_down.weight": torch.zeros(2, 4),
           "lora_unet_joint_blocks_0_x_block_ffn.lora_up.weight": torch.zeros(4, 2)}  # fmt: skip
    save_state_dict(bad, tmp_path / "bad.safetensors", {})
    assert convert_sd3_lora.main(["--src_path", str(tmp_path / "bad.safetensors"), "--dst_path",
                                  str(tmp_path / "out.safetensors")]) == 2  # fmt: skip
    assert "lora_unet_joint_blocks_0_x_block_ffn is not an SD3 / SD3.5 transformer module" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ LyCORIS
@pytest.mark.parametrize("algo", ["loha", "lokr"])
def test_lycoris_loha_lokr_on_sd3_merge_by_comfyui_rule_with_lycoris_formulas(algo, tmp_path):
    """lycoris.kohya on SD3 selects the family's classes (the joint blocks, fused by the SAI layout, and with the
    ``full`` preset the embedders and final layer); the file's ΔW by lycoris-lora's formulas, merged by ComfyUI's rule,
    gives our injected adapter's output; merged == unmerged."""
    parts = tiny_parts(2)
    args = ("algo=loha",) if algo == "loha" else ("algo=lokr", "factor=4")
    cfg = make_config(*args, module="lycoris.kohya", dim=DIM, alpha=ALPHA, flags=("--network_train_unet_only",))
    network = inject(cfg, sd3_roots(parts), CLASSES)
    names = set(network.names)
    assert {"lora_unet_joint_blocks_0_x_block_attn_qkv", "lora_unet_joint_blocks_0_x_block_attn2_qkv",
            "lora_unet_final_layer_adaLN_modulation_1", "lora_unet_context_embedder"} <= names  # fmt: skip
    randomize(network)
    network.set_training(False)
    adapted = run(parts.denoiser)
    network.merge()
    torch.testing.assert_close(run(parts.denoiser), adapted, rtol=1e-4, atol=1e-5)
    network.unmerge()
    network.save(tmp_path / "a.safetensors")
    network.eject()
    state, _ = load_state_dict(tmp_path / "a.safetensors")
    assert "lora_unet_x_embedder_proj.alpha" in state  # the full preset's patch convolution
    torch.testing.assert_close(run(comfy_merge(parts, state, lycoris_delta)), adapted, rtol=1e-4, atol=1e-5)
    loaded = network_from_file(tmp_path / "a.safetensors", sd3_roots(parts))
    loaded.set_training(False)
    torch.testing.assert_close(run(parts.denoiser), adapted, rtol=1e-4, atol=1e-5)


BLOCK_KINDS = {f"{side}_{m}" for side in ("x_block", "context_block")
               for m in ("attn_qkv", "attn_proj", "mlp_fc1", "mlp_fc2", "adaLN_modulation_1")} | {
    "x_block_attn2_qkv", "x_block_attn2_proj"}  # fmt: skip
ATTN_KINDS = {k for k in BLOCK_KINDS if "attn" in k}
EMB_LINEAR = {"context_embedder", "t_embedder_mlp_0", "t_embedder_mlp_2", "y_embedder_mlp_0", "y_embedder_mlp_2",
              "final_layer_adaLN_modulation_1", "final_layer_linear"}  # fmt: skip
PRESET_KINDS = {
    "kohya": (BLOCK_KINDS, "all"),
    "attn-mlp": (BLOCK_KINDS, "all"),
    "full": (BLOCK_KINDS | EMB_LINEAR | {"x_embedder_proj"}, "all"),
    "full-lin": (BLOCK_KINDS | EMB_LINEAR, "all"),
    "attn-only": (ATTN_KINDS, "attention"),
    "unet-only": (BLOCK_KINDS | EMB_LINEAR | {"x_embedder_proj"}, ""),
    "unet-transformer-only": (BLOCK_KINDS, ""),
    "unet-convblock-only": ({"x_embedder_proj"}, ""),
}


@pytest.mark.parametrize("preset", list(PRESET_KINDS))
def test_lycoris_presets_resolve_to_the_sd3_modules(preset):
    """LyCORIS' built-in presets through the SD3 family's TargetClasses: the joint blocks' modules by SAI name, the
    embedders / final layer for the full presets, attention only for attn-only; CLIP-L and CLIP-G (never T5)."""
    from networks.targets import PRESETS

    assert set(PRESET_KINDS) == set(PRESETS)
    parts = tiny_parts(2)
    cfg = make_config("algo=lora", f"preset={preset}", module="lycoris.kohya", dim=DIM, alpha=ALPHA)
    names = set(inject(cfg, sd3_roots(parts), CLASSES).names)
    kinds = {re.sub(r"^lora_unet_(joint_blocks_\d+_)?", "", n) for n in names if n.startswith("lora_unet")}
    unet, te = PRESET_KINDS[preset]
    assert kinds == unet
    te_kinds = {re.sub(r"^lora_te\d_text_model_encoder_layers_\d+_", "", n) for n in names if n.startswith("lora_te")}
    assert {n[:8] for n in names if n.startswith("lora_te")} == ({"lora_te1", "lora_te2"} if te else set())
    if te == "all":
        assert te_kinds == {"self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj",
                            "mlp_fc1", "mlp_fc2"}  # fmt: skip
    elif te == "attention":
        assert te_kinds == {"self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj"}


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("emb_dims=[1,2,3]",), "emb_dims=[1,2,3]: 3 values given; 6 are needed"),
        (("x_attn_dim=-1",), "x_attn_dim=-1: must not be negative"),
        (("algo=loha",), "networks.lora_sd3 (sd-scripts' SD3 LoRA) does not read it"),
        (("network_reg_dims=qkv=4",), "unknown argument of networks.lora_sd3"),
        (("train_block_indices=1-",), "expected all, none, or indices"),
    ],
)
def test_bad_network_args_are_refused_before_training(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sd3_config(*args)


def test_block_index_outside_the_model_is_named():
    parts = tiny_parts(2)
    with pytest.raises(ValueError, match=r"train_block_indices=0-5: index 5 is outside this model's 2 blocks"):
        inject(sd3_config("train_block_indices=0-5"), sd3_roots(parts), CLASSES)


def test_lora_sd3_keys_under_another_module_are_refused():
    with pytest.raises(ValueError, match=r"emb_dims: only --network_module networks.lora_sd3 reads it"):
        sd3_config("emb_dims=[1,1,1,1,1,1]", module="networks.lora")


# ------------------------------------------------------------------------------------------ a training run
def test_a_lora_sd3_run_through_sd3_train_network_saves_a_file_diffusers_reads_once_converted(dataset, tmp_path):
    """sd3_train_network.run with networks.lora_sd3 on the tiny SD3.5-medium SAI file: split_qkv + emb_dims train,
    the file's split modules are block-diagonal with alpha 3α, the metadata names the module, every module is an SAI
    weight (ComfyUI's rule) and the converted file loads in diffusers."""
    import sd3_train_network
    from library.families.sd3.lora_formats import kohya_to_peft
    from library.families.sd3.tiny import build_tiny_sd3, write_tiny_files

    files = write_tiny_files(build_tiny_sd3("sd3.5-medium"), tmp_path / "model")
    argv = [
        "--pretrained_model_name_or_path", str(files["model"]), "--train_data_dir", str(dataset),
        "--caption_extension", ".txt", "--output_dir", str(tmp_path / "out"), "--output_name", "t",
        "--network_module", "networks.lora_sd3", "--network_dim", "4", "--network_alpha", "2", "--network_args",
        "split_qkv=True", "emb_dims=[2,0,2,0,0,2]", "context_mlp_dim=0", "--train_batch_size", "2", "--resolution",
        "64", "--max_train_steps", "2", "--max_data_loader_n_workers", "0", "--seed", "1", "--optimizer_type", "AdamW",
        "--learning_rate", "3e-3", "--network_train_unet_only",
    ]  # fmt: skip
    result = sd3_train_network.run(argv)
    assert result.steps == 2 and result.failed is None
    state, meta = load_state_dict(result.output)
    assert meta["ss_network_module"] == "networks.lora_sd3"
    name = "lora_unet_joint_blocks_0_x_block_attn_qkv"
    up = state[f"{name}.lora_up.weight"].float()
    assert float(state[f"{name}.alpha"]) == 3 * 2.0 and up.abs().sum() > 0
    width = up.shape[0] // 3
    assert up[:width, 4:].abs().sum() == 0 and up[width : 2 * width, :4].abs().sum() == 0
    assert state["lora_unet_x_embedder_proj.lora_down.weight"].dim() == 4
    assert not any("context_block_mlp" in k for k in state)
    sai, _ = load_state_dict(files["model"])
    shapes = {"lora_unet_" + k.removeprefix(K.SAI_PREFIX).removesuffix(".weight").replace(".", "_"): v.shape
              for k, v in sai.items() if k.startswith(K.SAI_PREFIX) and k.endswith(".weight")}  # fmt: skip
    for module in {k.split(".")[0] for k in state}:
        assert tuple(lora_delta(state, module).shape) == tuple(shapes[module]), module
    assert any(k.startswith("transformer.transformer_blocks.0.attn.to_q.") for k in kohya_to_peft(state))
