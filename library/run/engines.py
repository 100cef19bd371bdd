"""Distributed engines for full-model training (DeepSpeed flags -> accelerate's plugin).

Distributed engines for full-model training: sd-scripts' DeepSpeed flags mapped to accelerate's DeepSpeed
plugin, and clear errors where an engine cannot run on this machine.

DDP needs nothing here (``accelerate launch --multi_gpu``; on CPU it runs with gloo). FSDP comes from an accelerate
config file (``distributed_type: FSDP``); accelerate runs it only on GPUs (CUDA / XPU / ...). DeepSpeed runs only on
CUDA GPUs with the ``deepspeed`` package. Where an engine cannot run, the run stops with a message before anything
is loaded; it never falls back to another engine.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import torch


def add_deepspeed_args(parser: argparse.ArgumentParser) -> None:
    """sd-scripts' DeepSpeed flags (full-model trainers)."""
    g = parser.add_argument_group("DeepSpeed (CUDA only)")
    g.add_argument("--deepspeed", action="store_true", help="train with DeepSpeed ZeRO (through accelerate)")
    g.add_argument("--zero_stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    for part in ("optimizer", "param"):
        g.add_argument(f"--offload_{part}_device", type=str, default=None, choices=[None, "cpu", "nvme"])
        g.add_argument(f"--offload_{part}_nvme_path", type=str, default=None, help=f"NVMe folder for {part} offload")
    g.add_argument("--zero3_init_flag", action="store_true", help="ZeRO-3: build the model already partitioned")
    g.add_argument("--zero3_save_16bit_model", action="store_true", help="ZeRO-3: gather 16-bit weights to save")
    g.add_argument("--fp16_master_weights_and_gradients", action="store_true", help="fp16 master weights (ZeRO-2 CPU)")


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: int = 2
    offload_optimizer_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_device: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool = False
    zero3_save_16bit_model: bool = False
    fp16_master_weights_and_gradients: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, problems: list[str]) -> DeepSpeedConfig | None:
        """None without ``--deepspeed``; problems (no CUDA, no package, unsupported combinations) are appended."""
        if not getattr(args, "deepspeed", False):
            return None
        if not torch.cuda.is_available():
            problems.append(
                "--deepspeed needs CUDA GPUs (DeepSpeed does not run on CPU); on this machine use DDP: "
                "accelerate launch --multi_gpu --num_processes N fine_tune.py ... (without --deepspeed)"
            )
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            problems.append("--deepspeed: the deepspeed package is not installed; `pip install deepspeed`")
        if args.gradient_accumulation_steps != 1:
            problems.append("--deepspeed with --gradient_accumulation_steps > 1 is not supported yet; use 1")
        for part in ("optimizer", "param"):
            if getattr(args, f"offload_{part}_device") == "nvme" and not getattr(args, f"offload_{part}_nvme_path"):
                problems.append(f"--offload_{part}_device nvme needs --offload_{part}_nvme_path")
        names = [f for f in cls.__dataclass_fields__]
        return cls(**{n: getattr(args, n) for n in names})

    def plugin(self, batch_size: int, mixed_precision: str, max_grad_norm: float, full_fp16: bool) -> Any:
        """accelerate's ``DeepSpeedPlugin`` for these settings (batch sizes filled in: no dataloader is prepared)."""
        from accelerate import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(
            zero_stage=self.zero_stage,
            gradient_accumulation_steps=1,
            gradient_clipping=max_grad_norm or None,
            offload_optimizer_device=self.offload_optimizer_device,
            offload_optimizer_nvme_path=self.offload_optimizer_nvme_path,
            offload_param_device=self.offload_param_device,
            offload_param_nvme_path=self.offload_param_nvme_path,
            zero3_init_flag=self.zero3_init_flag,
            zero3_save_16bit_model=self.zero3_save_16bit_model,
        )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = batch_size
        plugin.deepspeed_config["train_batch_size"] = batch_size * world
        plugin.set_mixed_precision(mixed_precision)
        if mixed_precision == "fp16":
            plugin.deepspeed_config["fp16"]["initial_scale_power"] = 0  # sd-scripts: start the loss scale at 1
            if (full_fp16 or self.fp16_master_weights_and_gradients) and self.offload_optimizer_device == "cpu":
                if self.zero_stage == 2:
                    plugin.deepspeed_config["fp16"]["fp16_master_weights_and_grads"] = True
        return plugin


def launch_problems() -> list[str]:
    """An engine chosen in the accelerate config that cannot run here (checked before anything is loaded)."""
    if torch.cuda.is_available():
        return []
    problems = []
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        problems.append(
            "the accelerate config asks for FSDP, which accelerate runs only on GPUs; on CPU use DDP "
            "(distributed_type: MULTI_GPU, or accelerate launch --multi_gpu)"
        )
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        problems.append("the accelerate config asks for DeepSpeed, which needs CUDA GPUs; on CPU use DDP instead")
    return problems
