"""HunyuanImage 2.1 text-to-image with LoRA: sd-scripts' hunyuan_image_minimal_inference.py command line over the
shared flow sampler (library/sampling/flow_generate.py, with adaptive projected guidance: library/sampling/guidance.py)
and networks.apply.

    python hunyuan_image_minimal_inference.py --dit hunyuanimage2.1.safetensors --text_encoder qwen_2.5_vl_7b.safetensors \
        --byt5 byt5_small_glyphxl_fp16.safetensors --vae hunyuan_image_2.1_vae_fp16.safetensors --lora_weight lora.safetensors \
        --lora_multiplier 1.0 --attn_mode torch --prompt "A cute cartoon penguin in a snowy landscape." \
        --image_size 2048 2048 --infer_steps 50 --guidance_scale 3.5 --flow_shift 5.0 --seed 542017 --save_path output_image.png

sd-scripts' sampler (``generate_body``): the static shift ``--flow_shift`` on ``linspace(1, 0, steps + 1)``, Euler
steps, the DiT given truncated integer timesteps, true CFG at ``--guidance_scale`` (with ``--guidance_rescale``) up to
step ``--apg_start_step_general`` (``--apg_start_step_ocr`` for a prompt with quoted text), then APG (scale 10, eta 0,
norm threshold 10, momentum -0.5; ``--guidance_rescale_apg``); ``--guidance_scale 1`` runs no negative prompt.
Differences on purpose: the noise is drawn in float32 and the Euler update accumulated in float32 (sd-scripts keeps
the latents in bf16 between steps); ``--save_path`` is a folder (sd-scripts' too: it writes
``<time>_<seed>.png`` into it).

Read with sd-scripts' meanings: ``--dit --vae --text_encoder --byt5``, ``--lora_weight`` / ``--lora_multiplier``
(``--lycoris`` accepted: LyCORIS files are read like any adapter file), ``--save_merged_model`` (the DiT with the
LoRA merged, Tencent's layout; nothing generated), ``--prompt --negative_prompt --image_size H W --infer_steps --seed``,
``--fp8`` / ``--fp8_scaled`` (the DiT's Linear weights in float8, plain or with a scale per weight, computed in
bf16), ``--text_encoder_cpu`` (the text encoders compute on the CPU), ``--device``, ``--attn_mode torch|sdpa``,
``--blocks_to_swap``, ``--output_type images|latent|latent_images``, ``--no_metadata``, ``--latent_path`` (decode
saved latents; needs only ``--vae``), ``--from_file`` / ``--interactive`` (per prompt ``--w --h --d --s --g --fs
--n``). ``--vae_chunk_size`` is accepted (the VAE runs whole: the same images). Refused with the reason:
``--include_patterns --exclude_patterns``, ``--attn_mode flash|sageattn|xformers``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from library.cli import deferred_imports
from library.cli.console import add_logging_args, console_logging
from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.families.hunyuan_image import HUNYUAN_IMAGE as FAMILY
from library.sampling.prompts import PromptSpec

log = logging.getLogger("hunyuan_image_minimal_inference")
REFUSED = {
    "include_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
    "exclude_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
}
PROMPT_OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "g": ("scale", float),
                  "l": ("scale", float)}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    parser.add_argument("--dit", type=str, default=None, help="HunyuanImage 2.1 DiT .safetensors (Tencent's)")
    parser.add_argument("--vae", type=str, default=None, help="HunyuanImage 2.1 VAE .safetensors")
    parser.add_argument("--text_encoder", type=str, required=True, help="Qwen2.5-VL-7B file or folder")
    parser.add_argument("--byt5", type=str, default=None, help="byT5-small Glyph .safetensors")
    g = parser.add_argument_group("image")
    g.add_argument("--lora_weight", type=str, nargs="*", default=None, help="LoRA files")
    g.add_argument("--lora_multiplier", type=float, nargs="*", default=None, help="their multipliers (default 1.0)")
    g.add_argument("--lycoris", action="store_true", help="accepted: LyCORIS files are read like any adapter file")
    g.add_argument("--save_merged_model", type=str, default=None, help="write the DiT with the LoRA merged; no image")
    g.add_argument("--guidance_scale", type=float, default=3.5, help="CFG scale before APG starts (default 3.5)")
    g.add_argument("--apg_start_step_ocr", type=int, default=38, help="last CFG step for prompts with quoted text")
    g.add_argument("--apg_start_step_general", type=int, default=5, help="last CFG step for other prompts")
    g.add_argument("--guidance_rescale", type=float, default=0.0, help="guidance rescale on CFG steps (0 to 1)")
    g.add_argument("--guidance_rescale_apg", type=float, default=0.0, help="guidance rescale on APG steps (0 to 1)")
    g.add_argument("--prompt", type=str, default=None)
    g.add_argument("--negative_prompt", type=str, default="")
    g.add_argument("--image_size", type=int, nargs=2, default=[2048, 2048], metavar=("H", "W"))
    g.add_argument("--infer_steps", type=int, default=50)
    g.add_argument("--save_path", type=str, required=True, help="folder for the images / latents")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--flow_shift", type=float, default=5.0, help="static shift of the Euler schedule (default 5.0)")
    g.add_argument("--fp8", action="store_true", help="the DiT's Linear weights in float8 (computed in bf16)")
    g.add_argument("--fp8_scaled", action="store_true", help="float8 with a scale per weight")
    g.add_argument("--text_encoder_cpu", action="store_true", help="run Qwen2.5-VL and byT5 on the CPU")
    g.add_argument("--vae_chunk_size", type=int, default=None, help="accepted; the VAE runs whole (same images)")
    g.add_argument("--device", type=str, default=None, help="default: CUDA, else MPS, else CPU")
    g.add_argument("--attn_mode", type=str, default="torch", choices=["flash", "torch", "sageattn", "xformers", "sdpa"])
    g.add_argument("--blocks_to_swap", type=int, default=0, help="DiT blocks kept on the host, moved in per forward")
    g.add_argument("--output_type", type=str, default="images", choices=["images", "latent", "latent_images"])
    g.add_argument("--no_metadata", action="store_true", help="no prompt / settings in the PNG or latent file")
    g.add_argument("--latent_path", type=str, nargs="*", default=None, help="decode these saved latents only")
    g.add_argument(
        "--from_file", type=str, default=None, help="one prompt per line (with --w --h --d --s --g --fs --n)"
    )
    g.add_argument("--interactive", action="store_true")
    for flag in REFUSED:
        g.add_argument(f"--{flag}", type=str, nargs="*", default=None, help=f"refused: {REFUSED[flag]}")
    return parser


@dataclasses.dataclass(frozen=True)
class Request:
    """One image: its settled prompt spec, seed and schedule shift."""

    spec: PromptSpec
    seed: int
    flow_shift: float


def parse_line(line: str, base: Request) -> Request:
    """sd-scripts' ``parse_prompt_line``: ``prompt --w 1024 --h 1024 --d 1 --s 50 --g 3.5 --fs 5 --n text``."""
    prompt, *options = line.split(" --")
    spec, seed, shift = dataclasses.replace(base.spec, prompt=prompt.strip()), None, base.flow_shift
    for option in options:
        key, _, value = option.strip().partition(" ")
        try:
            if key in PROMPT_OPTIONS:
                name, kind = PROMPT_OPTIONS[key]
                spec = dataclasses.replace(spec, **{name: kind(value)})
            elif key == "d":
                seed = int(value)
            elif key == "fs":
                shift = float(value)
            elif key == "n":
                spec = dataclasses.replace(spec, negative_prompt=value.strip())
            elif key:
                log.warning("unknown prompt option --%s (use --w --h --d --s --g --fs --n)", key)
        except ValueError as e:
            log.error("invalid prompt option --%s: %s", option.strip(), e)
    return Request(spec, random.randint(0, 2**32 - 1) if seed is None else seed, shift)


def problems_of(args: argparse.Namespace) -> list[str]:
    problems = [f"--{flag}: {why}" for flag, why in REFUSED.items() if getattr(args, flag)]
    if args.attn_mode in ("flash", "sageattn", "xformers"):
        problems.append(f"--attn_mode {args.attn_mode}: attention runs on PyTorch SDPA here; use --attn_mode torch")
    if args.from_file and args.interactive:
        problems.append("--from_file and --interactive cannot be used together")
    if args.latent_path:
        if not args.vae:
            problems.append("--latent_path needs --vae (the latents are decoded)")
    else:
        if args.prompt is None and not args.from_file and not args.interactive and not args.save_merged_model:
            problems.append("give --prompt, --from_file or --interactive")
        if not args.dit:
            problems.append("--dit: the HunyuanImage 2.1 DiT file is needed to generate")
    height, width = args.image_size
    if height % 32 or width % 32:
        problems.append(f"--image_size {height} {width}: both sides must be multiples of 32 (a 32x VAE)")
    if args.blocks_to_swap < 0:
        problems.append(f"--blocks_to_swap {args.blocks_to_swap}: must be >= 0")
    return problems


def save_latent(latent, args: argparse.Namespace, request: Request) -> Path:
    """``<save_path>/<time>_<seed>_latent.safetensors`` with sd-scripts' metadata (unless ``--no_metadata``)."""
    from library.files.weights import save_state_dict

    spec = request.spec
    stem = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]
    path = Path(args.save_path) / f"{stem}_{request.seed}_latent.safetensors"
    meta = None if args.no_metadata else {
        "seeds": str(request.seed), "prompt": spec.prompt, "height": str(spec.height), "width": str(spec.width),
        "infer_steps": str(spec.steps), "guidance_scale": str(spec.scale), "negative_prompt": spec.negative_prompt}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    save_state_dict({"latent": latent.contiguous().cpu()}, path, meta)
    log.info("saved %s", path)
    return path


def save_image(pixels, args: argparse.Namespace, request: Request, model: str) -> Path:
    from library.sampling.generate import to_pil
    from library.sampling.minimal import save_new_png

    image = to_pil(pixels)[0]
    if not args.no_metadata:
        return save_new_png(image, Path(args.save_path), request.spec, request.seed, model, log)
    path = Path(args.save_path) / f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S-%f')[:-3]}_{request.seed}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    log.info("saved %s", path)
    return path


def decode_saved(args: argparse.Namespace, device) -> list[Path]:
    """``--latent_path``: each saved latent decoded with ``--vae`` (its seed and size from its metadata)."""
    import torch

    from library.families.base import Parts
    from library.families.hunyuan_image.loading import load_vae
    from library.files.weights import load_state_dict

    vae = load_vae(Path(args.vae), torch.float16 if device.type == "cuda" else torch.float32, device)
    parts = Parts(None, vae, [], [], {}, FAMILY.name)
    written = []
    for path in args.latent_path:
        state, meta = load_state_dict(path)  # pickles with weights_only=True
        latent = state["latent"]
        spec = PromptSpec(meta.get("prompt", ""), width=latent.shape[-1] * 32, height=latent.shape[-2] * 32)
        request = Request(spec, int(meta.get("seeds", 0)), args.flow_shift)
        with torch.no_grad():
            pixels = FAMILY.decode_latents(parts, latent.view(1, *latent.shape[-3:]).to(device))
        written.append(save_image(pixels, args, request, Path(path).name))
    return written


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Run the script with ``argv``; returns the written image / latent / model paths."""
    import torch

    from library.device.fp8 import store_in_fp8
    from library.families.base import PartDtypes
    from library.families.hunyuan_image.options import HunyuanOptions
    from library.run.block_swap import BlockSwapConfig
    from library.run.setup import place_denoiser
    from library.sampling.flow_generate import encode_flow_prompts, resolve_flow, sample_flow_latents
    from library.sampling.minimal import device_of_choice, on_device, prompt_loop
    from networks.apply import apply_adapter_files

    args = build_parser().parse_args(argv)
    console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
    problems = problems_of(args)
    loras, multipliers = list(args.lora_weight or []), list(args.lora_multiplier or [])
    if multipliers and len(multipliers) not in (1, len(loras)):
        problems.append(f"--lora_multiplier: {len(multipliers)} values for {len(loras)} --lora_weight files")
    if problems:
        raise ConfigError(problems)
    device = torch.device(args.device) if args.device else device_of_choice()
    if args.vae_chunk_size:
        log.info("--vae_chunk_size: the VAE decodes each image whole here (the same image, more peak memory)")
    if args.latent_path:
        return decode_saved(args, device)
    options = HunyuanOptions(text_encoder=args.text_encoder, byt5=args.byt5)
    half = torch.bfloat16 if device.type != "cpu" else torch.float32
    parts = FAMILY.load(args.dit, dtype=PartDtypes(half, torch.float16 if device.type == "cuda" else half, half),
                        vae=args.vae, device="cpu", options=options)  # fmt: skip
    pairs = [(Path(p), multipliers[i] if i < len(multipliers) else (multipliers[0] if multipliers else 1.0))
             for i, p in enumerate(loras)]  # fmt: skip
    networks = apply_adapter_files(pairs, FAMILY.adapter_roots(parts), bool(args.save_merged_model), device, log)
    if args.save_merged_model:
        return [FAMILY.save(parts, args.save_merged_model)]
    if args.fp8 or args.fp8_scaled:
        count = store_in_fp8(parts.denoiser, half, skip=FAMILY.fp8_skip, scaled=args.fp8_scaled)
        log.info(
            "stored %d DiT Linear weights in float8%s", count, " with a scale per weight" if args.fp8_scaled else ""
        )
    parts.scheduler_config.update(apg_start_step_general=args.apg_start_step_general,
                                  apg_start_step_ocr=args.apg_start_step_ocr, guidance_rescale=args.guidance_rescale,
                                  guidance_rescale_apg=args.guidance_rescale_apg)  # fmt: skip
    te_device = torch.device("cpu") if args.text_encoder_cpu else device
    swapped = place_denoiser(parts.denoiser, FAMILY, BlockSwapConfig(args.blocks_to_swap), device) if (
        args.blocks_to_swap) else None  # fmt: skip
    model = Path(args.dit).name

    def generate(requests: list[Request]) -> list[Path]:
        """sd-scripts' batch order: every prompt encoded, then every image denoised, then every latent decoded."""
        with torch.no_grad():
            with on_device(parts.text_encoders, te_device, True):
                conds = [encode_flow_prompts(FAMILY, parts, [r.spec]) for r in requests]
            latents = []
            with on_device([parts.denoiser], device, swapped is None):
                for request, cond in zip(requests, conds):
                    parts.scheduler_config["shift"] = request.flow_shift
                    generator = torch.Generator("cpu").manual_seed(request.seed)
                    latents.append(sample_flow_latents(FAMILY, parts, [request.spec], cond, [generator]))
            written = []
            if args.output_type != "images":
                written += [save_latent(x, args, r) for x, r in zip(latents, requests)]
            if args.output_type != "latent":
                with on_device([parts.vae], device, True):
                    written += [save_image(FAMILY.decode_latents(parts, x.to(device)), args, r, model)
                                for x, r in zip(latents, requests)]  # fmt: skip
        return written

    height, width = args.image_size
    first = PromptSpec(args.prompt or "", negative_prompt=args.negative_prompt, width=width, height=height,
                       steps=args.infer_steps, scale=args.guidance_scale)  # fmt: skip
    seed = random.randint(0, 2**32 - 1) if args.seed is None else args.seed
    base = Request(resolve_flow(first, FAMILY, parts, size=2048), seed, args.flow_shift)
    if args.from_file is not None:
        lines = [x.strip() for x in Path(args.from_file).read_text(encoding="utf-8").splitlines()]
        return generate([parse_line(x, base) for x in lines if x and not x.startswith("#")])
    if not args.interactive:
        return generate([base])

    asked: list[Request] = []  # the request of the line being generated (its seed and shift)

    def parse(line: str, spec: PromptSpec) -> tuple[PromptSpec, int | None] | None:
        if not line.strip():
            return None
        asked.append(parse_line(line, base))
        return asked[-1].spec, asked[-1].seed

    del networks  # a live adapter stays on the model; --m is not one of this script's prompt options
    return prompt_loop(base.spec, "Enter prompt (empty to exit). Options: --w --h --d --s --g --fs --n", parse,
                       lambda spec, _: generate([asked[-1]])[-1], log)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
