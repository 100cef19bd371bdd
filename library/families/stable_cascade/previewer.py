"""Stability's stage C Previewer (``previewer.safetensors``): a small convolutional net that turns 16-channel stage C
latents into an RGB preview at 8x their size, without stage B / A. The module layout (``blocks.<i>``) is that of the
stable-cascade branch's ``Previewer`` and Stability's file, so the official weights load strict.

Samples during training (``--previewer_checkpoint_path``, as the branch): stage C is sampled
(``sampling.sample_stage_c``), then this net makes the image that is saved; its output is clamped to [0, 1].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from library.files.weights import load_state_dict


class Previewer(nn.Module):
    """16 -> ``c_hidden`` channels, three 2x transposed-conv upsamplings (each followed by a 3x3 conv; GELU and
    BatchNorm after every conv but the last) -> RGB."""

    def __init__(self, c_in: int = 16, c_hidden: int = 512, c_out: int = 3) -> None:
        super().__init__()
        widths = [c_hidden, c_hidden // 2, c_hidden // 4, c_hidden // 4]
        layers: list[nn.Module] = [*_act(nn.Conv2d(c_in, c_hidden, kernel_size=1), c_hidden)]
        layers += _act(nn.Conv2d(c_hidden, c_hidden, kernel_size=3, padding=1), c_hidden)
        for a, b in zip(widths, widths[1:]):
            layers += _act(nn.ConvTranspose2d(a, b, kernel_size=2, stride=2), b)
            layers += _act(nn.Conv2d(b, b, kernel_size=3, padding=1), b)
        layers.append(nn.Conv2d(widths[-1], c_out, kernel_size=1))
        self.blocks = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)


def _act(conv: nn.Module, channels: int) -> list[nn.Module]:
    return [conv, nn.GELU(), nn.BatchNorm2d(channels)]


def load_previewer(path: str | Path, device: Any = "cpu", dtype: torch.dtype = torch.float32) -> Previewer:
    """The Previewer of ``path`` (``previewer.safetensors``; a pickle's ``state_dict`` wrapper is unwrapped as the
    branch does), its widths read from the file, in eval mode."""
    state = load_state_dict(path)[0]
    first = state.get("blocks.0.weight")
    if first is None or "blocks.24.weight" not in state:
        raise ValueError(f"--previewer_checkpoint_path {path}: not a Stable Cascade previewer (no blocks.0.weight; "
                         "use Stability's previewer.safetensors)")  # fmt: skip
    model = Previewer(c_in=first.shape[1], c_hidden=first.shape[0], c_out=state["blocks.24.weight"].shape[0])
    model.load_state_dict(state, strict=True)
    return model.to(device, dtype).eval()


@torch.no_grad()
def preview(previewer: Previewer, latents: Tensor) -> Tensor:
    """RGB in [0, 1], (B, 3, 8h, 8w), from stage C latents (B, 16, h, w)."""
    param = next(previewer.parameters())
    return previewer(latents.to(param.device, param.dtype)).clamp(0, 1)
