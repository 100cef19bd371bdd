"""The ControlNet trainers' own flags (sd-scripts' ``train_control_net.py`` / ``sdxl_train_control_net.py``) and
the method config the run layer reads (``library.run.method.MethodConfig``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from library.cli.problems import ConfigError
from library.run.method import ControlModuleMethod


def add_controlnet_args(parser: argparse.ArgumentParser, zero_conv_lr: bool = False) -> None:
    """``--controlnet_model_name_or_path`` and, for the SDXL script, ``--control_net_lr`` (sd-scripts' names)."""
    g = parser.add_argument_group("ControlNet")
    g.add_argument("--controlnet_model_name_or_path", type=str, default=None,
                   help="a ControlNet file (LDM or diffusers names) or diffusers folder to continue training; "
                   "default: a new ControlNet copied from the UNet")  # fmt: skip
    if zero_conv_lr:
        g.add_argument("--control_net_lr", type=float, default=1e-4,
                       help="learning rate of the ControlNet's own modules (conditioning embedding, zero "
                       "convolutions); the copied UNet encoder trains at --learning_rate")  # fmt: skip


@dataclass(frozen=True)
class ControlNetConfig(ControlModuleMethod):
    """What the ControlNet trainers train (a ``MethodConfig``)."""

    controlnet_model_name_or_path: str | None = None
    control_net_lr: float | None = None  # None: every tensor at --learning_rate (train_control_net.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ControlNetConfig:
        errors = []
        path = args.controlnet_model_name_or_path
        if path and not os.path.exists(path):
            errors.append(f"--controlnet_model_name_or_path {path}: no such file or folder (a ControlNet file, or "
                          "a diffusers ControlNet folder; hub names are not downloaded)")  # fmt: skip
        lr = getattr(args, "control_net_lr", None)
        if lr is not None and lr < 0:
            errors.append(f"--control_net_lr: must be >= 0, got {lr}")
        if errors:
            raise ConfigError(errors, "ControlNet flags")
        return cls(path, lr)
