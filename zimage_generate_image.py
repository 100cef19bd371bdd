"""Z-Image text-to-image with LoRA: musubi-tuner's zimage_generate_image.py command line over
library/sampling/minimal.py (device, offloading, one flow image, its PNG, the interactive loop) and networks.apply.

    python zimage_generate_image.py --dit z_image_turbo_bf16.safetensors --vae ae.safetensors \
        --text_encoder qwen_3_4b.safetensors --prompt "a cat" --image_size 1024 1024 --infer_steps 8 \
        --guidance_scale 0.0 --seed 1 --save_path out --lora_weight my-lora.safetensors --lora_multiplier 1.0

Read with musubi-tuner's meanings: ``--dit --vae --text_encoder``, ``--lora_weight`` / ``--lora_multiplier`` (kohya
files of networks.lora_zimage, LyCORIS files too: ``--lycoris`` accepted), ``--prompt --negative_prompt --image_size
H W --infer_steps`` (default 25) ``--guidance_scale`` (CFG as musubi-tuner: cond + g (cond − uncond) when g > 1; default 0.0: none, as Turbo
needs)
``--flow_shift`` (the static shift, default 3.0) ``--seed --save_path`` (a folder), ``--from_file``,
``--interactive``, ``--device``, ``--attn_mode torch|sdpa``, ``--fp8_llm`` (Qwen3 in float8), ``--blocks_to_swap``
(read as ``--offload``: each part on the device only while it runs). Refused with the reason: ``--fp8 --fp8_scaled``,
``--text_encoder_cpu``, ``--include_patterns --exclude_patterns``, ``--output_type`` other than images,
``--latent_path``, ``--save_merged_model``, ``--no_metadata``, ``--sample_solver`` other than euler.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from library.cli import deferred_imports
from library.cli.console import add_logging_args, console_logging
from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.families.zimage import ZIMAGE
from library.sampling.minimal import apply_options, device_of_choice, flow_image, prompt_loop, save_new_png
from library.sampling.prompts import PromptSpec

log = logging.getLogger("zimage_generate_image")
OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "c": ("scale", float)}
REFUSED_SWITCHES = {
    "fp8": "float8 storage is training's --fp8_base; inference runs in the weights' precision",
    "fp8_scaled": "scaled float8 weights are not supported yet",
    "fp8_fast": "scaled float8 weights are not supported yet",
    "text_encoder_cpu": "use --offload (each part on the device only while it runs)",
    "no_metadata": "the PNG info (prompt and settings) is always written",
    "vae_enable_tiling": "tiled VAE decoding is not done here",
    "cfg_normalize": "CFG renormalisation is not done here",
    "bell": "not done here",
    "use_pinned_memory_for_block_swap": "use --offload",
    "disable_numpy_memmap": "not read here",
}
REFUSED_VALUES = {
    "include_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
    "exclude_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
    "latent_path": "decoding saved latents is not supported",
    "save_merged_model": "saving the merged DiT is not done here; use networks/merge tools",
    "ckpt_dir": "not read here",
    "num_layers": "a DiT with fewer blocks is read from its file's shapes",
    "embedded_cfg_scale": "Z-Image has no embedded guidance",
    "rcm_threshold": "not done here",
    "rcm_relative_threshold": "not done here",
    "rcm_kernel_size": "not done here",
    "rcm_dilate_size": "not done here",
    "rcm_debug_save": "not done here",
}


def cfg_scale(guidance: float) -> float:
    """musubi-tuner's (and diffusers' ZImagePipeline's) CFG ``cond + g (cond − uncond)``, on only for g > 1, as the
    sampler's ``uncond + s (cond − uncond)``: s = g + 1, else 1 (no CFG)."""
    return guidance + 1.0 if guidance > 1.0 else 1.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    parser.add_argument("--dit", type=str, required=True, help="Z-Image DiT .safetensors (or a diffusers folder)")
    parser.add_argument("--vae", type=str, default=None, help="the FLUX.1 AE .safetensors (ae.safetensors)")
    g = parser.add_argument_group("image")
    g.add_argument("--lora_weight", type=str, nargs="*", default=None, help="LoRA files")
    g.add_argument("--lora_multiplier", type=float, nargs="*", default=None, help="their multipliers (default 1.0)")
    g.add_argument("--lycoris", action="store_true", help="accepted: LyCORIS files are read like any adapter file")
    g.add_argument("--guidance_scale", type=float, default=0.0, help="true CFG scale (default 0.0: none)")
    g.add_argument("--prompt", type=str, default=None)
    g.add_argument("--negative_prompt", type=str, default=None)
    g.add_argument("--image_size", type=int, nargs=2, default=[256, 256], metavar=("H", "W"))
    g.add_argument("--infer_steps", type=int, default=25)
    g.add_argument("--save_path", type=str, required=True, help="folder for the images")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--flow_shift", type=float, default=3.0, help="the static shift (default 3.0)")
    g.add_argument("--device", type=str, default=None, help="default: CUDA, else MPS, else CPU")
    g.add_argument("--attn_mode", type=str, default="torch", choices=["torch", "sdpa", "xformers", "flash",
                                                                       "sageattn", "flash3"])  # fmt: skip
    g.add_argument("--output_type", type=str, default="images", choices=["images", "latent", "latent_images"])
    g.add_argument("--sample_solver", type=str, default="euler", help="euler only here")
    g.add_argument("--from_file", type=str, default=None, help="one prompt per line")
    g.add_argument("--interactive", action="store_true")
    g.add_argument("--offload", action="store_true", help="each part on the device only while it runs")
    g.add_argument("--blocks_to_swap", type=int, default=None, help="read as --offload")
    for flag, why in REFUSED_SWITCHES.items():
        if f"--{flag}" not in parser._option_string_actions:
            g.add_argument(f"--{flag}", action="store_true", help=f"refused: {why}")
    for flag, why in REFUSED_VALUES.items():
        if f"--{flag}" not in parser._option_string_actions:
            g.add_argument(f"--{flag}", type=str, nargs="*", default=None, help=f"refused: {why}")
    ZIMAGE.options.add_args(parser, training=False)  # --text_encoder --fp8_llm --model_version
    return parser


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Run the script with ``argv``; returns the written image paths."""
    import torch

    from networks.apply import apply_adapter_files

    parser = build_parser()
    args = parser.parse_args(argv)
    console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
    from library.cli.parse import unsupported_problems

    problems = unsupported_problems(parser, args)
    problems += [f"--{flag}: {why}" for flag, why in {**REFUSED_SWITCHES, **REFUSED_VALUES}.items()
                 if getattr(args, flag, None) not in (None, False)]  # fmt: skip
    if args.output_type != "images":
        problems.append(f"--output_type {args.output_type}: only images are written")
    if args.sample_solver != "euler":
        problems.append(f"--sample_solver {args.sample_solver}: the flow Euler sampler only (--sample_solver euler)")
    if args.attn_mode not in ("torch", "sdpa"):
        problems.append(f"--attn_mode {args.attn_mode}: attention runs on PyTorch SDPA (torch / sdpa)")
    if args.prompt is None and args.from_file is None and not args.interactive:
        problems.append("give --prompt, --from_file or --interactive")
    loras = list(args.lora_weight or [])
    multipliers = list(args.lora_multiplier or [])
    if multipliers and len(multipliers) not in (1, len(loras)):
        problems.append(f"--lora_multiplier: {len(multipliers)} values for {len(loras)} --lora_weight files")
    try:
        options = ZIMAGE.options.from_args(args, training=False)
    except ConfigError as e:
        problems += e.problems
    if problems:
        raise ConfigError(problems)
    offload = args.offload or bool(args.blocks_to_swap)
    device = torch.device(args.device) if args.device else device_of_choice()
    parts = ZIMAGE.load(args.dit, vae=args.vae, device="cpu" if offload else device, options=options)
    if args.flow_shift is not None:
        parts.scheduler_config["static_shift"] = float(args.flow_shift)
    pairs = [(p, multipliers[i] if i < len(multipliers) else (multipliers[0] if multipliers else 1.0))
             for i, p in enumerate(loras)]  # fmt: skip
    networks = apply_adapter_files(pairs, ZIMAGE.adapter_roots(parts), False, device, log)
    height, width = args.image_size
    negative = args.negative_prompt or ""

    def spec_of(prompt: str) -> PromptSpec:
        return PromptSpec(prompt, negative_prompt=negative, width=width, height=height, steps=args.infer_steps,
                          scale=cfg_scale(args.guidance_scale))  # fmt: skip

    def generate(spec: PromptSpec, seed: int | None) -> Path:
        from library.sampling.generate import resolve

        seed = args.seed if seed is None else seed
        seed = random.randint(0, 2**32 - 1) if seed is None else seed
        spec = resolve(spec, ZIMAGE, parts)
        image = flow_image(ZIMAGE, parts, spec, seed, device, offload)
        return save_new_png(image, Path(args.save_path), spec, seed, Path(args.dit).name, log)

    if args.from_file is not None:
        lines = [x.strip() for x in Path(args.from_file).read_text(encoding="utf-8").splitlines() if x.strip()]
        return [generate(spec_of(line), None) for line in lines]
    if not args.interactive:
        return [generate(spec_of(args.prompt), None)]
    parse = lambda line, spec: apply_options(line, spec, networks, OPTIONS, negative, log)  # noqa: E731
    return prompt_loop(spec_of(args.prompt or ""), "Enter prompt (empty to exit).", parse, generate, log)


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
