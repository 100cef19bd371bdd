"""What the minimal inference scripts share (flux_minimal_inference.py, sd3_minimal_inference.py): the device, moving
parts on and off it (``--offload``), one flow-matching image from a settled prompt, its PNG, and sd-scripts'
interactive prompt options."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.families.base import Parts
from library.families.protocol import ModelFamily
from library.sampling.prompts import PromptSpec


def device_of_choice() -> torch.device:
    """sd-scripts' ``get_preferred_device``: CUDA, else MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@contextlib.contextmanager
def on_device(modules: Sequence[torch.nn.Module], device: torch.device, offload: bool) -> Iterator[None]:
    """With ``offload``: ``modules`` on ``device`` inside the block, back on the CPU after it; else nothing moves."""
    if offload:
        for module in modules:
            module.to(device)
    try:
        yield
    finally:
        if offload:
            for module in modules:
                module.to("cpu")
            if device.type == "cuda":
                torch.cuda.empty_cache()


def set_multipliers(networks: list[Any], values: list[float]) -> None:
    """``--m``: one multiplier per live network; ValueError when the count differs (merged networks are fixed)."""
    if len(values) != len(networks):
        raise ValueError(f"{len(values)} multiplier(s) for {len(networks)} live network(s) (merged networks "
                         "cannot change their multiplier)")  # fmt: skip
    for network, value in zip(networks, values):
        network.set_multiplier(value)


def flow_image(
    family: ModelFamily, parts: Parts, spec: PromptSpec, seed: int, device: torch.device, offload: bool
) -> Any:
    """One PIL image of the settled ``spec``: encode, sample (the flow Euler sampler, CPU generator seeded with
    ``seed``) and decode, each part on ``device`` only for its step with ``offload``."""
    from library.sampling.flow_generate import encode_flow_prompts, sample_flow_latents
    from library.sampling.generate import to_pil

    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.no_grad():
        with on_device(parts.text_encoders, device, offload):
            cond = encode_flow_prompts(family, parts, [spec])
        with on_device([parts.denoiser], device, offload):
            latents = sample_flow_latents(family, parts, [spec], cond, [generator])
        with on_device([parts.vae], device, offload):
            vae_device = next(parts.vae.parameters()).device
            pixels = family.decode_latents(parts, latents.to(vae_device))
    return to_pil(pixels)[0]


def save_new_png(image: Any, output_dir: Path, spec: PromptSpec, seed: int, model: str, log: logging.Logger) -> Path:
    """``output_dir/<YYYYmmdd_HHMMSS>[_n].png`` (never overwriting an earlier image) with the prompt's PNG info, said
    on the script's ``log``."""
    from library.sampling.images import png_info, save_png

    output_dir.mkdir(parents=True, exist_ok=True)
    stem = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    path, n = output_dir / f"{stem}.png", 1
    while path.exists():  # never overwrite an earlier image
        path, n = output_dir / f"{stem}_{n}.png", n + 1
    save_png(image, path, png_info(spec, seed, model=model))
    log.info("saved %s", path)
    return path


def apply_options(
    line: str,
    spec: PromptSpec,
    networks: list[Any],
    fields: dict[str, tuple[str, type]],
    negative_prompt: str,
    log: logging.Logger,
) -> tuple[PromptSpec, int | None] | None:
    """One interactive line (sd-scripts' options) applied to ``spec``: the new spec and its seed (None: not given), or
    None for an empty line (the end). ``fields``: option letter -> (PromptSpec field, type), e.g. ``"w": ("width",
    int)``; ``--d`` the seed, ``--n`` the negative prompt (``-``: empty; not given: ``negative_prompt``), ``--m a,b``
    the live networks' multipliers. A bad option is logged on the script's ``log`` and skipped, as sd-scripts does."""
    if not line.strip():
        return None
    prompt, *options = line.split("--")
    spec = dataclasses.replace(spec, prompt=prompt.strip(), negative_prompt=negative_prompt)
    seed = None
    known = " ".join(f"--{k}" for k in sorted({*fields, "d", "m", "n"}, key=_OPTION_ORDER.index))
    for option in options:
        option = option.strip()
        key, value = option[:1], option[1:].strip()
        try:
            if key in fields:
                name, kind = fields[key]
                spec = dataclasses.replace(spec, **{name: kind(value)})
            elif key == "d":
                seed = int(value)
            elif key == "n":
                spec = dataclasses.replace(spec, negative_prompt="" if value == "-" else value)
            elif key == "m":
                set_multipliers(networks, [float(x) for x in value.split(",")])
            else:
                log.error("unknown option --%s (use %s)", option, known)
        except ValueError as e:
            log.error("invalid option --%s: %s", option, e)
    return spec, seed


_OPTION_ORDER = "whsdgmnc"  # the order sd-scripts' help lists them in


def prompt_loop(
    spec: PromptSpec,
    help_text: str,
    parse: Callable[[str, PromptSpec], tuple[PromptSpec, int | None] | None],
    generate: Callable[[PromptSpec, int | None], Path],
    log: logging.Logger,
    problems_of: Callable[[PromptSpec], list[str]] | None = None,
) -> list[Path]:
    """sd-scripts' ``--interactive``: print ``help_text``, read a line, ``parse(line, previous spec)`` and
    ``generate(spec, seed)``, until an empty line or the end of input; a spec with ``problems_of`` is skipped (logged;
    its settings do not carry over). Returns the written paths."""
    written = []
    while True:
        print(help_text, flush=True)
        try:
            line = input()
        except EOFError:
            break
        parsed = parse(line, spec)
        if parsed is None:
            break
        new_spec, seed = parsed
        problems = problems_of(new_spec) if problems_of is not None else []
        if problems:  # skipped: its settings do not carry over
            log.error("%s: prompt skipped", "; ".join(problems))
            continue
        spec = new_spec
        written.append(generate(spec, seed))
    return written


PROMPT_OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "c": ("scale", float)}


def generate_images(family: ModelFamily, parts: Parts, args: Any, spec_of: Callable[[str], PromptSpec],
                    device: torch.device, offload: bool, networks: list[Any], negative: str,
                    log: logging.Logger) -> list[Path]:  # fmt: skip
    """One flow image per prompt: ``args.prompt``, each line of ``args.from_file``, or the ``--interactive`` loop
    (``--w --h --s --c`` and the adapters' multipliers); seed ``args.seed`` (random when None); PNGs under
    ``args.save_path``. Returns the written paths."""
    import random

    from library.sampling.generate import resolve

    def generate(spec: PromptSpec, seed: int | None) -> Path:
        seed = args.seed if seed is None else seed
        seed = random.randint(0, 2**32 - 1) if seed is None else seed
        spec = resolve(spec, family, parts)
        image = flow_image(family, parts, spec, seed, device, offload)
        return save_new_png(image, Path(args.save_path), spec, seed, Path(args.dit).name, log)

    if args.from_file is not None:
        lines = [x.strip() for x in Path(args.from_file).read_text(encoding="utf-8").splitlines() if x.strip()]
        return [generate(spec_of(line), None) for line in lines]
    if not args.interactive:
        return [generate(spec_of(args.prompt), None)]
    parse = lambda line, spec: apply_options(line, spec, networks, PROMPT_OPTIONS, negative, log)  # noqa: E731
    return prompt_loop(spec_of(args.prompt or ""), "Enter prompt (empty to exit).", parse, generate, log)


@dataclass(frozen=True)
class Lora:
    """An adapter file and its multiplier (a minimal inference script's ``--lora_weights path;multiplier``)."""

    path: Path
    multiplier: float


def parse_lora(value: str, problems: list[str]) -> Lora | None:
    """``path;multiplier`` (multiplier 1.0 when left out); a problem (and None) for a bad number or a missing file."""
    path, _, multiplier = value.partition(";")
    try:
        mul = float(multiplier) if multiplier else 1.0
    except ValueError:
        problems.append(f"--lora_weights {value!r}: the multiplier after ';' must be a number (path;0.8)")
        return None
    if not Path(path).is_file():
        problems.append(f"--lora_weights {value!r}: no such file {path}")
        return None
    return Lora(Path(path), mul)
