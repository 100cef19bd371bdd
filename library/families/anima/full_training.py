"""anima_train.py's own flags and rules (sd-scripts' ``anima_train.py`` with ``anima_train_utils.
get_anima_param_groups``): the DiT's parameters in six optimizer groups, each at its own learning rate
(``--self_attn_lr --cross_attn_lr --mlp_lr --mod_lr --llm_adapter_lr``; None: ``--learning_rate``; 0: frozen). A
parameter's group is decided on its sd-scripts name, in sd-scripts' order: ``llm_adapter`` in it -> adapter;
``.self_attn`` -> self-attention; ``.cross_attn`` -> cross-attention; ``.mlp`` -> MLP; ``.adaln_modulation`` ->
modulation (the blocks' and the final layer's); else base (embedders, time-embedding norm, final linear). The model
is written as sd-scripts writes it: the DiT alone, every key under ``net.`` (``family.save``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..full_training import PlainRules, raise_if
from ..options import add_once
from . import keys as K

GROUPS = ("base", "self_attn", "cross_attn", "mlp", "mod", "llm_adapter")
FLAGS = {"self_attn": "self_attn_lr", "cross_attn": "cross_attn_lr", "mlp": "mlp_lr", "mod": "mod_lr",
         "llm_adapter": "llm_adapter_lr"}  # fmt: skip


def sd_name(name: str) -> str:
    """A diffusers parameter name -> sd-scripts' (``keys.module_to_sd`` on its module)."""
    module, _, leaf = name.rpartition(".")
    return f"{K.module_to_sd(module)}.{leaf}"


def group_of(name: str) -> str:
    """sd-scripts' ``get_anima_param_groups`` rule on a diffusers parameter name (module docstring)."""
    sd = sd_name(name)
    if "llm_adapter" in sd:
        return "llm_adapter"
    for group, marker in (("self_attn", ".self_attn"), ("cross_attn", ".cross_attn"), ("mlp", ".mlp"),
                          ("mod", ".adaln_modulation")):  # fmt: skip
        if marker in sd:
            return group
    return "base"


@dataclass(frozen=True)
class AnimaRules(PlainRules):
    """anima_train.py's rules: six groups at their learning rates (None: ``--learning_rate``; 0: frozen)."""

    group_lrs: tuple[tuple[str, float | None], ...] = ()

    def _lrs(self, lr: float) -> dict[str, float]:
        given = dict(self.group_lrs)
        return {g: (lr if given.get(g) is None else float(given[g])) for g in GROUPS}

    def freeze(self, denoiser: nn.Module) -> None:
        frozen = {g for g, v in self.group_lrs if v == 0}
        for name, p in denoiser.named_parameters():
            if group_of(name) in frozen:
                p.requires_grad_(False)

    def denoiser_groups(self, denoiser: nn.Module, lr: float) -> list[dict] | None:
        if not any(v is not None for _, v in self.group_lrs):
            return None
        lrs = self._lrs(lr)
        params: dict[str, list] = {g: [] for g in GROUPS}
        for name, p in denoiser.named_parameters():
            if p.requires_grad:
                params[group_of(name)].append(p)
        return [{"params": params[g], "lr": lrs[g]} for g in GROUPS if params[g] and lrs[g] != 0]

    def save(self, family: Any, parts: Any, path: Path, *, dtype: Any, metadata: Mapping[str, str],
             safetensors: bool) -> None:  # fmt: skip
        family.save(parts, path, dtype=dtype, metadata=metadata)


class AnimaFullTraining:
    """anima_train.py's own flags (module docstring) and their reader."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("Anima full fine-tuning", "per-group learning rates (sd-scripts' anima_train.py)")
        for group, flag in FLAGS.items():
            add_once(g, parser, f"--{flag}", type=float, default=None,
                     help=f"learning rate of the {group} parameters (default --learning_rate; 0 freezes them)")  # fmt: skip

    def prepare_args(self, args: argparse.Namespace) -> None:
        return None

    def read(self, args: argparse.Namespace, train_text_encoder: bool) -> AnimaRules:
        problems = []
        lrs = []
        for group, flag in FLAGS.items():
            value = getattr(args, flag, None)
            if value is not None and value < 0:
                problems.append(f"--{flag} must be >= 0 (0 freezes the {group} parameters), got {value}")
            lrs.append((group, value))
        if train_text_encoder:
            problems.append("anima_train.py does not train Qwen3 (sd-scripts' neither); drop --train_text_encoder")
        raise_if(problems)
        return AnimaRules(text_encoder_lrs=None, group_lrs=tuple(lrs))
