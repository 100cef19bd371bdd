"""DyLoRA: a LoRA trained so that its first k ranks are a usable LoRA for every k (a multiple of the block size).

Valipour et al. 2023, "DyLoRA: Parameter-Efficient Tuning of Pre-trained Models using Dynamic Search-Free Low-Rank
Adaptation", arXiv:2210.07558. Two variants exist in the tools people use, and both are here:

* sd-scripts ``networks.dylora`` (block size ``unit``, default 1), the ``"kohya"`` style;
* LyCORIS ``algo=dylora`` (block size ``block_size``, default 4), the ``"lycoris"`` style.

Storage. The rank ``r`` is split into ``n = r / u`` blocks of ``u`` rows; each block is its own tensor, so a step that
trains one block leaves every other block without a gradient (the optimizer skips it: no moment update, no weight
decay), as both references do with their per-block parameter lists::

    lora_down_j (u, in[, kh, kw])     lora_up_j (out, u[, 1, 1])     j = 0 .. n-1

Files hold one plain LoRA (docs/formats.md "DyLoRA"): ``lora_down = cat_j lora_down_j`` (r, in[, kh, kw]),
``lora_up = cat_j lora_up_j`` (out, r[, 1, 1]) and ``alpha``; any LoRA reader (diffusers, ComfyUI) loads them.

Outside training (sampling, merge, every tool) the module is that LoRA: ΔW = (alpha / r) · up @ down.
One training step draws the block ``j`` that trains (uniformly, from torch's RNG; see ``draw_block``); only its rows
get gradients (the others are detached):

    kohya:   b = randint(0, r - 1) - (b mod u), j = b / u; all r ranks are in the product;
             Δy = alpha / r · sqrt(r / (b + u)) · up(down(x))
    lycoris: j = randint(0, n - 1); the first (j + 1)·u ranks are in the product (up[:, :(j+1)u], down[:(j+1)u]);
             Δy = alpha / (j + 1) · up(down(x))           (LyCORIS divides by the number of blocks, not of ranks)

Init as LoRA: ``down`` Kaiming-uniform (a = √5, the same fan-in per block as for the whole tensor), ``up`` zeros.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from . import lora
from .base import Algorithm

FILE_KEYS = {"lora_down": "lora_down.weight", "lora_up": "lora_up.weight"}
STYLES = ("kohya", "lycoris")


def _names(params: Mapping[str, Any], part: str) -> list[str]:
    count = sum(1 for k in params if k.startswith(part + "_"))
    return [f"{part}_{j}" for j in range(count)]


def block_count(params: Mapping[str, Tensor]) -> int:
    return len(_names(params, "lora_down"))


def block_size(params: Mapping[str, Tensor]) -> int:
    return int(params["lora_down_0"].shape[0])


def split(down: Tensor, up: Tensor, block: int) -> dict[str, Tensor]:
    """Plain LoRA tensors (down (r, ...), up (out, r, ...)) -> per-block tensors of ``block`` rows each."""
    r = down.shape[0]
    if block < 1 or r % block:
        raise ValueError(f"DyLoRA: rank {r} is not a multiple of the block size {block}")
    if up.dim() == 2 and down.dim() == 4:  # LyCORIS writes a conv module's lora_up as (out, r)
        up = up.reshape(*up.shape, 1, 1)
    params = {}
    for j in range(r // block):
        params[f"lora_down_{j}"] = down[j * block : (j + 1) * block].clone()
        params[f"lora_up_{j}"] = up[:, j * block : (j + 1) * block].clone()
    return params


def join(params: Mapping[str, Tensor], blocks: int | None = None) -> tuple[Tensor, Tensor]:
    """(down (k, in[, kh, kw]), up (out, k[, 1, 1])) of the first ``blocks`` blocks (all by default)."""
    downs = [params[k] for k in _names(params, "lora_down")][:blocks]
    ups = [params[k] for k in _names(params, "lora_up")][:blocks]
    return torch.cat(downs, dim=0), torch.cat(ups, dim=1)


def init_params(
    base_shape: tuple[int, ...], rank: int, *, block: int = 1, device: Any = None, dtype: Any = None, **_: Any
) -> dict[str, Tensor]:
    """Fresh DyLoRA blocks for a base weight of ``base_shape``; ΔW starts at 0. ``rank`` must be a multiple of
    ``block``."""
    p = lora.init_params(base_shape, rank, device=device, dtype=dtype)
    return split(p["lora_down"], p["lora_up"], block)


def _as_lora(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    down, up = join(params)
    return {"lora_down": down, "lora_up": up}


def delta_weight(params: Mapping[str, Tensor], scale: float, shape: tuple[int, ...] | None = None, **_: Any) -> Tensor:
    """ΔW = scale · up @ down over all blocks (the file's LoRA), in the base shape."""
    return lora.delta_weight(_as_lora(params), scale, shape)


def factors(params: Mapping[str, Tensor], scale: float) -> tuple[Tensor, Tensor]:
    return lora.factors(_as_lora(params), scale)


def project_down(x: Tensor, params: Mapping[str, Tensor], conv: dict | None) -> Tensor:
    return lora.project_down(x, {"lora_down": join(params)[0]}, conv)


def project_up(h: Tensor, params: Mapping[str, Tensor]) -> Tensor:
    return lora.project_up(h, {"lora_up": join(params)[1]})


def rank(params: Mapping[str, Tensor]) -> int:
    return sum(int(params[k].shape[0]) for k in _names(params, "lora_down"))


def options(params: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"block": block_size(params)}


def to_file(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The plain LoRA file tensors (suffix -> tensor)."""
    down, up = join(params)
    return {FILE_KEYS["lora_down"]: down, FILE_KEYS["lora_up"]: up}


def from_file(tensors: Mapping[str, Tensor], *, block: int = 1, **_: Any) -> dict[str, Tensor]:
    """Per-block tensors from a LoRA file's ``lora_down.weight`` / ``lora_up.weight`` (``ValueError`` when the rank
    is not a multiple of ``block``)."""
    return split(tensors[FILE_KEYS["lora_down"]], tensors[FILE_KEYS["lora_up"]], block)


def cut(down: Tensor, up: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """The first ``rank`` ranks of a DyLoRA file's LoRA: (down[:rank], up[:, :rank]), i.e. ``join`` of the first
    rank / u blocks. A module whose rank is at most ``rank`` is returned whole (as sd-scripts' split tool)."""
    if down.shape[0] <= rank:
        return down, up
    return down[:rank].contiguous(), up[:, :rank].contiguous()


def draw_block(style: str, rank: int, block: int, generator: torch.Generator | None = None) -> int:
    """The block ``j`` one training step trains, uniform over the r / u blocks, drawn the way the reference does but
    from torch's RNG: kohya ``b = randint(0, r - 1)`` floored to a multiple of ``u``; lycoris ``randint(0, n - 1)``.
    (The references use Python's ``random``; torch's CPU RNG is what gradient checkpointing saves and replays, so a
    recomputed forward trains the block the forward drew.)"""
    if style == "kohya":
        b = int(torch.randint(rank, (), generator=generator))
        return (b - b % block) // block
    return int(torch.randint(rank // block, (), generator=generator))


def step_factors(params: Mapping[str, Tensor], j: int, style: str, alpha: float | Tensor) -> tuple[Tensor, Tensor, Any]:
    """(down, up, scale) for a training step that trains block ``j``: every other block is detached (no gradient);
    kohya keeps all blocks in the product, lycoris only blocks 0..j. See the module docstring for the scales."""
    downs = [params[k] for k in _names(params, "lora_down")]
    ups = [params[k] for k in _names(params, "lora_up")]
    used = len(downs) if style == "kohya" else j + 1
    down = torch.cat([d if i == j else d.detach() for i, d in enumerate(downs[:used])], dim=0)
    up = torch.cat([u if i == j else u.detach() for i, u in enumerate(ups[:used])], dim=1)
    if style == "kohya":
        r, u = rank(params), downs[0].shape[0]
        scale = alpha / r * math.sqrt(r / (j * u + u))
    else:
        scale = alpha / (j + 1)
    return down, up, scale


ALGORITHM = Algorithm(
    name="dylora",
    file_keys=FILE_KEYS,
    init_params=init_params,
    delta_weight=delta_weight,
    rank=rank,
    options=options,
    plus_params=("lora_up",),
    project_down=project_down,
    project_up=project_up,
    factors=factors,
    file_format="lora",
    to_file=to_file,
    from_file=from_file,
    block_params=True,
    product_terms=2,
)
