"""ToyDiT text-to-image with LoRA (the test plug-in family): a minimal inference script composed from
library/sampling/minimal.py (device, offloading, one flow image, its PNG, the interactive loop) and networks.apply.

    PYTHONPATH=tests/plugins python -m toydit_minimal_inference --ckpt_path toydit.safetensors --prompt "a cat" --seed 1 \
        --lora_weights "lora.safetensors;0.8" --output_dir out [--toy_text_encoder te.safetensors] [--interactive]

The family is read from the file (it must be ToyDiT); the image comes from the flow-matching Euler sampler.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from toydit.family import TOYDIT

from library.cli import deferred_imports
from library.cli.console import add_logging_args, console_logging
from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.sampling.minimal import apply_options, device_of_choice, flow_image, parse_lora, prompt_loop, save_new_png
from library.sampling.prompts import PromptSpec

log = logging.getLogger("toydit_minimal_inference")
OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "c": ("scale", float)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    parser.add_argument("--ckpt_path", type=str, required=True, help="ToyDiT model file or folder")
    TOYDIT.options.add_args(parser, training=False)  # the family's load flags
    g = parser.add_argument_group("image")
    g.add_argument("--prompt", type=str, default="a photo of a cat")
    g.add_argument("--negative_prompt", type=str, default="", help="negative prompt (true CFG with --cfg_scale)")
    g.add_argument("--output_dir", type=str, default=".")
    g.add_argument("--seed", type=int, default=None, help="seed (default: random)")
    g.add_argument("--steps", type=int, default=None, help="steps (default: the family's)")
    g.add_argument("--cfg_scale", type=float, default=None, help="true CFG scale (default: the family's)")
    g.add_argument("--width", type=int, default=None, help="a multiple of 16 (default: the native size)")
    g.add_argument("--height", type=int, default=None, help="a multiple of 16 (default: the native size)")
    g.add_argument("--offload", action="store_true", help="each part on the device only while it runs")
    g.add_argument("--interactive", action="store_true", help="read prompts with --w --h --s --d --m --n --c")
    g.add_argument("--lora_weights", type=str, nargs="*", default=[], help="adapter files as path;multiplier")
    g.add_argument("--merge_lora_weights", action="store_true", help="merge the adapters into the weights")
    return parser


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Run the script with ``argv``; returns the written image paths."""
    from library.families import detect_family
    from library.sampling.generate import resolve
    from networks.apply import apply_adapter_files

    args = build_parser().parse_args(argv)
    console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
    problems: list[str] = []
    loras = [lora for lora in (parse_lora(v, problems) for v in args.lora_weights) if lora is not None]
    family = detect_family(args.ckpt_path)
    problems += TOYDIT.options().problems(family.spec, args.ckpt_path)
    if problems:
        raise ConfigError(problems)
    device = device_of_choice()
    options = family.options.from_args(args, training=False)
    parts = family.load(args.ckpt_path, device="cpu" if args.offload else device, options=options)
    roots = family.adapter_roots(parts)
    networks = apply_adapter_files([(x.path, x.multiplier) for x in loras], roots, args.merge_lora_weights, device, log)
    first = PromptSpec(args.prompt, negative_prompt=args.negative_prompt, width=args.width, height=args.height,
                       steps=args.steps, scale=args.cfg_scale)  # fmt: skip

    def generate(spec: PromptSpec, seed: int | None) -> Path:
        seed = args.seed if seed is None else seed
        seed = random.randint(0, 2**32 - 1) if seed is None else seed
        spec = resolve(spec, family, parts)
        image = flow_image(family, parts, spec, seed, device, args.offload)
        return save_new_png(image, Path(args.output_dir), spec, seed, Path(args.ckpt_path).name, log)

    if not args.interactive:
        return [generate(first, None)]
    parse = lambda line, spec: apply_options(line, spec, networks, OPTIONS, args.negative_prompt, log)  # noqa: E731
    return prompt_loop(first, "Enter prompt (empty to exit).", parse, generate, log)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
