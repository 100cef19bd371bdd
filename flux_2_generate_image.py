"""FLUX.2 (dev, klein) text-to-image with LoRA: musubi-tuner's flux_2_generate_image.py command line over
library/sampling/minimal.py (device, offloading, one flow image, its PNG, the interactive loop) and networks.apply.

    python flux_2_generate_image.py --model_version klein-base-4b --dit flux2-klein-base-4b.safetensors \
        --vae ae.safetensors --text_encoder model-00001-of-00002.safetensors --prompt "a cat" \
        --image_size 1024 1024 --seed 1 --save_path out --lora_weight my-lora.safetensors --lora_multiplier 1.0

Read with musubi-tuner's meanings: ``--dit --vae --text_encoder --model_version`` (default: read from the weights),
``--lora_weight`` / ``--lora_multiplier`` (kohya files of networks.lora_flux_2, LyCORIS files too: ``--lycoris``
accepted), ``--prompt --negative_prompt --image_size H W``, ``--infer_steps`` (default: musubi-tuner's per model, klein
4, base 50), ``--guidance_scale`` (true CFG of the base models, default 4.0; the distilled klein models run without
CFG, as musubi-tuner's ``denoise``), ``--embedded_cfg_scale`` (dev's embedded guidance, default 4.0),
``--flow_shift`` (a static shift), ``--seed --save_path`` (a folder), ``--from_file``, ``--interactive``,
``--device``, ``--attn_mode torch|sdpa``, ``--blocks_to_swap`` (read as ``--offload``). The schedule is FLUX.1's resolution-dependent shift, not musubi-tuner's empirical μ
(``compute_empirical_mu``): images differ at the same seed. Refused with the reason:
``--control_image_path`` (reference images), ``--fp8 --fp8_scaled --fp8_text_encoder``, ``--include_patterns
--exclude_patterns``, ``--output_type`` other than images, ``--latent_path``, ``--save_merged_model``,
``--no_metadata``, ``--sample_solver`` other than euler.
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
from library.families.flux2 import FLUX2
from library.sampling.minimal import apply_options, device_of_choice, flow_image, prompt_loop, save_new_png
from library.sampling.prompts import PromptSpec

log = logging.getLogger("flux_2_generate_image")
OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "c": ("scale", float)}
REFUSED_SWITCHES = {
    "fp8": "float8 storage is training's --fp8_base; inference runs in the weights' precision",
    "fp8_scaled": "scaled float8 weights are not supported yet",
    "fp8_fast": "scaled float8 weights are not supported yet",
    "fp8_text_encoder": "float8 text encoders are not supported yet",
    "cpu_noise": "the noise is drawn on the CPU with the seed already",
    "no_metadata": "the PNG info (prompt and settings) is always written",
    "vae_enable_tiling": "tiled VAE decoding is not done here",
    "use_pinned_memory_for_block_swap": "use --offload",
    "disable_numpy_memmap": "not read here",
}
REFUSED_VALUES = {
    "include_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
    "exclude_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
    "latent_path": "decoding saved latents is not supported",
    "save_merged_model": "saving the merged DiT is not done here; use networks/merge tools",
    "control_image_path": "reference images (FLUX.2's edit mode) are not supported yet",
    "ckpt_dir": "not read here",
    "num_layers": "a DiT with fewer blocks is read from its file's shapes",
    "video_path": "not read here",
    "image_path": "not read here",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    parser.add_argument("--dit", type=str, required=True, help="FLUX.2 DiT .safetensors (or a diffusers folder)")
    parser.add_argument("--vae", type=str, default=None, help="FLUX.2 AE (ae.safetensors)")
    g = parser.add_argument_group("image")
    g.add_argument("--lora_weight", type=str, nargs="*", default=None, help="LoRA files")
    g.add_argument("--lora_multiplier", type=float, nargs="*", default=None, help="their multipliers (default 1.0)")
    g.add_argument("--lycoris", action="store_true", help="accepted: LyCORIS files are read like any adapter file")
    g.add_argument("--guidance_scale", type=float, default=4.0, help="true CFG scale of the base models (default 4.0)")
    g.add_argument("--embedded_cfg_scale", type=float, default=4.0, help="dev's embedded guidance (default 4.0)")
    g.add_argument("--prompt", type=str, default=None)
    g.add_argument("--negative_prompt", type=str, default=None)
    g.add_argument("--image_size", type=int, nargs=2, default=[1024, 1024], metavar=("H", "W"))
    g.add_argument("--infer_steps", type=int, default=None, help="default: klein 4, base 50 (musubi-tuner)")
    g.add_argument("--save_path", type=str, required=True, help="folder for the images")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--flow_shift", type=float, default=None, help="a static shift (default: the dynamic shift)")
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
    FLUX2.options.add_args(parser, training=False)  # --text_encoder --model_version
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
        options = FLUX2.options.from_args(args, training=False)
    except ConfigError as e:
        problems += e.problems
    if problems:
        raise ConfigError(problems)
    offload = args.offload or bool(args.blocks_to_swap)
    device = torch.device(args.device) if args.device else device_of_choice()
    parts = FLUX2.load(args.dit, vae=args.vae, device="cpu" if offload else device, options=options)
    if args.flow_shift is not None:
        parts.scheduler_config["static_shift"] = float(args.flow_shift)
    pairs = [(p, multipliers[i] if i < len(multipliers) else (multipliers[0] if multipliers else 1.0))
             for i, p in enumerate(loras)]  # fmt: skip
    networks = apply_adapter_files(pairs, FLUX2.adapter_roots(parts), False, device, log)
    height, width = args.image_size
    negative = " " if args.negative_prompt is None else args.negative_prompt  # musubi-tuner's default for base
    distilled = bool(parts.scheduler_config.get("guidance_distilled"))
    steps = args.infer_steps or int(parts.scheduler_config["default_steps"])
    guidance = args.embedded_cfg_scale if parts.denoiser.config.guidance_embeds else None  # dev

    def spec_of(prompt: str) -> PromptSpec:
        return PromptSpec(prompt, negative_prompt=negative, width=width, height=height, steps=steps,
                          scale=1.0 if distilled else args.guidance_scale, guidance=guidance)  # fmt: skip

    def generate(spec: PromptSpec, seed: int | None) -> Path:
        from library.sampling.generate import resolve

        seed = args.seed if seed is None else seed
        seed = random.randint(0, 2**32 - 1) if seed is None else seed
        spec = resolve(spec, FLUX2, parts)
        image = flow_image(FLUX2, parts, spec, seed, device, offload)
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
