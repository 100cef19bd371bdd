"""The ControlNet-LLLite trainer's own flags (sd-scripts' ``sdxl_train_control_net_lllite.py``) and the method
config the run layer reads (``library.run.method.MethodConfig``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from library.cli.problems import ConfigError
from library.run.method import ControlModuleMethod


def add_lllite_args(parser: argparse.ArgumentParser) -> None:
    """``--cond_emb_dim --network_dim --network_dropout --network_weights`` (sd-scripts' names)."""
    g = parser.add_argument_group("ControlNet-LLLite")
    g.add_argument("--cond_emb_dim", type=int, default=None, help="conditioning embedding width (the docs use 32)")
    g.add_argument("--network_dim", type=int, default=None, help="width of each module's down/mid (the docs use 64)")
    g.add_argument("--network_dropout", type=float, default=None, help="dropout after mid while training (0..1)")
    g.add_argument("--network_weights", type=str, default=None, help="an LLLite file to start from")


@dataclass(frozen=True)
class LLLiteConfig(ControlModuleMethod):
    """What the LLLite trainer trains (a ``MethodConfig``)."""

    cond_emb_dim: int
    network_dim: int
    network_dropout: float | None = None
    network_weights: str | None = None

    def resume_settings(self) -> dict[str, Any]:
        return {"dim": self.network_dim}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LLLiteConfig:
        import os

        errors = []
        if args.cond_emb_dim is None or args.cond_emb_dim < 2 or args.cond_emb_dim % 2:
            errors.append(
                f"--cond_emb_dim: an even number >= 2 is needed (sd-scripts' docs: 32), got {args.cond_emb_dim}"
            )
        if args.network_dim is None or args.network_dim < 1:
            errors.append(f"--network_dim: a width >= 1 is needed (sd-scripts' docs: 64), got {args.network_dim}")
        dropout = args.network_dropout or None  # 0 is sd-scripts' "no dropout"
        if dropout is not None and not 0 < dropout < 1:
            errors.append(f"--network_dropout: must be between 0 and 1, got {dropout}")
        if args.network_weights and not os.path.isfile(args.network_weights):
            errors.append(f"--network_weights {args.network_weights}: file not found")
        if errors:
            raise ConfigError(errors, "ControlNet-LLLite flags")
        return cls(args.cond_emb_dim, args.network_dim, dropout, args.network_weights)
