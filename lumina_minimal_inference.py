"""Lumina Image 2.0 text-to-image with LoRA: sd-scripts' lumina_minimal_inference.py, composed from
library/sampling/minimal.py (device, offloading, the PNG) and networks.apply.

    python lumina_minimal_inference.py --pretrained_model_name_or_path lumina_2_model_bf16.safetensors \
        --gemma2_path gemma_2_2b_fp16.safetensors --ae_path ae.safetensors --output_dir out --offload --seed 1234 \
        --prompt "Positive prompt" --system_prompt "You are an assistant ..." --negative_prompt "negative prompt"

sd-scripts' flags with their meaning: the image (``--image_width --image_height --steps`` 36 ``--guidance_scale``
3.5 ``--seed``), the schedule (``--discrete_flow_shift`` 6.0: ``FlowMatchEulerDiscreteScheduler(shift)``), CFG
truncation (``--cfg_trunc_ratio`` 0.25: the negative prompt runs, and CFG applies, while the model time 1 − σ is below
it) and renormalisation (``--renorm_cfg`` 1.0: the guided prediction's norm is capped at that times the conditional
one; 0 off), the prompts (``--system_prompt``, kept off the negative prompt unless
``--add_system_prompt_to_negative_prompt``; ``--gemma2_max_token_length``), dtypes per part (``--dtype
--gemma2_dtype --ae_dtype``: bf16, fp16, float), ``--device --offload``, ``--lora_weights path;multiplier``
(``--merge_lora_weights``), ``--interactive`` (``--w --h --s --d --g --n --ctr --rcfg --m`` per prompt) and
``--use_flash_attn / --use_sage_attn`` (refused without their package). Gemma's tokenizer is read from the folder of
``--gemma2_path`` or ``--tokenizer_cache_dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from library.cli import deferred_imports
from library.cli.console import add_logging_args, console_logging
from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.sampling.minimal import device_of_choice, on_device, parse_lora, save_new_png, set_multipliers
from library.sampling.prompts import PromptSpec

log = logging.getLogger("lumina_minimal_inference")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "float": torch.float32, "fp32": torch.float32, "float32": torch.float32}  # fmt: skip
PACKAGES = {"use_flash_attn": "flash_attn", "use_sage_attn": "sageattention"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    parser.add_argument("--pretrained_model_name_or_path", type=str, required=True,
                        help="Lumina 2 transformer (Alpha-VLLM .safetensors) or a diffusers Lumina2 folder")  # fmt: skip
    parser.add_argument("--gemma2_path", type=str, default=None, help="Gemma-2-2B .safetensors (or folder)")
    parser.add_argument("--ae_path", type=str, default=None, help="the FLUX AE .safetensors")
    parser.add_argument("--tokenizer_cache_dir", type=str, default=None,
                        help="a folder holding google_gemma-2-2b/tokenizer.json (Gemma's tokenizer is gated)")  # fmt: skip
    g = parser.add_argument_group("image")
    g.add_argument("--prompt", type=str, default="A beautiful sunset over the mountains")
    g.add_argument("--negative_prompt", type=str, default="")
    g.add_argument("--output_dir", type=str, default="outputs")
    g.add_argument("--seed", type=int, default=None, help="seed (default: random)")
    g.add_argument("--steps", type=int, default=36)
    g.add_argument("--guidance_scale", type=float, default=3.5)
    g.add_argument("--image_width", type=int, default=1024)
    g.add_argument("--image_height", type=int, default=1024)
    g.add_argument("--dtype", type=str, default="bf16", choices=sorted(DTYPES), help="the transformer's dtype")
    g.add_argument("--gemma2_dtype", type=str, default="bf16", choices=sorted(DTYPES))
    g.add_argument("--ae_dtype", type=str, default="bf16", choices=sorted(DTYPES))
    g.add_argument("--device", type=str, default=None, help="e.g. cuda:0 (default: CUDA, else MPS, else CPU)")
    g.add_argument("--offload", action="store_true", help="each part on the device only while it runs")
    g.add_argument("--system_prompt", type=str, default="")
    g.add_argument("--add_system_prompt_to_negative_prompt", action="store_true")
    g.add_argument("--gemma2_max_token_length", type=int, default=256)
    g.add_argument("--discrete_flow_shift", type=float, default=6.0)
    g.add_argument("--cfg_trunc_ratio", type=float, default=0.25,
                   help="CFG while the model time 1 - sigma is below this (0.25: the first quarter)")  # fmt: skip
    g.add_argument("--renorm_cfg", type=float, default=1.0, help="cap of the guided norm over the conditional; 0: off")
    g.add_argument("--use_flash_attn", action="store_true", help="needs flash_attn (attention runs through SDPA)")
    g.add_argument("--use_sage_attn", action="store_true", help="needs sageattention (attention runs through SDPA)")
    g.add_argument("--lora_weights", type=str, nargs="*", default=[], help="adapter files as path;multiplier")
    g.add_argument("--merge_lora_weights", action="store_true", help="merge the adapters into the weights")
    g.add_argument("--interactive", action="store_true",
                   help="read prompts with --w --h --s --d --g --n --ctr --rcfg --m")  # fmt: skip
    return parser


@dataclass(frozen=True)
class Request:
    """One image: the prompt and the settings an interactive line may change."""

    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    scale: float
    cfg_trunc_ratio: float
    renorm_cfg: float
    seed: int | None = None


def lumina_latents(family, parts, cond, uncond, request: Request, shift: float, generator) -> torch.Tensor:
    """sd-scripts' Lumina denoising (``lumina_train_util.denoise``): ``FlowMatchEulerDiscreteScheduler(shift)``
    levels, Euler steps on the velocity (``family.predict``), CFG while 1 − σ < ``cfg_trunc_ratio`` with the
    renormalisation ``renorm_cfg`` (``flow.with_truncated_cfg``)."""
    from library.sampling.flow import discrete_flow_sigmas, latent_noise, sample_euler, with_truncated_cfg
    from library.sampling.flow_generate import cat_conds, flow_velocity

    device = next(parts.denoiser.parameters()).device
    x = latent_noise([generator], request.height, request.width).to(device)
    cond, uncond = cond.to(device), uncond.to(device)
    both = flow_velocity(family, parts, cat_conds(uncond, cond), guidance=None)  # [negative; prompt]
    alone = flow_velocity(family, parts, cond, guidance=None)
    velocity = with_truncated_cfg(both, alone, request.scale, request.cfg_trunc_ratio, request.renorm_cfg)
    return sample_euler(velocity, x, discrete_flow_sigmas(request.steps, shift))


def parse_line(line: str, current: Request, negative: str, networks: list) -> Request | None:
    """An interactive line (sd-scripts' options, each ``--key value``); None for ``exit``."""
    if line.strip().lower() == "exit":
        return None
    prompt, *options = line.split("--")
    request = dataclasses.replace(current, prompt=prompt.strip(), negative_prompt=negative, seed=None)
    fields = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "d": ("seed", int),
              "g": ("scale", float), "ctr": ("cfg_trunc_ratio", float), "rcfg": ("renorm_cfg", float)}  # fmt: skip
    for option in options:
        key, value = ([*option.strip().split(None, 1), ""])[:2]
        try:
            if key in fields:
                name, kind = fields[key]
                request = dataclasses.replace(request, **{name: kind(value)})
            elif key == "n":
                request = dataclasses.replace(request, negative_prompt="" if value.strip() == "-" else value.strip())
            elif key == "m":
                set_multipliers(networks, [float(x) for x in value.split(",")])
            else:
                log.warning("unknown option --%s (use --w --h --s --d --g --n --ctr --rcfg --m)", key)
        except ValueError as e:
            log.error("invalid value for option --%s: %r (%s)", key, value, e)
    return request


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Run the script with ``argv``; returns the written image paths."""
    import importlib.util

    from library.families import detect_family
    from library.families.base import PartDtypes
    from library.families.lumina.options import LuminaOptions
    from library.sampling.generate import to_pil
    from networks.apply import apply_adapter_files

    args = build_parser().parse_args(argv)
    console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
    problems: list[str] = []
    loras = [lora for lora in (parse_lora(v, problems) for v in args.lora_weights) if lora is not None]
    problems += [f"--{flag} needs the {package} package, which is not installed; install it or drop the flag"
                 for flag, package in PACKAGES.items()
                 if getattr(args, flag) and importlib.util.find_spec(package) is None]  # fmt: skip
    if args.gemma2_max_token_length < 1 or args.gemma2_max_token_length % 8:
        problems.append(f"--gemma2_max_token_length {args.gemma2_max_token_length}: must be a positive multiple of 8")
    family = detect_family(args.pretrained_model_name_or_path)
    if family.name != "lumina2":
        problems.append(f"--pretrained_model_name_or_path {args.pretrained_model_name_or_path}: a {family.spec.title} "
                        "model; lumina_minimal_inference.py generates with Lumina Image 2.0")  # fmt: skip
    if problems:
        raise ConfigError(problems)
    device = torch.device(args.device) if args.device else device_of_choice()
    options = LuminaOptions(gemma2=args.gemma2_path, ae=args.ae_path, system_prompt=args.system_prompt,
                            gemma2_max_token_length=args.gemma2_max_token_length)  # fmt: skip
    dtypes = PartDtypes(DTYPES[args.dtype], DTYPES[args.ae_dtype], DTYPES[args.gemma2_dtype])
    parts = family.load(args.pretrained_model_name_or_path, dtype=dtypes, device="cpu" if args.offload else device,
                        tokenizer_cache_dir=args.tokenizer_cache_dir, options=options)  # fmt: skip
    networks = apply_adapter_files([(x.path, x.multiplier) for x in loras], family.adapter_roots(parts),
                                   args.merge_lora_weights, device, log)  # fmt: skip

    def generate(request: Request) -> Path:
        seed = random.randint(0, 2**32 - 1) if request.seed is None else request.seed
        with torch.no_grad():
            with on_device(parts.text_encoders, device, args.offload):
                cond = family.encode_prompt(parts, [request.prompt])
                negative = not args.add_system_prompt_to_negative_prompt
                tokens = family.tokenize(parts, [request.negative_prompt], negative=negative)
                uncond = family.encode_tokens(parts, tokens)
            with on_device([parts.denoiser], device, args.offload):
                generator = torch.Generator("cpu").manual_seed(seed)
                latents = lumina_latents(family, parts, cond, uncond, request, args.discrete_flow_shift, generator)
            with on_device([parts.vae], device, args.offload):
                vae_device = next(parts.vae.parameters()).device
                pixels = family.decode_latents(parts, latents.to(vae_device))
        spec = PromptSpec(request.prompt, negative_prompt=request.negative_prompt, width=request.width,
                          height=request.height, steps=request.steps, scale=request.scale)  # fmt: skip
        name = Path(args.pretrained_model_name_or_path).name
        return save_new_png(to_pil(pixels)[0], Path(args.output_dir), spec, seed, name, log)

    first = Request(args.prompt, args.negative_prompt, args.image_width, args.image_height, args.steps,
                    args.guidance_scale, args.cfg_trunc_ratio, args.renorm_cfg, args.seed)  # fmt: skip
    if not args.interactive:
        return [generate(first)]
    written, current = [], first
    while True:
        print("\nEnter prompt (or 'exit'). Options: --w <int> --h <int> --s <int> --d <int> --g <float> --n <str> "
              "--ctr <float> --rcfg <float> --m <m1,m2...>")  # fmt: skip
        try:
            line = input()
        except EOFError:
            break
        if not line.strip():
            continue
        request = parse_line(line, current, args.negative_prompt, networks)
        if request is None:
            break
        current = request
        written.append(generate(request))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
