"""FLUX.1 dev / schnell and Chroma text-to-image with LoRA, with sd-scripts' ``flux_minimal_inference.py`` command line.

    python flux_minimal_inference.py --ckpt_path flux1-dev.safetensors --clip_l clip_l.safetensors \\
        --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors --prompt "a cat" --seed 1 --steps 28 \\
        --lora_weights "my_lora.safetensors;0.8" --output_dir out [--offload] [--flux_dtype fp8] [--interactive]

Every flag of sd-scripts' script is read: the model comes from our FLUX family (``library/families/flux``: a BFL
file with ``--clip_l --t5xxl --ae``, or a diffusers folder), the image from our flow-matching Euler sampler
(``library/sampling/flow*.py``, the same code as gen_img.py and samples during training), the LoRA from our adapter
code (``networks.inject``: any algorithm we read, kohya / LyCORIS files, live or merged). As in sd-scripts:

* ``--steps`` defaults to 4 for schnell and 50 otherwise; ``--guidance`` (3.5) is the embedded guidance of dev (noted
  and ignored by schnell / Chroma); true CFG runs only with a non-empty ``--negative_prompt`` and ``--cfg_scale`` not 1
  (``v = v_neg + cfg·(v_pos - v_neg)``); the default size is 1360 x 768.
* ``--dtype`` (bfloat16) is every part's dtype unless ``--clip_l_dtype`` / ``--t5xxl_dtype`` / ``--ae_dtype`` /
  ``--flux_dtype`` says otherwise; ``fp8`` / ``float8_e4m3fn`` stores a part's Linear / Conv2d weights in float8 and
  computes in bfloat16 (other float8 formats are refused: we store e4m3fn only).
* ``--offload`` loads every part to the CPU and moves each to the device only while it runs (text encoders, then
  the transformer, then the AE).
* ``--lora_weights path;multiplier`` (any algorithm we read); ``--merge_lora_weights`` bakes them into the weights,
  as do several files (live adapters cannot be stacked yet: their multipliers are then fixed, as gen_img.py's).
* ``--control_net_models a.safetensors [b ...] --guide_image_path img.png [img2 ...]
  [--control_net_multipliers 1.0 ...]``: FLUX ControlNets (flux_train_control_net.py's files, sd-scripts' / XLabs'
  ControlNetFlux keys) given a control image each (one image: all of them), resized to the generated size;
  sd-scripts has no FLUX ControlNet inference (only samples during training).
* ``--interactive`` reads prompts from stdin until an empty line, with sd-scripts' options ``--w --h --s --d --g
  --m --n (- for empty) --c``; width, height, steps, guidance and CFG scale carry over to the next prompt.

Differences on purpose: the noise comes from a CPU generator in float32 (the same image on every device; sd-scripts
draws on the device in the model dtype), sizes must be multiples of 16 (sd-scripts rounds up), the PNG carries its
prompt and settings, and an existing image is never overwritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from library.cli import deferred_imports
from library.cli.console import add_logging_args, console_logging
from library.cli.main_guard import main_guard
from library.cli.parse import guidance_problems
from library.cli.problems import ConfigError
from library.families.base import PartDtypes, Parts
from library.families.flux import FluxFamily
from library.families.flux.options import MODEL_TYPE_OF_FAMILY, FluxOptions
from library.families.protocol import ModelFamily
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

log = logging.getLogger("flux_minimal_inference")

DEFAULT_WIDTH, DEFAULT_HEIGHT = 1360, 768  # sd-scripts' target_width / target_height
SCHNELL_STEPS, DEV_STEPS = 4, 50
_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp8": torch.float8_e4m3fn, "float8": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn,
    "e4m3fn": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
}  # fmt: skip
_OTHER_FP8 = ("fp8_e4m3fnuz", "e4m3fnuz", "float8_e4m3fnuz", "fp8_e5m2", "e5m2", "float8_e5m2", "fp8_e5m2fnuz",
              "e5m2fnuz", "float8_e5m2fnuz")  # fmt: skip
FP8_COMPUTE = torch.bfloat16  # sd-scripts runs fp8 parts under bf16 autocast


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    g = parser.add_argument_group("model")
    g.add_argument("--ckpt_path", type=str, required=True, help="BFL transformer file or a diffusers folder")
    g.add_argument("--model_type", type=str, choices=["flux", "chroma"], default="flux", help="FLUX.1 or Chroma")
    g.add_argument("--clip_l", type=str, default=None, help="CLIP-L file (FLUX.1; not read for Chroma)")
    g.add_argument("--t5xxl", type=str, default=None, help="T5-XXL file")
    g.add_argument("--ae", type=str, default=None, help="AE file")
    g.add_argument("--apply_t5_attn_mask", action="store_true", help="mask T5's padding (Chroma: always)")
    g = parser.add_argument_group("image")
    g.add_argument("--prompt", type=str, default="A photo of a cat", help="prompt")
    g.add_argument("--negative_prompt", type=str, default=None, help="negative prompt (true CFG with --cfg_scale)")
    g.add_argument("--output_dir", type=str, default=".", help="folder of the PNG")
    g.add_argument("--seed", type=int, default=None, help="seed (default: random)")
    g.add_argument("--steps", type=int, default=None, help="steps (default: 4 for schnell, 50 otherwise)")
    g.add_argument("--guidance", type=float, default=3.5, help="embedded guidance (FLUX.1 dev)")
    g.add_argument("--cfg_scale", type=float, default=1.0, help="true CFG scale (with --negative_prompt)")
    g.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="width, a multiple of 16")
    g.add_argument("--height", type=int, default=DEFAULT_HEIGHT, help="height, a multiple of 16")
    g.add_argument("--interactive", action="store_true", help="read prompts with options from stdin")
    g = parser.add_argument_group("precision and memory")
    g.add_argument("--dtype", type=str, default="bfloat16", help="every part's dtype (bf16, fp16, fp32, fp8)")
    for part in ("clip_l", "ae", "t5xxl", "flux"):
        g.add_argument(f"--{part}_dtype", type=str, default=None, help=f"dtype of {part} (default: --dtype)")
    g.add_argument("--offload", action="store_true", help="keep the parts on the CPU, each on the device as it runs")
    g = parser.add_argument_group("LoRA")
    g.add_argument("--lora_weights", type=str, nargs="*", default=[], help="adapter files as path;multiplier")
    g.add_argument("--merge_lora_weights", action="store_true", help="merge the adapters into the model weights")
    g = parser.add_argument_group("ControlNet")
    g.add_argument("--control_net_models", type=str, nargs="*", default=[], help="FLUX ControlNet files")
    g.add_argument("--control_net_multipliers", type=float, nargs="*", default=None,
                   help="one strength per ControlNet (default 1.0)")  # fmt: skip
    g.add_argument("--guide_image_path", type=str, nargs="*", default=[],
                   help="the control image: one for every ControlNet, or one per ControlNet")  # fmt: skip
    return parser


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
    """The validated command line. Dtypes: ``fp8`` means float8 storage computed in bf16 (:data:`FP8_COMPUTE`)."""

    ckpt: Path
    model_type: str  # --model_type: flux or chroma
    files: dict  # load(...) keyword -> path: clip_l, t5xxl, ae
    apply_t5_attn_mask: bool
    spec: PromptSpec
    seed: int | None
    output_dir: Path
    interactive: bool
    dtypes: dict  # part -> torch.dtype: clip_l, t5xxl, ae, flux
    offload: bool
    loras: tuple[Lora, ...]
    merge: bool
    controls: tuple[tuple[str, float, str], ...] = ()  # (ControlNet file, multiplier, guide image)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InferenceConfig:
        """Every problem of the command line at once (``ConfigError``)."""
        problems: list[str] = []
        base = _dtype("--dtype", args.dtype, problems)
        dtypes = {p: _dtype(f"--{p}_dtype", getattr(args, f"{p}_dtype"), problems, base) for p in _PARTS}
        if not Path(args.ckpt_path).exists():
            problems.append(f"--ckpt_path {args.ckpt_path}: no such file or folder")
        files = {k: getattr(args, k) for k in ("clip_l", "t5xxl", "ae") if getattr(args, k)}
        for flag, path in files.items():
            if not Path(path).is_file():
                problems.append(f"--{flag} {path}: no such file")
        loras = tuple(parse_lora(value, problems) for value in args.lora_weights)
        for flag in ("steps", "width", "height"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                problems.append(f"--{flag} must be >= 1, got {value}")
        problems += guidance_problems("--guidance", args.guidance)
        controls = _controls(args, problems)
        if problems:
            raise ConfigError(problems)
        if MODEL_TYPE_OF_FAMILY.get("chroma") == args.model_type and "clip_l" in files:
            log.info("--clip_l %s is not read: Chroma has no CLIP-L (as sd-scripts)", files.pop("clip_l"))
        spec = PromptSpec(args.prompt, negative_prompt=args.negative_prompt or "", width=args.width, height=args.height,
                          steps=args.steps, scale=args.cfg_scale, guidance=args.guidance)  # fmt: skip
        return cls(
            ckpt=Path(args.ckpt_path), model_type=args.model_type, files=files, apply_t5_attn_mask=args.apply_t5_attn_mask,
            spec=spec, seed=args.seed, output_dir=Path(args.output_dir), interactive=args.interactive,
            dtypes=dtypes, offload=args.offload, loras=tuple(x for x in loras if x is not None),
            merge=args.merge_lora_weights, controls=controls,
        )  # fmt: skip


def _controls(args: argparse.Namespace, problems: list[str]) -> tuple[tuple[str, float, str], ...]:
    """``--control_net_models`` with their multipliers and guide images; every problem named by its flag."""
    models, images = args.control_net_models, args.guide_image_path
    mults = args.control_net_multipliers if args.control_net_multipliers is not None else [1.0] * len(models)
    if not models:
        for flag, given in (
            ("--control_net_multipliers", args.control_net_multipliers),
            ("--guide_image_path", images),
        ):
            if given:
                problems.append(f"{flag} without --control_net_models: give the FLUX ControlNet file(s)")
        return ()
    if len(mults) != len(models):
        problems.append(f"--control_net_multipliers: {len(mults)} value(s) for {len(models)} ControlNet(s)")
    if len(images) not in (1, len(models)):
        problems.append(f"--guide_image_path: give one control image, or one per ControlNet ({len(models)}); "
                        f"got {len(images)}")  # fmt: skip
    for flag, paths in (("--control_net_models", models), ("--guide_image_path", images)):
        problems += [f"{flag} {p}: no such file" for p in paths if not Path(p).is_file()]
    images = images * len(models) if len(images) == 1 else images
    return tuple(zip(models, mults, images)) if len(mults) == len(models) == len(images) else ()


_PARTS = ("clip_l", "t5xxl", "ae", "flux")


def _dtype(flag: str, value: str | None, problems: list[str], default: torch.dtype | None = None) -> torch.dtype:
    if value is None:
        return default or torch.bfloat16
    if value in _DTYPES:
        return _DTYPES[value]
    if value in _OTHER_FP8:
        problems.append(f"{flag} {value}: only float8_e4m3fn storage is supported (use fp8 / float8_e4m3fn)")
    else:
        problems.append(f"{flag} {value}: use one of bf16, fp16, fp32, fp8 (or their long names)")
    return torch.bfloat16


# ----------------------------------------------------------------------------------------------------------------------
# Loading


def load_model(cfg: InferenceConfig, device: torch.device) -> tuple[ModelFamily, Parts]:
    """The family (detected from the weights, checked against ``--model_type``) and its parts in the asked dtypes,
    on the CPU with ``--offload``, else on ``device``; fp8 parts store their Linear / Conv2d weights in float8."""
    from library.families import detect_family

    family = detect_family(cfg.ckpt)
    if not isinstance(family, FluxFamily):
        raise ValueError(f"--ckpt_path {cfg.ckpt}: a {family.name} model; this script samples FLUX.1 / Chroma only "
                         "(use gen_img.py)")  # fmt: skip
    model_type = MODEL_TYPE_OF_FAMILY[family.name]
    if model_type != cfg.model_type:
        raise ValueError(f"--ckpt_path {cfg.ckpt} holds a {family.name} model but --model_type is "
                         f"{cfg.model_type}: pass --model_type {model_type}")  # fmt: skip
    loaded = {p: FP8_COMPUTE if d.itemsize == 1 else d for p, d in cfg.dtypes.items()}
    names = encoder_names(family)
    te = loaded[names[0]] if len(names) == 1 else _widest(*(loaded[n] for n in names))
    dtypes = PartDtypes(denoiser=loaded["flux"], vae=loaded["ae"], text_encoders=te)
    options = FluxOptions(**cfg.files, apply_t5_attn_mask=cfg.apply_t5_attn_mask)
    parts = family.load(cfg.ckpt, dtype=dtypes, device="cpu" if cfg.offload else device, options=options)
    for name, encoder in zip(names, parts.text_encoders):
        encoder.to(loaded[name])
    return family, parts


def encoder_names(family: ModelFamily) -> tuple[str, ...]:
    """The text encoders' flag names (``clip_l``, ``t5xxl``; Chroma: ``t5xxl``), in ``Parts.text_encoders`` order."""
    return tuple(te.ti_key for te in family.spec.text_encoders)


def _widest(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if a.itemsize >= b.itemsize else b


def store_fp8_parts(cfg: InferenceConfig, family: ModelFamily, parts: Parts) -> None:
    """float8 storage for the parts whose dtype is fp8 (after merging, so merged LoRAs are stored once)."""
    from library.device.fp8 import store_in_fp8

    modules = {"flux": parts.denoiser, "ae": parts.vae}
    modules.update(zip(encoder_names(family), parts.text_encoders))
    for name, module in modules.items():
        if cfg.dtypes[name].itemsize == 1:
            count = store_in_fp8(module, FP8_COMPUTE, skip=family.fp8_skip if name == "flux" else ("norm",))
            log.info("%s: %d Linear / Conv2d weights stored in float8_e4m3fn, computed in bf16", name, count)


def apply_loras(cfg: Any, family: ModelFamily, parts: Parts, device: torch.device) -> list[Any]:
    """The ``--lora_weights`` files at their multipliers (``networks.apply``: merged with ``--merge_lora_weights`` or
    when there are several, else one live adapter on ``device``). Returns the live networks."""
    from networks.apply import apply_adapter_files

    files = [(lora.path, lora.multiplier) for lora in cfg.loras]
    return apply_adapter_files(files, family.adapter_roots(parts), cfg.merge, device, log)


def load_controlnets(cfg: InferenceConfig, parts: Parts, device: torch.device) -> list[tuple[Any, str]]:
    """The ``--control_net_models`` on the transformer (in its compute dtype, on ``device``), each with its guide
    image path."""
    from library.families.flux.controlnet_trainable import FluxControlNet

    dtype = FP8_COMPUTE if cfg.dtypes["flux"].itemsize == 1 else cfg.dtypes["flux"]
    nets = []
    for path, multiplier, image in cfg.controls:
        net = FluxControlNet.from_file(parts.denoiser, path, multiplier=multiplier).to(device=device, dtype=dtype)
        log.info("ControlNet %s (multiplier %s) with the control image %s", path, multiplier, image)
        nets.append((net.eval(), image))
    return nets


# ----------------------------------------------------------------------------------------------------------------------
# Generation


def settle(spec: PromptSpec, family: ModelFamily, parts: Parts) -> PromptSpec:
    """sd-scripts' rules on top of the sampler's: steps 4 (schnell) / 50; CFG only with a non-empty negative prompt
    and a scale other than 1 (else the scale is 1 and the negative prompt unused); ``--guidance`` only where the
    model has an embedded guidance input (schnell and Chroma ignore it silently, as sd-scripts' models do)."""
    from library.sampling.generate import resolve

    steps = spec.steps or (SCHNELL_STEPS if family.name == "flux-schnell" else DEV_STEPS)
    scale = spec.scale if spec.scale is not None else 1.0
    if scale != 1.0 and not spec.negative_prompt:
        log.info("--cfg_scale %s needs a --negative_prompt (as sd-scripts): sampling without CFG", scale)
        scale = 1.0
    guidance = spec.guidance if family.flow_sampling(parts).embedded_guidance else None  # sd-scripts: unread there
    spec = dataclasses.replace(spec, steps=steps, scale=scale, negative_prompt=spec.negative_prompt or "",
                               guidance=guidance)  # fmt: skip
    return resolve(spec, family, parts)


def generate_image(
    cfg: InferenceConfig,
    family: ModelFamily,
    parts: Parts,
    spec: PromptSpec,
    seed: int | None,
    device: torch.device,
    controlnets: Sequence[tuple[Any, str]] = (),
) -> Path:
    """One image of ``spec`` (:func:`settle`) with ``seed`` (None: random), saved as a PNG; returns its path.
    ``controlnets``: (ControlNet, guide image path) pairs, the image resized to the spec's size."""
    from library.families.flux.controlnet import guide_image

    seed = seed if seed is not None else random.randint(0, 2**32 - 1)
    spec = settle(spec, family, parts)
    for net, image in controlnets:
        net.use_guide_image(guide_image(image, spec.width, spec.height))
    log.info("seed %d, %dx%d, %d steps, guidance %s, CFG %s", seed, spec.width, spec.height, spec.steps,
             spec.guidance, spec.scale)  # fmt: skip
    image = flow_image(family, parts, spec, seed, device, cfg.offload)
    return save_new_png(image, cfg.output_dir, spec, seed, cfg.ckpt.name, log)


def interactive_options(line: str, spec: PromptSpec, networks: list[Any]) -> tuple[PromptSpec, int | None] | None:
    """One interactive line (sd-scripts' options) applied to the previous ``spec``: the new spec and its seed, or
    None for an empty line (the end). ``--m a,b`` sets the live networks' multipliers; a bad option is logged and
    skipped, as sd-scripts does."""
    return apply_options(line, spec, networks, OPTIONS, "", log)


OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "g": ("guidance", float),
           "c": ("scale", float)}  # fmt: skip
PROMPT_HELP = (
    "Enter prompt (empty to exit). Options: --w <width> --h <height> --s <steps> --d <seed> --g <guidance> "
    "--m <multipliers for LoRA> --n <negative prompt>, `-` for empty negative prompt --c <cfg_scale>"
)


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Run the script with ``argv`` (default: the command line); returns the written image paths."""
    args = build_parser().parse_args(argv)
    console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
    cfg = InferenceConfig.from_args(args)
    device = device_of_choice()
    family, parts = load_model(cfg, device)
    networks = apply_loras(cfg, family, parts, device)
    store_fp8_parts(cfg, family, parts)
    controlnets = load_controlnets(cfg, parts, device)
    if not cfg.interactive:
        return [generate_image(cfg, family, parts, cfg.spec, cfg.seed, device, controlnets)]
    return prompt_loop(
        cfg.spec,
        PROMPT_HELP,
        lambda line, spec: interactive_options(line, spec, networks),
        lambda spec, seed: generate_image(cfg, family, parts, spec, seed, device, controlnets),
        log,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
