"""Anima text-to-image with LoRA: sd-scripts' anima_minimal_inference.py command line over library/sampling/minimal.py
(device, offloading, one flow image, its PNG, the interactive loop) and networks.apply.

    python anima_minimal_inference.py --dit anima-base-v1.0.safetensors --text_encoder qwen_3_06b_base.safetensors \
        --vae qwen_image_vae.safetensors --prompt "1girl, smile" --image_size 1024 1024 --infer_steps 50 \
        --guidance_scale 3.5 --flow_shift 5.0 --seed 1 --save_path out --lora_weight my_anima_lora.safetensors

Read with sd-scripts' meanings: ``--dit --vae --text_encoder`` (the Qwen3 file or folder), ``--lora_weight`` /
``--lora_multiplier`` (kohya files of networks.lora_anima, LyCORIS files too: ``--lycoris`` is accepted), ``--prompt
--negative_prompt --image_size H W --infer_steps --guidance_scale`` (true CFG) ``--flow_shift`` (the static shift
of the Euler schedule) ``--seed --save_path`` (a folder), ``--from_file`` (one prompt per line), ``--interactive``,
``--device``, ``--attn_mode torch|sdpa``, ``--vae_chunk_size --vae_disable_cache`` (library/families/anima/options.py).
Refused with the reason: ``--fp8 --fp8_scaled`` (float8 storage is training's ``--fp8_base``), ``--include_patterns
--exclude_patterns`` (LoRA module filters at load), ``--output_type`` other than images, ``--latent_path``,
``--text_encoder_cpu`` (use ``--offload``: each part on the device only while it runs), ``--no_metadata``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from library.cli import deferred_imports
from library.cli.console import add_logging_args, console_logging
from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.families.anima import ANIMA
from library.sampling.minimal import device_of_choice, generate_images
from library.sampling.prompts import PromptSpec

log = logging.getLogger("anima_minimal_inference")
REFUSED = {
    "fp8": "float8 storage is training's --fp8_base; inference runs in the weights' precision",
    "fp8_scaled": "scaled float8 weights are not supported",
    "include_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
    "exclude_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
    "latent_path": "decoding saved latents is not supported",
    "text_encoder_cpu": "use --offload (each part on the device only while it runs)",
    "no_metadata": "the PNG info (prompt and settings) is always written",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    parser.add_argument("--dit", type=str, required=True, help="Anima DiT .safetensors (or an Anima folder)")
    parser.add_argument("--vae", type=str, default=None, help="Qwen-Image VAE .safetensors")
    parser.add_argument("--text_encoder", type=str, default=None, help="Qwen3-0.6B file or folder")
    ANIMA.options.add_args(parser, training=False)  # --llm_adapter_path --t5_tokenizer_path, lengths, VAE notes
    g = parser.add_argument_group("image")
    g.add_argument("--lora_weight", type=str, nargs="*", default=None, help="LoRA files")
    g.add_argument("--lora_multiplier", type=float, nargs="*", default=None, help="their multipliers (default 1.0)")
    g.add_argument("--lycoris", action="store_true", help="accepted: LyCORIS files are read like any adapter file")
    g.add_argument("--guidance_scale", type=float, default=3.5, help="true CFG scale (default 3.5)")
    g.add_argument("--prompt", type=str, default=None)
    g.add_argument("--negative_prompt", type=str, default="")
    g.add_argument("--image_size", type=int, nargs=2, default=[1024, 1024], metavar=("H", "W"))
    g.add_argument("--infer_steps", type=int, default=50)
    g.add_argument("--save_path", type=str, required=True, help="folder for the images")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--flow_shift", type=float, default=5.0, help="static shift of the Euler schedule (default 5.0)")
    g.add_argument("--device", type=str, default=None, help="default: CUDA, else MPS, else CPU")
    g.add_argument("--output_type", type=str, default="images", choices=["images", "latent", "latent_images"])
    g.add_argument("--from_file", type=str, default=None, help="one prompt per line")
    g.add_argument("--interactive", action="store_true")
    g.add_argument("--offload", action="store_true", help="each part on the device only while it runs")
    for flag in ("fp8", "fp8_scaled", "text_encoder_cpu", "no_metadata"):
        g.add_argument(f"--{flag}", action="store_true", help=f"refused: {REFUSED[flag]}")
    for flag in ("include_patterns", "exclude_patterns", "latent_path"):
        g.add_argument(f"--{flag}", type=str, nargs="*", default=None, help=f"refused: {REFUSED[flag]}")
    return parser


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Run the script with ``argv``; returns the written image paths."""
    import torch

    from networks.apply import apply_adapter_files

    args = build_parser().parse_args(argv)
    console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
    problems = [f"--{flag}: {why}" for flag, why in REFUSED.items() if getattr(args, flag)]
    if args.output_type != "images":
        problems.append(f"--output_type {args.output_type}: only images are written")
    if args.prompt is None and args.from_file is None and not args.interactive:
        problems.append("give --prompt, --from_file or --interactive")
    loras = list(args.lora_weight or [])
    multipliers = list(args.lora_multiplier or [])
    if multipliers and len(multipliers) not in (1, len(loras)):
        problems.append(f"--lora_multiplier: {len(multipliers)} values for {len(loras)} --lora_weight files")
    if args.qwen3 is None:
        args.qwen3 = args.text_encoder
    try:
        options = ANIMA.options.from_args(args, training=False)
    except ConfigError as e:
        problems += e.problems
    if problems:
        raise ConfigError(problems)
    device = torch.device(args.device) if args.device else device_of_choice()
    parts = ANIMA.load(args.dit, vae=args.vae, device="cpu" if args.offload else device, options=options)
    parts.scheduler_config["shift"] = float(args.flow_shift)
    pairs = [(p, multipliers[i] if i < len(multipliers) else (multipliers[0] if multipliers else 1.0))
             for i, p in enumerate(loras)]  # fmt: skip
    networks = apply_adapter_files(pairs, ANIMA.adapter_roots(parts), False, device, log)
    height, width = args.image_size

    def spec_of(prompt: str) -> PromptSpec:
        return PromptSpec(prompt, negative_prompt=args.negative_prompt, width=width, height=height,
                          steps=args.infer_steps, scale=args.guidance_scale)  # fmt: skip

    return generate_images(ANIMA, parts, args, spec_of, device, args.offload, networks, args.negative_prompt, log)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
