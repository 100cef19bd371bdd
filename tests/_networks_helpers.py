"""Helpers for the networks tests: model roots, inputs, and ΔW formulas typed independently of ``networks``.

Roots: a test-only stand-in for ``family.adapter_roots(parts)`` until the families land (then switch to the family).

SD1/SD2: ``[("lora_unet", unet, identity), ("lora_te", te, add text_model.)]``; SDXL: the UNet renamed to the sgm
(ldm) layout with ``library.families.sd.unet_keys`` and two text encoders ``lora_te1`` / ``lora_te2``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from library.families.sd.unet_keys import block_map, diffusers_to_ldm


@pytest.fixture(autouse=True)
def single_thread():
    """One intra-op thread for the networks tests (imported by each test module, so autouse there).

    The tiny models run thousands of microsecond ops; with 2 OpenMP threads on a shared, loaded CPU every op waits
    for the second thread to be scheduled (measured: a tiny SDXL UNet forward with LoHa 13.4 s at 2 threads,
    0.04 s at 1). Restores the previous setting afterwards.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def te_rename(path: str) -> str:
    """kohya TE names always contain ``text_model_`` (transformers 5's CLIPTextModel is flat)."""
    return path if not path or path.startswith("text_model") else f"text_model.{path}"


def adapter_roots(parts) -> list:
    unet = parts.denoiser
    if len(parts.text_encoders) == 2:
        table = block_map(unet.config)

        def unet_rename(path: str) -> str:
            return diffusers_to_ldm(path, unet.config, table) if path else path

        te1, te2 = parts.text_encoders
        return [("lora_unet", unet, unet_rename), ("lora_te1", te1, te_rename), ("lora_te2", te2, te_rename)]
    return [("lora_unet", unet, lambda p: p), ("lora_te", parts.text_encoders[0], te_rename)]


# ------------------------------------------------------------------------------------------------ model inputs
def unet_inputs(parts, seed: int = 0, batch: int = 2) -> dict:
    """Deterministic UNet inputs for a tiny model (SDXL: with its text_time conditioning)."""
    g = torch.Generator().manual_seed(seed)
    cfg = parts.denoiser.config
    size = cfg.sample_size
    inputs = {
        "sample": torch.randn(batch, cfg.in_channels, size, size, generator=g),
        "timestep": torch.tensor([10, 500][:batch]),
        "encoder_hidden_states": torch.randn(batch, 5, cfg.cross_attention_dim, generator=g),
    }
    if cfg.addition_embed_type == "text_time":
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        inputs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, pooled, generator=g),
            "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * batch),
        }
    return inputs


@torch.no_grad()
def run_unet(unet, inputs: dict) -> torch.Tensor:
    return unet(**inputs).sample


TOKENS = torch.tensor(
    [[49406, 320, 1125, 539, 320, 2368, 49407, 49407], [49406, 1929, 2368, 49407, 49407, 49407, 49407, 49407]]
)


@torch.no_grad()
def run_te(te) -> torch.Tensor:
    return te(TOKENS).last_hidden_state


@torch.no_grad()
def perturb(network, seed: int = 0, std: float = 0.2) -> None:
    """Random adapter tensors (a fresh adapter has ΔW = 0, which would make every comparison trivial)."""
    g = torch.Generator().manual_seed(seed)
    for layer in network.layers():
        for p in layer.adapter.parameters():
            if p.dim() == 0:
                continue
            noise = torch.randn(p.shape, generator=g)
            if getattr(layer.adapter, "magnitude", None) is p:
                p.mul_(1 + 0.2 * noise)
            else:
                p.copy_(noise * std)


# ------------------------------------------------------------------------------------ independent ΔW formulas
def oracle_delta(t: dict, shape: tuple) -> torch.Tensor:
    """ΔW (alpha / r applied) of one module's file tensors, typed independently of networks.algos."""
    alpha = t.get("alpha")
    if "lora_down.weight" in t:
        down, up = t["lora_down.weight"].float(), t["lora_up.weight"].float()
        r = down.shape[0]
        if "lora_mid.weight" in t:
            mid = t["lora_mid.weight"].float()
            d2, u2 = down.flatten(1), up.flatten(1)
            delta = torch.stack(
                [torch.stack([u2 @ mid[:, :, y, x] @ d2 for x in range(shape[3])], -1) for y in range(shape[2])], -2
            )
        elif down.dim() == 4:  # sd-scripts' merge trick for 3x3 convs
            delta = F.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)
        else:
            delta = up @ down
    elif "hada_w1_a" in t:
        w = {k: v.float() for k, v in t.items()}
        r = w["hada_w1_b"].shape[0]
        if "hada_t1" in w:

            def half(a, b, core):
                return torch.stack(
                    [torch.stack([a.T @ core[:, :, y, x] @ b for x in range(shape[3])], -1) for y in range(shape[2])],
                    -2,
                )

            delta = half(w["hada_w1_a"], w["hada_w1_b"], w["hada_t1"]) * half(
                w["hada_w2_a"], w["hada_w2_b"], w["hada_t2"]
            )
        else:
            delta = ((w["hada_w1_a"] @ w["hada_w1_b"]) * (w["hada_w2_a"] @ w["hada_w2_b"])).reshape(shape)
    else:
        w = {k: v.float() for k, v in t.items()}
        w1 = w["lokr_w1"] if "lokr_w1" in w else w["lokr_w1_a"] @ w["lokr_w1_b"]
        a, c = w1.shape
        b, d = shape[0] // a, shape[1] // c
        if "lokr_w2" in w:
            w2 = w["lokr_w2"]
        elif "lokr_t2" in w:
            w2 = torch.einsum("ijyx,ip,jq->pqyx", w["lokr_t2"], w["lokr_w2_a"], w["lokr_w2_b"])
        else:
            w2 = (w["lokr_w2_a"] @ w["lokr_w2_b"]).reshape(b, d, *shape[2:])
        delta = torch.zeros(shape)
        for i in range(a):
            for j in range(c):
                delta[i * b : (i + 1) * b, j * d : (j + 1) * d] = w1[i, j] * w2
        decomposed = [k for k in ("lokr_w2_b", "lokr_w1_b") if k in w]
        r = w[decomposed[0]].shape[0] if decomposed else None
        if r is None:
            return delta
    scale = (float(alpha) if alpha is not None else r) / r
    return delta.reshape(shape) * scale


def oracle_weight(weight: torch.Tensor, t: dict, multiplier: float) -> torch.Tensor:
    """The adapted weight: W + m·ΔW, or with DoRA W + m·(mag · (W+ΔW)/‖W+ΔW‖_row − W)."""
    delta = oracle_delta(t, tuple(weight.shape))
    if "dora_scale" not in t:
        return weight + multiplier * delta
    merged = weight + delta
    mag = t["dora_scale"].float()
    if mag.shape[0] == weight.shape[0]:
        norm = torch.linalg.vector_norm(merged, dim=tuple(range(1, merged.dim())), keepdim=True)
    else:
        dims = (0, *range(2, merged.dim()))
        norm = torch.linalg.vector_norm(merged, dim=dims, keepdim=True)
    return weight + multiplier * (mag * merged / norm - weight)


@torch.no_grad()
def patch_with_oracle(roots: list, state_dict: dict, multiplier: float) -> int:
    """Write every module of a kohya state dict into the roots' weights with the oracle formulas; returns how many
    modules were patched (all of them must be found)."""
    groups: dict[str, dict] = {}
    for key, value in state_dict.items():
        name, _, suffix = key.partition(".")
        groups.setdefault(name, {})[suffix] = value
    where = {}
    for prefix, root, rename in roots:
        for path, module in root.named_modules():
            if path:
                try:
                    new = rename(path)
                except KeyError:
                    new = path
                where[f"{prefix}_{new}".replace(".", "_")] = module
    for name, tensors in groups.items():
        module = where[name]
        if "w_norm" in tensors:
            module.weight += multiplier * tensors["w_norm"].float()
            if "b_norm" in tensors:
                module.bias += multiplier * tensors["b_norm"].float()
            continue
        module.weight.copy_(oracle_weight(module.weight.float(), tensors, multiplier))
    return len(groups)


def make_config(*network_args: str, module: str = "networks.lora", dim: int = 4, alpha: float = 2.0, flags=()):
    """A NetworkConfig parsed from a command line, as a training script would."""
    import argparse

    from networks import NetworkConfig, add_network_args

    parser = argparse.ArgumentParser()
    add_network_args(parser)
    argv = ["--network_module", module, "--network_dim", str(dim), "--network_alpha", str(alpha), *flags]
    if network_args:
        argv += ["--network_args", *network_args]
    return NetworkConfig.from_args(parser.parse_args(argv))


def outputs(parts, inputs: dict) -> list[torch.Tensor]:
    """UNet output and every text encoder's last hidden state."""
    return [run_unet(parts.denoiser, inputs), *[run_te(te) for te in parts.text_encoders]]


def assert_outputs_close(a: list, b: list, atol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=atol)


# ---------------------------------------------------------------------------- real-size models on the meta device
_CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
REAL = {
    # SD 1.5 (runwayml/stable-diffusion-v1-5 unet/config.json, CLIP ViT-L/14 text model)
    "sd1": dict(
        unet=dict(block_out_channels=(320, 640, 1280, 1280), attention_head_dim=8, cross_attention_dim=768),
        text_encoders=[_CLIP_L],
    ),
    # SD 2.x (stabilityai/stable-diffusion-2-1; OpenCLIP-H as sd-scripts / diffusers load it: 23 layers)
    "sd2": dict(
        unet=dict(
            block_out_channels=(320, 640, 1280, 1280),
            attention_head_dim=(5, 10, 20, 20),
            cross_attention_dim=1024,
            use_linear_projection=True,
        ),
        text_encoders=[dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16)],
    ),
    # SDXL base 1.0 (sd-scripts' DIFFUSERS_SDXL_UNET_CONFIG; CLIP-L + OpenCLIP-bigG, 32 layers)
    "sdxl": dict(
        unet=dict(
            block_out_channels=(320, 640, 1280),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20),
            cross_attention_dim=2048,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
        ),
        text_encoders=[
            _CLIP_L,
            dict(
                hidden_size=1280,
                intermediate_size=5120,
                num_hidden_layers=32,
                num_attention_heads=20,
                projection_dim=1280,
            ),
        ],  # fmt: skip
    ),
}


def real_parts(family: str):
    """The released architecture of ``family`` on the meta device (no memory, no weights): unet + text_encoders."""
    from types import SimpleNamespace

    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    spec = REAL[family]
    with torch.device("meta"):
        unet = UNet2DConditionModel(**spec["unet"])
        tes = []
        for i, te in enumerate(spec["text_encoders"]):
            cls = CLIPTextModelWithProjection if i == 1 else CLIPTextModel
            tes.append(cls(CLIPTextConfig(**te)))
    return SimpleNamespace(denoiser=unet, text_encoders=tes)


def lycoris_delta(state: dict, module: str) -> torch.Tensor:
    """ΔW of a LoHa / LoKr module of an adapter file (``state``) by lycoris-lora's own functional formulas on the
    file's tensors (LoHa: gamma = alpha / r; LoKr: gamma = alpha)."""
    from lycoris.functional import loha, lokr

    alpha = state[f"{module}.alpha"].float()
    if f"{module}.hada_w1_a" in state:
        t = {k: state[f"{module}.hada_{k}"] for k in ("w1_a", "w1_b", "w2_a", "w2_b")}
        gamma = alpha / t["w1_b"].shape[0]
        return loha.diff_weight(t["w1_b"], t["w1_a"], t["w2_b"], t["w2_a"], None, None, gamma=gamma)
    names = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
    return lokr.diff_weight(*(state.get(f"{module}.{k}") for k in names), gamma=alpha)


def random_lora_state(family, parts, seed: int = 3) -> dict[str, torch.Tensor]:
    """The kohya file tensors of a rank-2 LoRA (alpha 1) on ``family``'s default targets of a deep copy of ``parts``,
    every up and down matrix random (N(0, 0.2²), seeded), so that each module changes the output."""
    import copy

    from networks.config import NetworkConfig
    from networks.inject import inject

    roots = family.adapter_roots(copy.deepcopy(parts))
    network = inject(NetworkConfig(module="networks.lora", dim=2, alpha=1.0), roots, family.target_classes)
    generator = torch.Generator().manual_seed(seed)
    for p in network.parameters():
        p.data = torch.randn(p.shape, generator=generator) * 0.2
    return network.state_dict_for_file()
