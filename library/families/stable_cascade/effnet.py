"""The EfficientNetV2-S image encoder that makes Stable Cascade's stage C latents, in plain torch.

Stability's ``effnet_encoder.safetensors`` holds ``backbone.*`` (the ``features`` of an EfficientNetV2-S, Tan & Le
2021, arXiv:2104.00298, Table 4) and ``mapper.*`` (a 1x1 convolution 1280 -> 16 then a ``BatchNorm2d`` without affine
weights that normalises the 16 channels): (B, 3, H, W) -> (B, 16, H/32, W/32). The module names here are the ones that
file uses (torchvision's ``efficientnet_v2_s().features`` layout, which the original trainers import), so the file
loads with ``load_state_dict(strict=True)``; torchvision itself is not needed.

Layout of ``backbone``: ``0`` the stem (conv 3x3 stride 2, BN, SiLU), ``1``-``6`` the stages below (each a list of
blocks, ``<stage>.<block>.block.<layer>``), ``7`` the head (conv 1x1 to 1280, BN, SiLU). A fused block is conv kxk
(+ BN SiLU) then, when it expands, a 1x1 projection (+ BN); an MB block is a 1x1 expansion, a depthwise kxk, a
squeeze-excitation (``fc1``, ``fc2``) and a 1x1 projection. Every BN has eps 1e-3; a block adds its input back when
its stride is 1 and its width unchanged (stochastic depth is the identity in evaluation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

BN_EPS = 1e-3
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Stage:
    """One stage: ``fused`` (Fused-MBConv) or MBConv, expansion ratio, kernel, stride, widths in / out, blocks."""

    fused: bool
    expand: int
    kernel: int
    stride: int
    width_in: int
    width_out: int
    blocks: int


V2_S = (
    Stage(True, 1, 3, 1, 24, 24, 2),
    Stage(True, 4, 3, 2, 24, 48, 4),
    Stage(True, 4, 3, 2, 48, 64, 4),
    Stage(False, 4, 3, 2, 64, 128, 6),
    Stage(False, 6, 3, 1, 128, 160, 9),
    Stage(False, 6, 3, 2, 160, 256, 15),
)
HEAD_WIDTH = 1280


class ConvBN(nn.Sequential):
    """``0`` conv (no bias), ``1`` BN, ``2`` SiLU when ``act``: the keys ``<name>.0.weight``, ``<name>.1.*``."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True):
        layers: list[nn.Module] = [
            nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(c_out, eps=BN_EPS),
        ]
        if act:
            layers.append(nn.SiLU())
        super().__init__(*layers)


class SqueezeExcite(nn.Module):
    """``x * sigmoid(fc2(silu(fc1(mean over h, w of x))))`` with 1x1 convolutions ``fc1`` / ``fc2``."""

    def __init__(self, width: int, squeeze: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(width, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, width, 1)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.fc2(nn.functional.silu(self.fc1(x.mean(dim=(2, 3), keepdim=True))))
        return x * torch.sigmoid(scale)


class Block(nn.Module):
    """One Fused-MBConv or MBConv block (``block`` holds its layers; the residual when shapes allow)."""

    def __init__(self, stage: Stage, width_in: int, stride: int) -> None:
        super().__init__()
        wide = width_in * stage.expand
        k, out = stage.kernel, stage.width_out
        layers: list[nn.Module]
        if stage.fused:
            layers = [ConvBN(width_in, wide, k, stride)] + (
                [ConvBN(wide, out, 1, act=False)] if wide != width_in else []
            )
            if wide == width_in:
                layers = [ConvBN(width_in, out, k, stride)]
        else:
            layers = [ConvBN(width_in, wide, 1)] if wide != width_in else []
            layers += [ConvBN(wide, wide, k, stride, groups=wide), SqueezeExcite(wide, max(1, width_in // 4)),
                       ConvBN(wide, out, 1, act=False)]  # fmt: skip
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and width_in == out

    def forward(self, x: Tensor) -> Tensor:
        y = self.block(x)
        return y + x if self.residual else y


def backbone(stages: Sequence[Stage] = V2_S, head: int = HEAD_WIDTH) -> nn.Sequential:
    """EfficientNetV2 ``features``: stem, the stages, the 1x1 head to ``head`` channels."""
    layers: list[nn.Module] = [ConvBN(3, stages[0].width_in, 3, 2)]
    for stage in stages:
        blocks = [Block(stage, stage.width_in if i == 0 else stage.width_out, stage.stride if i == 0 else 1)
                  for i in range(stage.blocks)]  # fmt: skip
        layers.append(nn.Sequential(*blocks))
    layers.append(ConvBN(stages[-1].width_out, head, 1))
    return nn.Sequential(*layers)


class EfficientNetEncoder(nn.Module):
    """Images in [-1, 1] (B, 3, H, W) -> stage C latents (B, ``latent_channels``, H/32, W/32): the ImageNet
    normalisation (:meth:`encode`), the backbone, the mapper (as Stability's ``EfficientNetEncoder``; ``affine``: the
    mapper's BatchNorm with weight and bias, as Würstchen 2's encoder in ``model_v2_stage_b.pt``)."""

    def __init__(self, latent_channels: int = 16, stages: Sequence[Stage] = V2_S, head: int = HEAD_WIDTH,
                 affine: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.backbone = backbone(stages, head)
        self.mapper = nn.Sequential(nn.Conv2d(head, latent_channels, 1, bias=False),
                                    nn.BatchNorm2d(latent_channels, affine=affine))  # fmt: skip
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """ImageNet-normalised images (B, 3, H, W) -> latents."""
        return self.mapper(self.backbone(x))

    def encode(self, pixels: Tensor) -> Tensor:
        """Images in [-1, 1] -> latents: ``(x + 1) / 2`` normalised with ImageNet's mean and std, as the trainers'
        ``effnet_preprocess``."""
        x = ((pixels + 1) / 2 - self.mean.to(pixels.dtype)) / self.std.to(pixels.dtype)
        return self(x)


def tiny_stages() -> tuple[Stage, ...]:
    """The V2-S stage kinds, strides and residual rules at tiny widths and one or two blocks (tests)."""
    return (Stage(True, 1, 3, 1, 8, 8, 2), Stage(True, 2, 3, 2, 8, 8, 1), Stage(True, 2, 3, 2, 8, 16, 1),
            Stage(False, 2, 3, 2, 16, 16, 1), Stage(False, 2, 3, 1, 16, 16, 2), Stage(False, 2, 3, 2, 16, 24, 1))  # fmt: skip


class MissingEncoder(nn.Module):
    """Stands for the EfficientNet encoder a load was not given (generation needs none): moves and casts like a
    module, and says what to pass when asked for latents."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("placeholder", torch.zeros(1))

    def encode(self, pixels: Tensor) -> Tensor:
        raise ValueError("no EfficientNet encoder loaded: pass --effnet_checkpoint_path effnet_encoder.safetensors "
                         "(Stability's stage C latent encoder)")  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.encode(x)
