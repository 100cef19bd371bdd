"""Z-Image's DiT: diffusers' ``ZImageTransformer2DModel`` (musubi-tuner's ``zimage_model`` has the same module
names), its configs, its call, and the key map of the original / ComfyUI single files.

The released model (Tongyi-MAI/Z-Image-Turbo and Z-Image, the same architecture): 30 single-stream blocks
(``layers``) after 2 noise and 2 context refiner blocks, width 3840 (30 heads of 128), caption width 2560 (Qwen3-4B),
16 latent channels in 2x2 patches. The original files (and ComfyUI's ``z_image_turbo_bf16.safetensors``) name the
attention ``qkv`` (fused), ``out``, ``q_norm`` / ``k_norm`` and the embedder / final layer ``x_embedder`` /
``final_layer``; diffusers splits and renames them (``convert_z_image_transformer_checkpoint_to_diffusers``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

RELEASED = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
                n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
                t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512))  # fmt: skip
# the tiny test DiT: the released layout at width 32 (2 heads of 16: RoPE axes 4 + 6 + 6), caption width 16 (the tiny
# Qwen3), 2 main blocks and 1 refiner of each kind
TINY = dict(RELEASED, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
            axes_dims=(4, 6, 6), axes_lens=(256, 64, 64))  # fmt: skip
# the sampling schedule (musubi-tuner's zimage_config: a static shift 3.0 over 1000 training steps)
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False,
             "prediction_type": "flow_matching"}  # fmt: skip
COMFY_PREFIX = "model.diffusion_model."
# original name piece -> diffusers' (convert_z_image_transformer_checkpoint_to_diffusers' rename table)
RENAMES = (("final_layer.", "all_final_layer.2-1."), ("x_embedder.", "all_x_embedder.2-1."),
           (".attention.out.", ".attention.to_out.0."), (".attention.k_norm.", ".attention.norm_k."),
           (".attention.q_norm.", ".attention.norm_q."))  # fmt: skip
QKV = ".attention.qkv.weight"


def build(config: Mapping[str, Any]) -> nn.Module:
    from diffusers import ZImageTransformer2DModel

    cfg = dict(config)
    for key in ("all_patch_size", "all_f_patch_size", "axes_dims", "axes_lens"):
        cfg[key] = tuple(cfg[key])
    return ZImageTransformer2DModel(**cfg)


def factory(config: Mapping[str, Any]) -> Callable[[], nn.Module]:
    return lambda: build(config)


def is_original(keys: Any) -> bool:
    """The original / ComfyUI names (``x_embedder`` / fused ``qkv``), bare or under ``model.diffusion_model.``."""
    return any(k.endswith(("x_embedder.weight", QKV)) and "all_x_embedder" not in k for k in keys)


def diffusers_name(key: str) -> str:
    """One original key's diffusers name (``qkv`` left for :class:`DiffusersView` to split)."""
    key = key[len(COMFY_PREFIX) :] if key.startswith(COMFY_PREFIX) else key
    if key.startswith("all_"):
        return key
    for old, new in RENAMES:
        key = key.replace(old, new)
    return key


def original_name(key: str) -> str:
    """A diffusers key's original name (``to_q`` / ``to_k`` / ``to_v`` are written fused: :func:`to_original`)."""
    for old, new in RENAMES:
        key = key.replace(new, old)
    return key


class DiffusersView(Mapping):
    """An original / ComfyUI file read lazily in diffusers' names: renamed, ``qkv`` split in three along dim 0,
    the ``norm_final.weight`` the converter drops left out."""

    def __init__(self, source: Mapping[str, Any]) -> None:
        self.source = source
        self.where: dict[str, tuple[str, int | None]] = {}
        for key in source.keys():
            name = diffusers_name(key)
            if name == "norm_final.weight":
                continue
            if name.endswith(QKV):
                for i, part in enumerate(("to_q", "to_k", "to_v")):
                    self.where[name.replace("qkv", part)] = (key, i)
            else:
                self.where[name] = (key, None)

    def __getitem__(self, key: str) -> Tensor:
        file_key, chunk = self.where[key]
        value = self.source[file_key]
        return value if chunk is None else value.chunk(3, dim=0)[chunk]

    def shape(self, key: str) -> torch.Size:
        file_key, chunk = self.where[key]
        source = self.source
        shape = source.shape(file_key) if callable(getattr(source, "shape", None)) else source[file_key].shape
        shape = tuple(shape)
        return torch.Size(shape if chunk is None else (shape[0] // 3, *shape[1:]))

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def to_original(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A diffusers state dict in the original / ComfyUI names (``to_q`` / ``to_k`` / ``to_v`` fused into ``qkv``)."""
    out = {}
    for key, value in state.items():
        if key.endswith(".attention.to_q.weight"):
            stem = key[: -len("to_q.weight")]
            out[original_name(stem) + "qkv.weight"] = torch.cat([state[stem + p + ".weight"] for p in ("to_q", "to_k",
                                                                                                      "to_v")])  # fmt: skip
        elif not key.endswith((".attention.to_k.weight", ".attention.to_v.weight")):
            out[original_name(key)] = value
    return out


def config_from_shapes(state: Mapping[str, Any], shape, candidates: list[dict]) -> dict | None:
    """The DiT's config from its weights: width and channels (``all_x_embedder``), depths, head width (the q norm's
    length), caption width (``cap_embedder.1``); the RoPE axes of a candidate with that head width."""
    keys = list(state.keys())
    needed = ("all_x_embedder.2-1.weight", "cap_embedder.1.weight", "layers.0.attention.norm_q.weight")
    if not candidates or not all(k in keys for k in needed):
        return None
    base = candidates[0]
    dim, patch_in = shape("all_x_embedder.2-1.weight")
    head = shape("layers.0.attention.norm_q.weight")[0]
    axes = next((tuple(c["axes_dims"]) for c in candidates if sum(c["axes_dims"]) == head), None)
    if axes is None:
        return None

    def depth(prefix: str) -> int:
        return 1 + max((int(k.split(".")[1]) for k in keys if k.startswith(prefix)), default=-1)

    kv = shape("layers.0.attention.to_k.weight")[0] // head if "layers.0.attention.to_k.weight" in keys else dim // head
    return dict(base, dim=dim, in_channels=patch_in // 4, n_layers=depth("layers."),
                n_refiner_layers=depth("noise_refiner."), n_heads=dim // head, n_kv_heads=kv,
                cap_feat_dim=shape("cap_embedder.1.weight")[1], axes_dims=axes)  # fmt: skip


def forward(denoiser: nn.Module, noisy: Tensor, tau: Tensor, states: Tensor, mask: Tensor | None) -> Tensor:
    """The DiT's output x0 − ε direction (B, C, H, W) at model time ``tau`` (B,) (1 at the clean image) over the
    caption ``states`` (B, L, D) with ``mask`` (B, L) (None: every row real): each sample's real caption rows are given
    apart (diffusers' list input, musubi-tuner's per-sample caption lengths)."""
    b = noisy.shape[0]
    lengths = [states.shape[1]] * b if mask is None else mask.to(torch.long).sum(dim=1).tolist()
    caps = [states[i, : max(int(n), 1)] for i, n in enumerate(lengths)]
    xs = list(noisy.unsqueeze(2).unbind(0))
    out = denoiser(xs, tau.to(noisy.dtype), caps, return_dict=False)[0]
    return torch.stack(list(out), dim=0).squeeze(2)
