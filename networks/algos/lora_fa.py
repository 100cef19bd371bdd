"""LoRA-FA: LoRA whose down projection stays frozen at its random init; only ``up`` is trained.

Zhang et al. 2023, "LoRA-FA: Memory-efficient Low-rank Adaptation for Large Language Models Fine-tuning",
arXiv:2308.03303; sd-scripts ``networks.lora_fa``. Same tensors, ΔW and file layout as LoRA (``lora.py``): the frozen
``lora_down`` is written to the file with ``lora_up`` and ``alpha``, so any LoRA reader loads it.

    ΔW = (alpha / r) · up @ down          down ~ N(0, 2 / (in + r)) frozen (in = input features / channels),
                                          up = 0 trained

The normal init of ``down`` follows the paper as sd-scripts does (``in`` is ``in_channels`` for a convolution, not
in·kh·kw); ``frozen_params`` tells the network to give ``lora_down`` no gradient and no optimizer state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from . import lora
from .base import Algorithm


def init_params(
    base_shape: tuple[int, ...], rank: int, *, device: Any = None, dtype: Any = None, **_: Any
) -> dict[str, Tensor]:
    """LoRA tensors with ``lora_down`` drawn from N(0, 2 / (in + r)) and ``lora_up`` zeros; ΔW starts at 0."""
    out_dim, in_dim, *kernel = base_shape
    down = torch.empty((rank, in_dim, *kernel), device=device, dtype=dtype)
    torch.nn.init.normal_(down, std=math.sqrt(2.0 / (in_dim + rank)))
    up = torch.zeros((out_dim, rank, *[1] * len(kernel)), device=device, dtype=dtype)
    return {"lora_down": down, "lora_up": up}


ALGORITHM = Algorithm(
    name="lora_fa",
    file_keys={"lora_down": "lora_down.weight", "lora_up": "lora_up.weight"},
    init_params=init_params,
    delta_weight=lora.delta_weight,
    rank=lora.rank,
    options=lambda params: {},
    project_down=lora.project_down,
    project_up=lora.project_up,
    factors=lora.factors,
    file_format="lora",
    frozen_params=("lora_down",),
)
