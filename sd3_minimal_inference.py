"""SD3 / SD3.5 text-to-image with LoRA, with sd-scripts' ``sd3_minimal_inference.py`` command line.

    python sd3_minimal_inference.py --ckpt_path sd3.5_medium.safetensors --clip_l clip_l.safetensors \\
        --clip_g clip_g.safetensors --t5xxl t5xxl_fp16.safetensors --prompt "a cat" --seed 1 --steps 28 \\
        --cfg_scale 5 --lora_weights "my_lora.safetensors;0.8" --output_dir out [--bf16] [--offload] [--interactive]

Every flag of sd-scripts' script is read: the model comes from our SD3 family (``library/families/sd3``: an SAI
single file with or without its text encoders, ``--clip_l --clip_g --t5xxl``, or a diffusers folder), the image
from our flow-matching Euler sampler (``library/sampling/flow*.py``: shift 3.0, the same code as gen_img.py and
samples during training; equal to diffusers' ``StableDiffusion3Pipeline``), the LoRA from our adapter code (any
algorithm we read, kohya / LyCORIS files, live or merged). As in sd-scripts:

* true CFG ``v = v_neg + cfg·(v_pos - v_neg)`` always, with ``--negative_prompt`` (default empty) and
  ``--cfg_scale`` (default 5.0; 1.0 gives the unguided image, so the negative pass is skipped); 50 steps, 1024 x 1024;
* ``--t5xxl_token_length`` (256) T5 tokens; ``--apply_lg_attn_mask`` / ``--apply_t5_attn_mask`` mask the padding;
* every part in float32, or ``--fp16`` / ``--bf16``; ``--offload`` keeps the parts on the CPU and moves each to the
  device only while it runs (text encoders, then the transformer, then the VAE);
* ``--lora_weights path;multiplier``; ``--merge_lora_weights`` bakes them into the weights, as do several files;
* ``--interactive`` reads prompts from stdin until an empty line, with sd-scripts' options ``--w --h --s --d --m --n
  (- for empty) --c``; width, height, steps and CFG scale carry over to the next prompt, seed and negative prompt
  fall back to ``--seed`` / ``--negative_prompt``; a prompt with a size that is not a multiple of 16 is skipped.

Differences on purpose: the noise comes from a CPU generator in float32 (the same image on every device; sd-scripts
draws on the device in the model dtype), sizes must be multiples of 16 (sd-scripts rounds down to 8, which the 2x2
patches of the transformer cannot take), the PNG carries its prompt and settings, and no image is overwritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from library.cli import deferred_imports
from library.cli.console import add_logging_args, console_logging
from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.families.base import Parts
from library.families.protocol import ModelFamily
from library.families.sd3.options import FAMILY_NAMES, SD3Options
from library.sampling.minimal import (
    Lora,
    apply_options,
    device_of_choice,
    flow_image,
    parse_lora,
    prompt_loop,
    save_new_png,
)
from library.sampling.prompts import PromptSpec

log = logging.getLogger("sd3_minimal_inference")

DEFAULT_SIZE = 1024  # sd-scripts' target_width / target_height
SIZE_MULTIPLE = 16  # an 8x VAE and the transformer's 2x2 patches


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    g = parser.add_argument_group("model")
    g.add_argument("--ckpt_path", type=str, required=True, help="SAI single file or a diffusers folder")
    g.add_argument("--clip_g", type=str, required=False, help="CLIP-G file (default: the one in --ckpt_path)")
    g.add_argument("--clip_l", type=str, required=False, help="CLIP-L file (default: the one in --ckpt_path)")
    g.add_argument("--t5xxl", type=str, required=False, help="T5-XXL file (default: the one in --ckpt_path)")
    g.add_argument("--t5xxl_token_length", type=int, default=256, help="t5xxl token length, default: 256")
    g.add_argument("--apply_lg_attn_mask", action="store_true", help="mask CLIP-L / CLIP-G padding")
    g.add_argument("--apply_t5_attn_mask", action="store_true", help="mask T5's padding")
    g = parser.add_argument_group("image")
    g.add_argument("--prompt", type=str, default="A photo of a cat", help="prompt")
    g.add_argument("--negative_prompt", type=str, default="", help="negative prompt of the true CFG")
    g.add_argument("--cfg_scale", type=float, default=5.0, help="true CFG scale")
    g.add_argument("--output_dir", type=str, default=".", help="folder of the PNG")
    g.add_argument("--seed", type=int, default=1, help="seed")
    g.add_argument("--steps", type=int, default=50, help="steps")
    g.add_argument("--width", type=int, default=DEFAULT_SIZE, help="width, a multiple of 16")
    g.add_argument("--height", type=int, default=DEFAULT_SIZE, help="height, a multiple of 16")
    g.add_argument("--interactive", action="store_true", help="read prompts with options from stdin")
    g = parser.add_argument_group("precision and memory")
    g.add_argument("--fp16", action="store_true", help="every part in float16 (default float32)")
    g.add_argument("--bf16", action="store_true", help="every part in bfloat16 (default float32)")
    g.add_argument("--offload", action="store_true", help="keep the parts on the CPU, each on the device as it runs")
    g = parser.add_argument_group("LoRA")
    g.add_argument("--lora_weights", type=str, nargs="*", default=[], help="adapter files as path;multiplier")
    g.add_argument("--merge_lora_weights", action="store_true", help="merge the adapters into the model weights")
    return parser


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
    """The validated command line."""

    ckpt: Path
    files: dict  # load(...) keyword -> path: clip_l, clip_g, t5xxl
    t5xxl_max_token_length: int
    apply_lg_attn_mask: bool
    apply_t5_attn_mask: bool
    spec: PromptSpec
    seed: int
    output_dir: Path
    interactive: bool
    dtype: torch.dtype
    offload: bool
    loras: tuple[Lora, ...]
    merge: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InferenceConfig:
        """Every problem of the command line at once (``ConfigError``)."""
        problems: list[str] = []
        if args.fp16 and args.bf16:
            problems.append("--fp16 and --bf16: pass one of them (default float32)")
        if not Path(args.ckpt_path).exists():
            problems.append(f"--ckpt_path {args.ckpt_path}: no such file or folder")
        files = {k: getattr(args, k) for k in ("clip_l", "clip_g", "t5xxl") if getattr(args, k)}
        for flag, path in files.items():
            if not Path(path).is_file():
                problems.append(f"--{flag} {path}: no such file")
        loras = tuple(parse_lora(value, problems) for value in args.lora_weights)
        for flag in ("steps", "t5xxl_token_length"):
            if getattr(args, flag) < 1:
                problems.append(f"--{flag} must be >= 1, got {getattr(args, flag)}")
        problems += size_problems(args.width, args.height, "--width", "--height")
        if problems:
            raise ConfigError(problems)
        spec = PromptSpec(args.prompt, negative_prompt=args.negative_prompt, width=args.width, height=args.height,
                          steps=args.steps, scale=args.cfg_scale)  # fmt: skip
        dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
        return cls(
            ckpt=Path(args.ckpt_path), files=files, t5xxl_max_token_length=args.t5xxl_token_length,
            apply_lg_attn_mask=args.apply_lg_attn_mask, apply_t5_attn_mask=args.apply_t5_attn_mask, spec=spec,
            seed=args.seed, output_dir=Path(args.output_dir), interactive=args.interactive, dtype=dtype,
            offload=args.offload, loras=tuple(x for x in loras if x is not None), merge=args.merge_lora_weights,
        )  # fmt: skip


def size_problems(width: int, height: int, width_name: str = "--w", height_name: str = "--h") -> list[str]:
    """Sides that are not positive multiples of 16, each with the nearest smaller size to use instead."""
    problems = []
    for name, value in ((width_name, width), (height_name, height)):
        if value < SIZE_MULTIPLE or value % SIZE_MULTIPLE:
            lower = max(SIZE_MULTIPLE, value - value % SIZE_MULTIPLE)
            problems.append(f"{name} {value}: must be a multiple of {SIZE_MULTIPLE} (an 8x VAE and 2x2 patches); "
                            f"try {lower}")  # fmt: skip
    return problems


def load_model(cfg: InferenceConfig, device: torch.device) -> tuple[ModelFamily, Parts]:
    """The SD3 family detected from the weights and its parts in ``cfg.dtype``, on the CPU with ``--offload``, else
    on ``device``."""
    from library.families import detect_family

    family = detect_family(cfg.ckpt)
    if family.name not in FAMILY_NAMES:
        raise ValueError(f"--ckpt_path {cfg.ckpt}: a {family.name} model; this script samples SD3 / SD3.5 only "
                         "(use gen_img.py)")  # fmt: skip
    options = SD3Options(**cfg.files, t5xxl_max_token_length=cfg.t5xxl_max_token_length,
                         apply_lg_attn_mask=cfg.apply_lg_attn_mask, apply_t5_attn_mask=cfg.apply_t5_attn_mask)  # fmt: skip
    parts = family.load(cfg.ckpt, dtype=cfg.dtype, device="cpu" if cfg.offload else device, options=options)
    return family, parts


def generate_image(
    cfg: InferenceConfig, family: ModelFamily, parts: Parts, spec: PromptSpec, seed: int, device: torch.device
) -> Path:
    """One image of ``spec`` with ``seed``, saved as a PNG; returns its path."""
    from library.sampling.generate import resolve

    spec = resolve(spec, family, parts)
    log.info("seed %d, %dx%d, %d steps, CFG %s, negative prompt %r", seed, spec.width, spec.height, spec.steps,
             spec.scale, spec.negative_prompt)  # fmt: skip
    image = flow_image(family, parts, spec, seed, device, cfg.offload)
    return save_new_png(image, cfg.output_dir, spec, seed, cfg.ckpt.name, log)


def interactive_options(
    line: str, spec: PromptSpec, default_negative: str, networks: list[Any]
) -> tuple[PromptSpec, int | None] | None:
    """One interactive line (sd-scripts' options) applied to the previous ``spec``: the new spec and its seed (None:
    ``--seed``), or None for an empty line (the end). ``--w --h --s --c`` carry over; ``--n`` is per prompt (``-``:
    empty; not given: ``default_negative``); ``--m a,b`` sets the live networks' multipliers. A bad option is logged
    and skipped, as sd-scripts does."""
    return apply_options(line, spec, networks, OPTIONS, default_negative, log)


OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "c": ("scale", float)}
PROMPT_HELP = (
    "Enter prompt (empty to exit). Options: --w <width> --h <height> --s <steps> --d <seed> --m <multipliers for "
    "LoRA> --n <negative prompt>, `--n -` for empty negative prompt --c <cfg_scale>"
)


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Run the script with ``argv`` (default: the command line); returns the written image paths."""
    args = build_parser().parse_args(argv)
    console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
    cfg = InferenceConfig.from_args(args)
    device = device_of_choice()
    family, parts = load_model(cfg, device)
    from networks.apply import apply_adapter_files

    files = [(lora.path, lora.multiplier) for lora in cfg.loras]
    networks = apply_adapter_files(files, family.adapter_roots(parts), cfg.merge, device, log)
    if not cfg.interactive:
        return [generate_image(cfg, family, parts, cfg.spec, cfg.seed, device)]
    return prompt_loop(
        cfg.spec,
        PROMPT_HELP,
        lambda line, spec: interactive_options(line, spec, cfg.spec.negative_prompt, networks),
        lambda spec, seed: generate_image(cfg, family, parts, spec, cfg.seed if seed is None else seed, device),
        log,
        problems_of=lambda spec: size_problems(spec.width, spec.height),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
