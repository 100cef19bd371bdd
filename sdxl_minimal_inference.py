"""SDXL text-to-image with LoRA, with sd-scripts' ``sdxl_minimal_inference.py`` command line (its 7 flags).

    python sdxl_minimal_inference.py --ckpt_path sdxl.safetensors --prompt "a photo of a cat" \\
        --prompt2 "a cat, detailed" --negative_prompt "blurry" --lora_weights "my_lora.safetensors;0.8" \\
        --output_dir out [--interactive]

As sd-scripts' script: 1024 x 1024 (size conditioning: the same original size, crop 0, 0), 50 steps of the Euler
sampler on the model's DDPM schedule, CFG scale 7 with the negative prompt, a random seed; the settings are the
constants below (sd-scripts: "change here to change image generation conditions"). ``--prompt2`` is what the second
text encoder (OpenCLIP-bigG) reads (default ``--prompt``); ``--lora_weights path;multiplier`` (any adapter
algorithm we read) are merged into the weights; ``--interactive`` asks for prompt, prompt2 (empty: the prompt),
negative prompt and seed (empty: random) until an empty prompt. The model comes from our SDXL family (a single file
or a diffusers folder), the image from the family's diffusers pipeline, as gen_img.py / sdxl_gen_img.py.

Differences on purpose: sd-scripts' script never passes ``--prompt2`` to the second encoder (a bug: both read the
first prompt); the model runs in float16 on CUDA and in float32 elsewhere (sd-scripts: float16 everywhere); the
noise comes from a CPU generator (the same image on every device); the PNG carries its prompt and settings and no
image is overwritten.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from library.cli import deferred_imports
from library.cli.console import add_logging_args, console_logging
from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.families.base import Parts
from library.families.protocol import ModelFamily
from library.sampling.minimal import device_of_choice, parse_lora, save_new_png
from library.sampling.prompts import PromptSpec

log = logging.getLogger("sdxl_minimal_inference")

TARGET_SIZE = 1024  # sd-scripts' target_height / target_width (and the original size of the size conditioning)
STEPS = 50
GUIDANCE_SCALE = 7.0
SAMPLER = "euler"  # sd-scripts: EulerDiscreteScheduler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    parser.add_argument("--ckpt_path", type=str, required=True, help="SDXL single file or diffusers folder")
    parser.add_argument("--prompt", type=str, default="A photo of a cat", help="prompt")
    parser.add_argument(
        "--prompt2", type=str, default=None, help="prompt of the second text encoder (default --prompt)"
    )
    parser.add_argument("--negative_prompt", type=str, default="", help="negative prompt")
    parser.add_argument("--output_dir", type=str, default=".", help="folder of the PNG")
    parser.add_argument("--lora_weights", type=str, nargs="*", default=[], help="adapter files as path;multiplier")
    parser.add_argument("--interactive", action="store_true", help="ask for prompts, negative prompt and seed")
    return parser


def load_model(ckpt: Path, device: torch.device) -> tuple[ModelFamily, Parts]:
    """The SDXL family's parts from ``ckpt`` on ``device`` (float16 on CUDA, else float32; the VAE in float32)."""
    from library.families import detect_family

    family = detect_family(ckpt)
    if family.name != "sdxl":
        raise ValueError(f"--ckpt_path {ckpt}: a {family.name} model; this script samples SDXL only (use gen_img.py)")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    parts = family.load(ckpt, dtype=dtype, device=str(device))
    parts.vae.to(dtype=torch.float32)
    return family, parts


def encode(family: ModelFamily, parts: Parts, texts: list[str], texts2: list[str]):
    """Conditioning with ``texts`` for the first text encoder and ``texts2`` for the second (hidden states of both,
    the second's pooled output)."""
    tokens = [family.tokenize(parts, texts)[0], family.tokenize(parts, texts2)[1]]
    return family.encode_tokens(parts, tokens)


@torch.no_grad()
def generate_image(family: ModelFamily, parts: Parts, prompt: str, prompt2: str, negative: str, seed: int,
                   output_dir: Path, model: str) -> Path:  # fmt: skip
    """One image, saved as a PNG; returns its path."""
    from library.sampling.generate import to_pil
    from library.sampling.schedulers import make_scheduler

    pipe = family.pipeline(parts, make_scheduler(SAMPLER, parts.scheduler_config))
    pipe.set_progress_bar_config(disable=True)
    cond = encode(family, parts, [prompt, negative], [prompt2, negative])
    latents = pipe(
        prompt_embeds=cond.hidden_states[:1], negative_prompt_embeds=cond.hidden_states[1:],
        pooled_prompt_embeds=cond.pooled[:1], negative_pooled_prompt_embeds=cond.pooled[1:],
        height=TARGET_SIZE, width=TARGET_SIZE, num_inference_steps=STEPS, guidance_scale=GUIDANCE_SCALE,
        original_size=(TARGET_SIZE, TARGET_SIZE), crops_coords_top_left=(0, 0),
        generator=[torch.Generator("cpu").manual_seed(seed)], output_type="latent",
    ).images  # fmt: skip
    image = to_pil(family.decode_latents(parts, latents.to(torch.float32)))[0]
    spec = PromptSpec(prompt, negative_prompt=negative, width=TARGET_SIZE, height=TARGET_SIZE, steps=STEPS,
                      scale=GUIDANCE_SCALE, sampler=SAMPLER)  # fmt: skip
    log.info("seed %d, prompt2 %r", seed, prompt2)
    return save_new_png(image, output_dir, spec, seed, model, log)


def ask(question: str) -> str | None:
    """One line from stdin (None at the end of input)."""
    try:
        return input(question)
    except EOFError:
        return None


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Run the script with ``argv`` (default: the command line); returns the written image paths."""
    args = build_parser().parse_args(argv)
    console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
    problems: list[str] = []
    loras = [parse_lora(value, problems) for value in args.lora_weights]
    if not Path(args.ckpt_path).exists():
        problems.append(f"--ckpt_path {args.ckpt_path}: no such file or folder")
    if problems:
        raise ConfigError(problems)
    device = device_of_choice()
    family, parts = load_model(Path(args.ckpt_path), device)
    from networks.apply import apply_adapter_files

    files = [(lora.path, lora.multiplier) for lora in loras if lora is not None]
    apply_adapter_files(files, family.adapter_roots(parts), True, device, log)  # merged, as sd-scripts
    out, model = Path(args.output_dir), Path(args.ckpt_path).name
    if not args.interactive:
        seed = random.randint(0, 2**32 - 1)
        return [generate_image(family, parts, args.prompt, args.prompt2 or args.prompt, args.negative_prompt, seed,
                               out, model)]  # fmt: skip
    written = []
    while prompt := ask("prompt: "):
        prompt2 = ask("prompt2: ") or prompt
        negative = ask("negative prompt: ") or ""
        seed_text = (ask("seed: ") or "").strip()
        if seed_text and not seed_text.isdigit():
            log.warning("seed %r is not a number; skipped", seed_text)
            continue
        seed = int(seed_text) if seed_text else random.randint(0, 2**32 - 1)
        written.append(generate_image(family, parts, prompt, prompt2, negative, seed, out, model))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
