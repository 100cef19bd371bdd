"""The process a run lives in: accelerate set-up, precision, attention backend, seeding, RNG state, step counts."""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from library.cli.parse import add_no_effect, add_unsupported
from library.cli.problems import ConfigError

DTYPES = {"no": torch.float32, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_run_args(parser: argparse.ArgumentParser, deepspeed: bool = False, block_swap: bool = False) -> None:
    """Run length, batching, data loading, seed, precision, attention and distributed settings. ``block_swap``: the
    script's denoiser is a transformer whose blocks can be swapped and checkpointed with host-side inputs (FLUX, SD3):
    ``--blocks_to_swap`` and ``--cpu_offload_checkpointing`` are read (library/run/block_swap.py) instead of refused."""
    g = parser.add_argument_group("run")
    g.add_argument("--max_train_steps", type=int, default=1600, help="training steps")
    g.add_argument("--max_train_epochs", type=int, default=None, help="training epochs (overrides --max_train_steps)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--max_data_loader_n_workers", type=int, default=8, help="DataLoader workers (capped at CPUs)")
    g.add_argument("--persistent_data_loader_workers", action="store_true", help="keep workers between epochs")
    g.add_argument("--seed", type=int, default=None, help="random seed (random if omitted; stored as ss_seed)")
    g.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    g.add_argument("--full_fp16", action="store_true", help="fp16 trained weights and gradients")
    g.add_argument("--full_bf16", action="store_true", help="bf16 trained weights and gradients")
    g.add_argument("--fp8_base", action="store_true", help="store the frozen base model in float8 (e4m3fn)")
    g.add_argument("--fp8_base_unet", action="store_true", help="store only the frozen UNet in float8")
    g.add_argument("--fp8_scaled", action="store_true",
                   help="float8 storage with each weight scaled by max |W| / 448 (musubi-tuner's flag, with --fp8_base; "
                        "alone, as sd-scripts' HunyuanImage: the denoiser only)")  # fmt: skip
    g.add_argument("--gradient_checkpointing", action="store_true")
    if block_swap:
        from library.run.block_swap import add_block_swap_args

        add_block_swap_args(parser)
    else:
        from library.families.registry import block_swap_groups

        groups, scripts = block_swap_groups()
        add_unsupported(
            g,
            "--cpu_offload_checkpointing",
            "diffusers' UNets cannot offload checkpointed activations; use --gradient_checkpointing",
            action="store_true",
        )
        add_unsupported(
            g,
            "--blocks_to_swap",
            f"block swapping is for {' / '.join(groups)} transformers ({', '.join(scripts)}); a UNet has no block "
            "lists to swap, and sd-scripts' scripts for UNet models have no such flag",
            type=int,
            default=None,
        )
    g.add_argument("--mem_eff_attn", action="store_true", help="memory-efficient attention (torch SDPA kernel)")
    g.add_argument("--xformers", action="store_true", help="xformers attention (needs the xformers package + CUDA)")
    g.add_argument("--sdpa", action="store_true", help="torch scaled_dot_product_attention (the default)")
    g.add_argument("--torch_compile", action="store_true", help="torch.compile the UNet")
    g.add_argument("--dynamo_backend", type=str, default="inductor", help="torch.compile backend")
    g.add_argument("--ddp_timeout", type=int, default=None, help="DDP timeout in minutes")
    if deepspeed:  # full-model trainers: accelerate wraps the model in DDP; the DeepSpeed flags are real ones
        from library.run.engines import add_deepspeed_args

        g.add_argument("--ddp_gradient_as_bucket_view", action="store_true", help="DDP: gradients as bucket views")
        g.add_argument("--ddp_static_graph", action="store_true", help="DDP: the graph is the same every step")
        add_deepspeed_args(parser)
        return
    # adapters / embeddings run inside the frozen model DDP cannot see: the trainer averages their gradients itself
    reason = "what this script trains is never wrapped in DDP (sdtrain averages its gradients itself)"
    for flag in ("--ddp_gradient_as_bucket_view", "--ddp_static_graph"):
        add_no_effect(g, flag, reason, action="store_true")
    reason = "multi-GPU runs use accelerate's DDP (accelerate config / --multi_gpu)"
    add_unsupported(g, "--deepspeed", reason, action="store_true")
    add_unsupported(g, "--zero_stage", reason, type=int, default=2, choices=[0, 1, 2, 3])
    for flag in ("--offload_optimizer_device", "--offload_param_device"):
        add_unsupported(g, flag, reason, type=str, default=None, choices=[None, "cpu", "nvme"])
    for flag in ("--offload_optimizer_nvme_path", "--offload_param_nvme_path"):
        add_unsupported(g, flag, reason, type=str, default=None)
    for flag in ("--zero3_init_flag", "--zero3_save_16bit_model", "--fp16_master_weights_and_gradients"):
        add_unsupported(g, flag, reason, action="store_true")


@dataclass(frozen=True)
class RunConfig:
    max_train_steps: int = 1600
    max_train_epochs: int | None = None
    gradient_accumulation_steps: int = 1
    max_data_loader_n_workers: int = 8
    persistent_data_loader_workers: bool = False
    seed: int | None = None
    mixed_precision: str = "no"
    full_fp16: bool = False
    full_bf16: bool = False
    fp8_base: bool = False
    fp8_base_unet: bool = False
    fp8_scaled: bool = False  # --fp8_scaled: float8 storage with a scale per weight
    gradient_checkpointing: bool = False
    attention: str = "sdpa"  # sdpa | xformers
    torch_compile: bool = False
    dynamo_backend: str = "inductor"
    ddp_timeout: int | None = None
    ddp_gradient_as_bucket_view: bool = False
    ddp_static_graph: bool = False
    no_half_vae: bool = False
    lowram: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        problems = []
        if args.max_train_steps is not None and args.max_train_steps < 1 and not args.max_train_epochs:
            problems.append(f"--max_train_steps must be >= 1, got {args.max_train_steps}")
        if args.max_train_epochs is not None and args.max_train_epochs < 1:
            problems.append(f"--max_train_epochs must be >= 1, got {args.max_train_epochs}")
        if args.gradient_accumulation_steps < 1:
            problems.append(f"--gradient_accumulation_steps must be >= 1, got {args.gradient_accumulation_steps}")
        if args.full_fp16 and args.mixed_precision != "fp16":
            problems.append("--full_fp16 needs --mixed_precision fp16")
        if args.full_bf16 and args.mixed_precision != "bf16":
            problems.append("--full_bf16 needs --mixed_precision bf16")
        fp8_scaled = getattr(args, "fp8_scaled", False)
        fp8_base_unet = args.fp8_base_unet
        if fp8_scaled and not (args.fp8_base or fp8_base_unet):  # sd-scripts' HunyuanImage: --fp8_scaled alone
            fp8_base_unet = True
            logging.getLogger("sdtrain").info("--fp8_scaled without --fp8_base: the %s is stored in scaled float8 (add --fp8_base for the "
                        "text encoders too)", "denoiser")  # fmt: skip
        if (args.fp8_base or fp8_base_unet) and args.mixed_precision == "no":
            named = "--fp8_scaled" if fp8_scaled else "--fp8_base / --fp8_base_unet"
            problems.append(f"{named} compute in fp16/bf16: add --mixed_precision bf16 (or fp16)")
        if args.xformers and (args.sdpa or args.mem_eff_attn):
            problems.append("choose one attention backend: --xformers or --sdpa / --mem_eff_attn")
        if args.xformers:  # fine_tune.py / sdxl_train.py: --diffusers_xformers asks for the same
            named = "--diffusers_xformers" if getattr(args, "diffusers_xformers", False) else "--xformers"
            problems.extend(p.replace("--xformers", named, 1) for p in _xformers_problems())
        if problems:
            raise ConfigError(problems)
        return cls(
            max_train_steps=args.max_train_steps,
            max_train_epochs=args.max_train_epochs,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_data_loader_n_workers=args.max_data_loader_n_workers,
            persistent_data_loader_workers=args.persistent_data_loader_workers,
            seed=args.seed if args.seed is not None else random.randint(0, 2**31 - 1),
            mixed_precision=args.mixed_precision,
            full_fp16=args.full_fp16,
            full_bf16=args.full_bf16,
            fp8_base=args.fp8_base,
            fp8_base_unet=fp8_base_unet,
            fp8_scaled=fp8_scaled,
            gradient_checkpointing=args.gradient_checkpointing,
            attention="xformers" if args.xformers else "sdpa",
            torch_compile=args.torch_compile,
            dynamo_backend=args.dynamo_backend,
            ddp_timeout=args.ddp_timeout,
            ddp_gradient_as_bucket_view=args.ddp_gradient_as_bucket_view,
            ddp_static_graph=args.ddp_static_graph,
            no_half_vae=args.no_half_vae,
            lowram=args.lowram,
        )

    @property
    def weight_dtype(self) -> torch.dtype:
        """dtype of the frozen base weights (fp16/bf16 under mixed precision, else fp32)."""
        return DTYPES[self.mixed_precision]

    @property
    def train_dtype(self) -> torch.dtype:
        """dtype of the trained weights: fp32, unless --full_fp16 / --full_bf16."""
        if self.full_fp16:
            return torch.float16
        if self.full_bf16:
            return torch.bfloat16
        return torch.float32


def _xformers_problems() -> list[str]:
    try:
        import xformers.ops  # noqa: F401
    except ImportError:
        return ["--xformers: the xformers package is not installed; `pip install sdtrain[xformers]` or use --sdpa"]
    if not torch.cuda.is_available():
        return ["--xformers needs a CUDA GPU; use --sdpa (the default) on this machine"]
    return []


def make_accelerator(
    cfg: RunConfig, *, log_with: list[str] | None = None, logging_dir: str | None = None, deepspeed_plugin: Any = None
):
    """An ``accelerate.Accelerator`` for the run (DDP kwargs, mixed precision, gradient accumulation, trackers;
    ``deepspeed_plugin`` from library/run/engines.py for full models)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs
    from accelerate.utils import ProjectConfiguration

    handlers = []
    if cfg.ddp_gradient_as_bucket_view or cfg.ddp_static_graph:
        handlers.append(
            DistributedDataParallelKwargs(
                gradient_as_bucket_view=cfg.ddp_gradient_as_bucket_view, static_graph=cfg.ddp_static_graph
            )
        )
    if cfg.ddp_timeout:
        handlers.append(InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=cfg.ddp_timeout)))
    # `accelerate launch --multi_gpu` on a machine without CUDA: accelerate only sets up CPU processes (gloo)
    # when asked for the CPU; without this every process would train alone and think it is the main one.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    cpu_processes = launched and not torch.cuda.is_available()
    if not launched:  # a second run in one process (tests, notebooks) may use another precision: start afresh
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(
        cpu=cpu_processes,
        # the loop counts accumulation itself and scales each micro-batch's loss by 1/window (library/run/trainer.py);
        # accelerate's own count would divide the loss a second time in ``backward``
        gradient_accumulation_steps=1,
        mixed_precision=cfg.mixed_precision,
        log_with=log_with or None,
        project_config=ProjectConfiguration(project_dir=logging_dir or ".", logging_dir=logging_dir),
        kwargs_handlers=handlers,
        dynamo_backend=cfg.dynamo_backend.upper() if cfg.torch_compile else None,
        deepspeed_plugin=deepspeed_plugin,
    )


def allow_fp16_gradients(accelerator: Any) -> bool:
    """``--full_fp16``: let accelerate's GradScaler unscale float16 gradients (torch refuses, "Attempting to unscale
    FP16 gradients", because fp16 master weights lose small updates; training fp16 weights is what the flag asks
    for). sd-scripts patches the scaler the same way (``patch_accelerator_for_fp16_training``). Returns whether a
    scaler was patched (there is none without fp16 mixed precision, or under DeepSpeed, which scales by itself)."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None or getattr(scaler, "_sdtrain_allows_fp16", False):
        return False
    unscale = scaler._unscale_grads_

    def unscale_allowing_fp16(optimizer: Any, inv_scale: Any, found_inf: Any, allow_fp16: bool) -> Any:
        return unscale(optimizer, inv_scale, found_inf, True)

    scaler._unscale_grads_ = unscale_allowing_fp16
    scaler._sdtrain_allows_fp16 = True
    return True


def shared_seed(seed: int, accelerator: Any) -> int:
    """Rank 0's seed on every process: without ``--seed`` each process drew its own, and the validation split, the
    bucket order and (with several resolutions) the number of batches per epoch would differ between them."""
    if accelerator.num_processes == 1:
        return seed
    from accelerate.utils import broadcast_object_list

    return int(broadcast_object_list([seed], from_process=0)[0])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def set_attention(modules: list[nn.Module], backend: str) -> None:
    """Select the attention implementation of diffusers modules: "sdpa" (torch SDPA) or "xformers".

    "sdpa" gives every classic diffusers ``Attention`` (SD UNets, every VAE) ``AttnProcessor2_0``; attention layers
    with processors of their own keep them: FLUX's ``FluxAttention`` (whose ``FluxAttnProcessor`` already runs SDPA;
    ``AttnProcessor2_0`` reads ``Attention``-only attributes such as ``spatial_norm``) and an ``Attention`` whose
    processor is not a plain self/cross-attention one (SD3's ``JointAttnProcessor2_0``, which attends over the image
    and text tokens together and already runs SDPA). "xformers" likewise goes only to models whose attention layers
    are all classic; the others keep their SDPA processors, said once per model."""
    from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0, XFormersAttnProcessor

    def classic(layer: nn.Module) -> bool:  # a plain attention a plain processor can run
        plain = (AttnProcessor, AttnProcessor2_0, XFormersAttnProcessor)
        return isinstance(layer, Attention) and type(layer.processor) in plain

    for module in modules:
        if backend == "xformers":
            layers = [m for m in module.modules() if hasattr(m, "set_processor")]
            if all(classic(m) for m in layers):
                module.enable_xformers_memory_efficient_attention()
            else:  # diffusers' xformers processor cannot run FluxAttention: it keeps its own (torch SDPA)
                import logging

                logging.getLogger("sdtrain").warning(
                    "--xformers: %s keeps its own attention (torch SDPA); xformers is used for the VAE only",
                    type(module).__name__,
                )
            continue
        for leaf in module.modules():
            if classic(leaf):
                leaf.set_processor(AttnProcessor2_0())


def steps_per_epoch(batches_per_epoch: int, num_processes: int, grad_accum: int) -> int:
    """Optimizer steps per epoch, as sd-scripts counts them: ceil(batches / processes / accumulation)."""
    return math.ceil(batches_per_epoch / num_processes / grad_accum)


def total_steps(cfg: RunConfig, batches_per_epoch: int, num_processes: int) -> tuple[int, int]:
    """``(max_train_steps, num_epochs)``: --max_train_epochs wins over --max_train_steps, as in sd-scripts."""
    per_epoch = steps_per_epoch(batches_per_epoch, num_processes, cfg.gradient_accumulation_steps)
    if per_epoch < 1:
        raise ValueError("the dataset yields no batch at this batch size; see the bucket report above")
    steps = cfg.max_train_epochs * per_epoch if cfg.max_train_epochs else cfg.max_train_steps
    return steps, math.ceil(steps / per_epoch)


def num_workers(cfg: RunConfig) -> int:
    return max(0, min(cfg.max_data_loader_n_workers, (os.cpu_count() or 1) - 1))
