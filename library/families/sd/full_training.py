"""SD 1.x / 2.x and SDXL full fine-tuning rules (``SDFamily.full_training``, ``SDXLFamily.full_training``), as
sd-scripts' fine_tune.py / train_db.py and sdxl_train.py read them.

* SD 1.x / 2.x: one text encoder at ``--learning_rate_te`` (default ``--learning_rate``; 0 = it stays frozen).
* SDXL: ``--learning_rate_te1`` / ``--learning_rate_te2`` per encoder (default ``--learning_rate``; 0 = that encoder
  stays frozen); ``--learning_rate 0`` leaves the UNet out of training (sd-scripts' "train the text encoders only");
  ``--block_lr``: 23 comma-separated learning rates, one per UNet block in sd-scripts' order (time/label embeddings,
  ``input_blocks.*``, ``middle_block.*``, ``output_blocks.*``, ``out``; 0 = freeze the block), each block its own
  optimizer group.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..full_training import PlainFullTraining, PlainRules, lr_problems, raise_if, text_cache_problems
from .unet_keys import block_map, diffusers_to_ldm

logger = logging.getLogger("sdtrain")


class SDFullTraining(PlainFullTraining):
    """SD 1.x / 2.x: ``--learning_rate_te``."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("SD full fine-tuning", "sd-scripts' fine_tune.py / train_db.py")
        group.add_argument("--learning_rate_te", type=float, default=None,
                           help="text-encoder lr (default --learning_rate)")  # fmt: skip

    def read(self, args: argparse.Namespace, train_text_encoder: bool) -> PlainRules:
        lrs = (getattr(args, "learning_rate_te", None),)
        raise_if(lr_problems(lrs) + text_cache_problems(args, train_text_encoder))
        return PlainRules(text_encoder_lrs=lrs if train_text_encoder else None)


@dataclass(frozen=True)
class SDXLRules(PlainRules):
    """sdxl_train.py's rules: per-encoder learning rates, ``--block_lr``."""

    block_lr: tuple[float, ...] | None = None

    def freeze(self, denoiser: nn.Module) -> None:
        """``--block_lr``: the blocks at learning rate 0 stay frozen (``ConfigError`` for a count that does not
        fit the UNet)."""
        if self.block_lr is None or not self.train_denoiser:
            return
        expected = lr_block_count(denoiser.config)
        if len(self.block_lr) != expected:
            raise_if([f"--block_lr has {len(self.block_lr)} values; this UNet has {expected} blocks"])
        for name, p in denoiser.named_parameters():
            if self.block_lr[lr_block_index(diffusers_to_ldm(name, denoiser.config), denoiser.config)] == 0:
                p.requires_grad_(False)

    def denoiser_groups(self, denoiser: nn.Module, lr: float) -> list[dict] | None:
        """One group per ``--block_lr`` block (``unet_block<i>``), in block order; None without the flag."""
        if self.block_lr is None:
            return None
        blocks: dict[int, list[nn.Parameter]] = {}
        for name, p in denoiser.named_parameters():
            if p.requires_grad:
                i = lr_block_index(diffusers_to_ldm(name, denoiser.config), denoiser.config)
                blocks.setdefault(i, []).append(p)
        return [{"params": params, "lr": self.block_lr[i], "name": f"unet_block{i:02d}"}
                for i, params in sorted(blocks.items())]  # fmt: skip


class SDXLFullTraining(PlainFullTraining):
    """SDXL: ``--learning_rate_te1 / te2``, ``--block_lr``, ``--learning_rate 0`` = the UNet stays frozen."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("SDXL full fine-tuning", "sd-scripts' sdxl_train.py")
        group.add_argument("--learning_rate_te1", type=float, default=None,
                           help="text encoder 1 lr; 0 = do not train it")  # fmt: skip
        group.add_argument("--learning_rate_te2", type=float, default=None,
                           help="text encoder 2 lr; 0 = do not train it")  # fmt: skip
        group.add_argument("--block_lr", type=str, default=None, help="23 comma-separated UNet block lrs (0 = freeze)")

    def read(self, args: argparse.Namespace, train_text_encoder: bool) -> SDXLRules:
        problems: list[str] = []
        lrs = tuple(args.learning_rate if lr is None else lr for lr in (args.learning_rate_te1, args.learning_rate_te2))
        train_unet = args.learning_rate != 0
        if not train_unet and not (train_text_encoder and any(lrs)):
            problems.append("--learning_rate 0 leaves the UNet out of training and no text encoder is trained, "
                            "so this run trains nothing; add --train_text_encoder (with a non-zero "
                            "--learning_rate_te1 / --learning_rate_te2) to train the text encoders only")  # fmt: skip
        elif not train_unet and args.block_lr:
            logger.warning("--block_lr is ignored: --learning_rate 0 leaves the UNet out of training")
        problems += lr_problems(lrs) + text_cache_problems(args, train_text_encoder)
        block_lr = _block_lrs(args.block_lr, problems)
        raise_if(problems)
        return SDXLRules(lrs if train_text_encoder else None, train_unet, block_lr)


def _block_lrs(text: str | None, problems: list[str]) -> tuple[float, ...] | None:
    if not text:
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        problems.append(f"--block_lr {text!r}: expected comma-separated numbers")
        return None
    if any(v < 0 for v in values):
        problems.append(f"--block_lr {text!r}: learning rates must be >= 0")
    return values


def lr_block_count(config: Any) -> int:
    """Number of ``--block_lr`` blocks of a UNet: embeddings, input blocks, 3 middle, output blocks, out (SDXL: 23)."""
    names = {v.split(".")[0] + "." + v.split(".")[1] for v, _ in block_map(config).values() if "_blocks." in v}
    n_in = len({n for n in names if n.startswith("input_blocks.")})
    n_out = len({n for n in names if n.startswith("output_blocks.")})
    return 1 + n_in + 3 + n_out + 1


def lr_block_index(ldm_name: str, config: Any) -> int:
    """sd-scripts' block index of a UNet parameter, from its original (ldm/sgm) name."""
    n = lr_block_count(config)
    n_in = (n - 5) // 2
    head, _, rest = ldm_name.partition(".")
    if head in ("time_embed", "label_emb"):
        return 0
    if head == "input_blocks":
        return 1 + int(rest.split(".")[0])
    if head == "middle_block":
        return 1 + n_in + int(rest.split(".")[0])
    if head == "output_blocks":
        return 1 + n_in + 3 + int(rest.split(".")[0])
    if head == "out":
        return n - 1
    raise ValueError(f"UNet parameter {ldm_name!r} belongs to no --block_lr block")
