"""sd-scripts' ``networks.oft`` forward pass as a reader of ``oft_unet_…`` files (the demo's check of such files).

No installable package reads sd-scripts' OFT format (lycoris-lora 4.1.3 has no ``oft_unet_`` prefix, diffusers none),
so this module re-states what sd-scripts' ``OFTModule.forward`` does (networks/oft.py, git 48d368fa) and applies it
to a model by forward patching, the way sd-scripts applies it. It is kept apart from ``networks.algos.oft`` on
purpose: it is the reference our algorithm is compared with, so it must not call it.

sd-scripts, per module: n = ``oft_blocks.shape[0]`` blocks of size b = out / n, c = alpha · out,
Q = B − Bᵀ, Q ← Q · (min(‖Q‖, c) + 1e-8) / (‖Q‖ + 1e-8), R = (I + Q)(I − Q)⁻¹, R_m = m · (R − I) + I,
W' = einsum("k n m, k n ... -> k m ...", R_m, W viewed as (n, b, ...)), y = op(x, W', bias).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def _rotation(blocks: torch.Tensor, alpha: float, out_dim: int, multiplier: float) -> torch.Tensor:
    constraint = alpha * out_dim
    q = blocks - blocks.transpose(1, 2)
    norm_q = torch.norm(q.flatten())
    new_norm_q = torch.clamp(norm_q, max=constraint)
    q = q * ((new_norm_q + 1e-8) / (norm_q + 1e-8))
    eye = torch.eye(blocks.shape[1]).unsqueeze(0).repeat(blocks.shape[0], 1, 1)
    r = torch.matmul(eye + q, (eye - q).float().inverse())
    return multiplier * (r - eye) + eye


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    org = self._sd_scripts_oft
    w = self.weight.to(torch.float32)
    n, b, _ = org["blocks"].shape
    r = _rotation(org["blocks"], org["alpha"], w.shape[0], org["multiplier"]).to(torch.float32)
    rw = torch.einsum("k n m, k n ... -> k m ...", r, w.reshape(n, b, *w.shape[1:])).reshape(w.shape)
    if isinstance(self, nn.Conv2d):
        return F.conv2d(x, rw.to(x.dtype), self.bias, self.stride, self.padding, self.dilation, self.groups)
    return F.linear(x, rw.to(x.dtype), self.bias)


def apply_sd_scripts_oft(
    path: str | Path, roots: Sequence[tuple[str, nn.Module, Callable]], multiplier: float = 1.0
) -> int:
    """Patch the UNet modules of ``roots`` (a family's ``adapter_roots``: UNet first) named in the ``oft_unet_…``
    file ``path`` with sd-scripts' OFT forward; returns how many modules were patched. ``ValueError`` naming the key
    when a module of the file is not in the model."""
    from library.files.weights import load_state_dict

    state_dict, _ = load_state_dict(path)
    _, unet, rename = roots[0][:3]
    modules = {}
    for p, m in unet.named_modules():
        if p and isinstance(m, (nn.Linear, nn.Conv2d)):
            try:
                modules["oft_unet_" + rename(p).replace(".", "_")] = m
            except KeyError:
                continue
    count = 0
    for key, tensor in state_dict.items():
        name, _, suffix = key.partition(".")
        if suffix != "oft_blocks":
            continue
        if name not in modules:
            raise ValueError(f"{path}: {key}: no such module in this UNet (sd-scripts names: oft_unet_<path>)")
        module = modules[name]
        alpha = float(state_dict[f"{name}.alpha"])
        module._sd_scripts_oft = {"blocks": tensor.float(), "alpha": alpha, "multiplier": multiplier}
        module.forward = types.MethodType(_forward, module)
        count += 1
    return count
