"""``--network_module networks.lora_hunyuan_image``: sd-scripts' HunyuanImage 2.1 LoRA
(``networks/lora_hunyuan_image.py``) as rules for our adapter machinery (``ModelFamily.adapter_rules``).

Names are sd-scripts': ``lora_unet_`` + the module's path in Tencent's ``HYImageDiffusionTransformer``
(``double_blocks.0.img_attn_qkv``, ``single_blocks.3.linear1``) with dots as underscores; the family's
``adapter_roots`` give them (``keys.py``: diffusers leaves under Tencent's fused modules).

* **Targets.** Every Linear inside the DiT's ``MMDoubleStreamBlock`` / ``MMSingleStreamBlock`` (diffusers'
  ``HunyuanImageTransformerBlock`` / ``HunyuanImageSingleTransformerBlock``): ``img_mod.linear``, ``img_attn_qkv``,
  ``img_attn_proj``, ``img_mlp.fc1``, ``img_mlp.fc2``, the same for ``txt_``, ``single_blocks.N.linear1``,
  ``linear2``, ``modulation.linear``. No text-encoder adapters (sd-scripts: "only DIT is supported now").
* **Ranks.** ``network_reg_dims`` (``regex=dim,...``; the first regex that ``re.search``-es the kohya name, alpha
  ``--network_alpha``), else ``--network_dim``; rank 0 skips the module. ``network_reg_lrs`` likewise gives modules
  their own optimizer group.
* **split_qkv.** ``img_attn_qkv`` / ``txt_attn_qkv`` (q, k, v) and ``linear1`` (q, k, v, mlp) get one LoRA of rank r
  per part, held (and saved) as one LoRA of rank k·r over the fused weight, as for FLUX (see
  ``library/families/flux/lora.py``).
* ``conv_dim``: no convolution in the blocks (a warning, as sd-scripts builds none). ``ggpo_beta`` / ``ggpo_sigma``:
  refused (LoRA-GGPO needs norm hooks around each optimizer step that our run layer does not call). LoRA+
  (``loraplus_*``), ``rank_dropout``, ``module_dropout``, ``verbose``: the common keys.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ..adapters import (
    PLAIN_LORA_NOT_READ,
    ArgSpec,
    LoraModuleArgs,
    NetworkSettings,
    Preset,
    Target,
    first_match,
    parse_reg_dims,
    parse_reg_lrs,
)

if TYPE_CHECKING:
    from ..base import TargetClasses

logger = logging.getLogger("networks.config")

MODULE = "networks.lora_hunyuan_image"
_BLOCK = re.compile(r"lora_unet_(double|single)_blocks_(\d+)_")


@dataclass(frozen=True)
class HunyuanLoraArgs(LoraModuleArgs):
    """The ``--network_args`` networks.lora_hunyuan_image reads."""

    reg_dims: tuple[tuple[str, int], ...] = ()


Args = HunyuanLoraArgs


def refuse_ggpo(value: str) -> float:
    raise ValueError("LoRA-GGPO is not supported: its perturbation needs per-module weight and gradient norms "
                     "refreshed around every optimizer step (sd-scripts' update_norms / update_grad_norms hooks in its "
                     "training loop), which our run layer does not call; drop ggpo_beta / ggpo_sigma")  # fmt: skip


ARGS: dict[str, ArgSpec] = {
    "split_qkv": (None, "split_qkv"),
    "verbose": (None, "verbose"),
    "network_reg_dims": (parse_reg_dims, "reg_dims"),
    "network_reg_lrs": (parse_reg_lrs, "reg_lrs"),
    "ggpo_beta": (refuse_ggpo, None),
    "ggpo_sigma": (refuse_ggpo, None),
}
DESCRIPTION = "sd-scripts' HunyuanImage 2.1 LoRA"
HINT = ("HunyuanImage ranks are set by network_reg_dims, other algorithms with --network_module lycoris.kohya "
        "algo=...")  # fmt: skip
NOT_READ = PLAIN_LORA_NOT_READ
IGNORED_ELSEWHERE: dict[str, str] = {}
CONVERSION = None


def args_of(cfg: NetworkSettings) -> HunyuanLoraArgs:
    args = cfg.module_args
    return args if isinstance(args, HunyuanLoraArgs) else HunyuanLoraArgs()


def wants_conv(cfg: NetworkSettings) -> bool:
    return False


def validate(cfg: NetworkSettings, errors: list[str]) -> None:
    if cfg.conv_dim:
        logger.warning("--network_args conv_dim=%s: HunyuanImage's blocks have no convolution, so no module takes it "
                       "(as in sd-scripts' lora_hunyuan_image)", cfg.conv_dim)  # fmt: skip


def text_cache_problems(cfg: NetworkSettings) -> list[str]:
    return []


def preset(cfg: NetworkSettings, classes: TargetClasses) -> Preset:
    """The DiT's double / single block classes; no text-encoder classes."""
    return Preset(tuple(classes.transformer), (), unet_name_kind="linear", te_by_prefix={})


def block_of(name: str) -> tuple[str, int] | None:
    m = _BLOCK.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def select(cfg: NetworkSettings, targets: Sequence[Target]) -> list[Target]:
    return list(targets)


def block_counts(targets: Sequence[Target], denoiser: nn.Module | None = None) -> dict[str, int]:
    return {}


def block_masks(cfg: NetworkSettings, counts: dict[str, int]) -> dict[str, tuple[bool, ...] | None]:
    return {}


def rank_for(cfg: NetworkSettings, name: str, masks: dict) -> tuple[int, float, str]:
    args = args_of(cfg)
    reg = first_match(args.reg_dims, name)
    if reg is not None:
        regex, dim = args.reg_dims[reg]
        return dim, cfg.alpha, f"network_reg_dims {regex}"
    return cfg.dim, cfg.alpha, "--network_dim"


def split_rows(cfg: NetworkSettings, target: Target) -> tuple[int, ...] | None:
    """The rows of each part ``split_qkv`` gives its own LoRA: double blocks' ``*_attn_qkv`` and single blocks'
    ``linear1``, as sd-scripts splits them."""
    if not args_of(cfg).split_qkv or target.fused is None:
        return None
    block = block_of(target.name)
    if block is None or not ((block[0] == "double" and "qkv" in target.name) or
                             (block[0] == "single" and "linear1" in target.name)):  # fmt: skip
        return None
    return tuple(stop - start for _, start, stop, _ in target.module.segments)


def reg_lr_index(cfg: NetworkSettings, name: str) -> int | None:
    return first_match(args_of(cfg).reg_lrs, name)
