"""Sampling during training: sd-scripts' flags, the validated config and when to sample."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from library.cli.problems import ConfigError

from .prompts import read_prompt_file
from .schedulers import SAMPLER_NAMES

log = logging.getLogger(__name__)
DEFAULT_SAMPLE_STEPS = 30  # sd-scripts' default when a prompt has no --s
DEFAULT_SCALE = 7.5
DEFAULT_MAX_EMBEDDINGS_MULTIPLES = 3  # sd-scripts' sampling pipelines encode up to 3 x 75 tokens


def add_sample_args(parser: argparse.ArgumentParser) -> None:
    """sd-scripts' sampling flags (same names, types, defaults; ``--sample_sampler`` limited to its 16 names)."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--sample_every_n_steps", type=int, default=None, help="generate samples every N steps")
    g.add_argument(
        "--sample_every_n_epochs",
        type=int,
        default=None,
        help="generate samples every N epochs (overrides --sample_every_n_steps)",
    )
    g.add_argument("--sample_at_first", action="store_true", help="generate samples before training")
    g.add_argument("--sample_prompts", type=str, default=None, help="prompt file (.txt, .toml or .json)")
    g.add_argument(
        "--sample_sampler",
        type=str,
        default="ddim",
        choices=list(SAMPLER_NAMES),
        help="sampler (scheduler) for samples; a prompt's --ss overrides it",
    )
    g.add_argument(
        "--sample_vae_tiling",
        choices=["auto", "on", "off"],
        default="auto",
        help="decode samples in 512 px tiles (less device memory: ~2 GB less for a 1024 px image on a GPU). auto: "
        "on when the run saves device memory (--fp8_base / --fp8_base_unet / --fp8_scaled, --blocks_to_swap N, "
        "--cpu_offload_checkpointing, or --gradient_checkpointing with --cache_latents[_to_disk])",
    )


@dataclass(frozen=True)
class SampleConfig:
    """When and how to sample during training.

    ``clip_skip`` and ``zero_terminal_snr`` are the training's (``--clip_skip``, ``--zero_terminal_snr``), so samples
    are encoded and denoised as the model is trained. Sample size: a prompt's ``--w/--h``, else the family's native
    resolution (SDXL 1024, SD2 768-v 768, SD1 512) -- sd-scripts uses 512 x 512 for every family.
    ``default_steps`` / ``default_scale``: a prompt's steps / CFG scale when it sets none; None: the sampler's
    default (DDPM samplers 30 / 7.5; flow matching the family's ``FlowSampling.default_steps`` / ``default_scale``:
    FLUX 20 / 1.0, SD3 30 / 7.5; ``generate.resolve``).
    """

    prompts_file: Path | None = None
    every_n_steps: int | None = None
    every_n_epochs: int | None = None
    at_first: bool = False
    sampler: str = "ddim"
    clip_skip: int | None = None
    zero_terminal_snr: bool = False
    max_embeddings_multiples: int = DEFAULT_MAX_EMBEDDINGS_MULTIPLES
    default_steps: int | None = None
    default_scale: float | None = None
    tiled_vae: bool = False  # decode in tiles (--sample_vae_tiling; library/sampling/vae_tiling.py)
    controls: bool = False  # a ControlNet samples: prompts may give --cn (the trainer's conditioning_images)

    @property
    def enabled(self) -> bool:
        """Whether the run samples at all (then the VAE and text encoders must stay loaded)."""
        return self.prompts_file is not None and bool(self.every_n_steps or self.every_n_epochs or self.at_first)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SampleConfig:
        """Validate the sampling flags; the prompt file must exist and parse (every bad line reported at once)."""
        problems: list[str] = []
        for flag in ("sample_every_n_steps", "sample_every_n_epochs"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                problems.append(f"--{flag} must be >= 1, got {value}; leave it out to turn this trigger off")
        wants = args.sample_every_n_steps or args.sample_every_n_epochs or args.sample_at_first
        if wants and not args.sample_prompts:
            problems.append("sampling is requested (--sample_every_n_* / --sample_at_first) but --sample_prompts is "
                            "missing; add --sample_prompts prompts.txt")  # fmt: skip
        if args.sample_sampler not in SAMPLER_NAMES:
            problems.append(f"--sample_sampler {args.sample_sampler!r}: use one of {', '.join(SAMPLER_NAMES)}")
        path = Path(args.sample_prompts) if args.sample_prompts else None
        if path is not None:
            try:
                read_prompt_file(path, controls=bool(getattr(args, "conditioning_images", False)))
            except FileNotFoundError as e:
                problems.append(str(e))
            except ConfigError as e:
                problems.extend(e.problems)
        if problems:
            raise ConfigError(problems)
        return cls(
            prompts_file=path,
            controls=bool(getattr(args, "conditioning_images", False)),
            every_n_steps=args.sample_every_n_steps,
            every_n_epochs=args.sample_every_n_epochs,
            at_first=args.sample_at_first,
            sampler=args.sample_sampler,
            clip_skip=getattr(args, "clip_skip", None),
            zero_terminal_snr=bool(getattr(args, "zero_terminal_snr", False)),
            tiled_vae=tiled_vae(args, say=path is not None),
        )


LOW_MEMORY_FLAGS = ("fp8_base", "fp8_base_unet", "fp8_scaled", "blocks_to_swap", "cpu_offload_checkpointing")


def low_memory_flags(args: argparse.Namespace) -> list[str]:
    """The flags of ``args`` that say the run saves device memory (``--sample_vae_tiling auto``'s rule): float8
    weights, block swapping, offloaded checkpointing, or gradient checkpointing with cached latents."""
    given = [f"--{name}" for name in LOW_MEMORY_FLAGS if getattr(args, name, None)]
    cached = getattr(args, "cache_latents", False) or getattr(args, "cache_latents_to_disk", False)
    if getattr(args, "gradient_checkpointing", False) and cached:
        given.append("--gradient_checkpointing with cached latents")
    return given


def tiled_vae(args: argparse.Namespace, say: bool = False) -> bool:
    """Whether samples decode in tiles: ``--sample_vae_tiling on``, or ``auto`` in a low-memory run (``say``: log
    which flags made ``auto`` choose tiles)."""
    mode = getattr(args, "sample_vae_tiling", "auto")
    if mode != "auto":
        return mode == "on"
    reasons = low_memory_flags(args)
    if reasons and say:
        log.info("samples decode in 512 px tiles (a low-memory run: %s); --sample_vae_tiling off decodes them whole",
                 ", ".join(reasons))  # fmt: skip
    return bool(reasons)


def should_sample(cfg: SampleConfig, *, step: int | None = None, epoch: int | None = None) -> bool:
    """sd-scripts' rule (``train_util.sample_images_common``) for one sampling event.

    Call with ``step=0`` before training (``--sample_at_first``), with ``step=global_step`` after each optimizer step
    (epoch None), and with ``epoch=<epochs completed>`` at the end of each epoch. ``--sample_every_n_epochs`` overrides
    ``--sample_every_n_steps``: when it is set, step events never sample.
    """
    if cfg.prompts_file is None:
        return False
    if step == 0:
        return cfg.at_first
    if cfg.every_n_epochs is not None:
        return epoch is not None and epoch % cfg.every_n_epochs == 0
    if epoch is not None or cfg.every_n_steps is None or step is None:
        return False
    return step % cfg.every_n_steps == 0
