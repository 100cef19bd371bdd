"""flux_train_control_net.py's own flags (sd-scripts' script: flux_train.py's flags but ``--reg_data_dir``) and the
method config the run layer reads (``library.run.method.MethodConfig``).

Read: ``--controlnet_model_name_or_path`` (a ControlNetFlux file to start from; sd-scripts' keys),
``--mem_eff_save`` (the file written tensor by tensor), ``--double_blocks_to_swap`` / ``--single_blocks_to_swap``
(deprecated; read as sd-scripts reads them: ``--blocks_to_swap = double + single // 2``), ``--use_safetensors``
(the file is always .safetensors, as sd-scripts writes it). Refused, each naming why: ``--fused_backward_pass``,
``--blockwise_fused_optimizers``, ``--fused_optimizer_groups`` (the optimizer steps once per step here; the
ControlNet is small beside the frozen transformer), ``--deepspeed`` (the run layer's DeepSpeed is for whole models).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from library.cli.parse import add_unsupported
from library.cli.problems import ConfigError
from library.run.method import ControlModuleMethod

from ..options import mark_no_effect
from .full_training import FluxFullTraining

DEPTH = 2  # sd-scripts' ControlNetFlux(controlnet_depth=2, controlnet_single_depth=0); no flag changes it


def add_controlnet_args(parser: argparse.ArgumentParser) -> None:
    """The FLUX ControlNet group (sd-scripts' names and defaults)."""
    g = parser.add_argument_group("FLUX ControlNet", "sd-scripts' flux_train_control_net.py")
    g.add_argument("--controlnet_model_name_or_path", type=str, default=None,
                   help="a FLUX ControlNet .safetensors (sd-scripts' ControlNetFlux keys) to start from")  # fmt: skip
    FluxFullTraining().add_args(parser)  # --mem_eff_save, --double_blocks_to_swap, --single_blocks_to_swap
    g.add_argument("--skip_latents_validity_check", action="store_true", dest="skip_cache_check",
                   help="[deprecated] same as --skip_cache_check (sd-scripts' older name)")  # fmt: skip
    g.add_argument("--use_safetensors", action="store_true", help="has no effect here: the ControlNet file is "
                   "always .safetensors (as sd-scripts writes it)")  # fmt: skip
    mark_no_effect(parser, {"--use_safetensors": "the ControlNet file is always .safetensors (as sd-scripts)"})
    why = "not supported for the FLUX ControlNet: the optimizer steps once per step (drop the flag)"
    add_unsupported(g, "--blockwise_fused_optimizers", why, action="store_true")
    add_unsupported(g, "--fused_optimizer_groups", "sd-scripts says it does not work; drop it", type=int)


def prepare_args(args: argparse.Namespace) -> None:
    """The deprecated block-swap flags into ``--blocks_to_swap`` (before the run's groups are read)."""
    FluxFullTraining().prepare_args(args)


@dataclass(frozen=True)
class ControlNetConfig(ControlModuleMethod):
    """What flux_train_control_net.py trains (a ``MethodConfig``)."""

    controlnet_model_name_or_path: str | None = None
    mem_eff_save: bool = False
    depth: int = DEPTH

    def resume_settings(self) -> dict[str, Any]:
        return {"controlnet_depth": self.depth}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ControlNetConfig:
        import os

        errors = []
        path = args.controlnet_model_name_or_path
        if path and not os.path.isfile(path):
            errors.append(f"--controlnet_model_name_or_path {path}: file not found")
        if getattr(args, "fused_backward_pass", False):
            errors.append("--fused_backward_pass: not supported for the FLUX ControlNet (the optimizer steps once "
                          "per step); drop the flag")  # fmt: skip
        if getattr(args, "save_model_as", None) not in (None, "safetensors"):
            errors.append(f"--save_model_as {args.save_model_as}: the FLUX ControlNet is written as one "
                          ".safetensors file in sd-scripts' ControlNetFlux keys (as sd-scripts); use safetensors")  # fmt: skip
        if errors:
            raise ConfigError(errors, "FLUX ControlNet flags")
        return cls(path, bool(args.mem_eff_save))
