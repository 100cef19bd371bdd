"""Sample images on disk and in trackers: file names, PNG text chunks, grids, TensorBoard / wandb logging."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .prompts import PromptSpec

log = logging.getLogger(__name__)


def sample_file_name(
    output_name: str | None, *, step: int, epoch: int | None, index: int | str, seed: int | None, stamp: str
) -> str:
    """sd-scripts' sample name: ``<output_name>_<e000001 | 000100>_<index:02d>_<YYYYmmddHHMMSS>[_<seed>].png``.

    The epoch form is used at epoch ends (and ``sample_at_first``: ``e000000``), the step form after a step.
    ``seed``: the prompt's own ``--d`` seed (sd-scripts leaves random seeds out of the name). ``index`` may be a
    word (``"grid"``) for the round's grid image.
    """
    prefix = f"{output_name}_" if output_name else ""
    number = f"e{epoch:06d}" if epoch is not None else f"{step:06d}"
    position = f"{index:02d}" if isinstance(index, int) else index
    suffix = f"_{seed}" if seed is not None else ""
    return f"{prefix}{number}_{position}_{stamp}{suffix}.png"


def timestamp() -> str:
    return time.strftime("%Y%m%d%H%M%S", time.localtime())


def png_info(spec: PromptSpec, seed: int, **extra: Any) -> PngInfo:
    """PNG text chunks for an image made from the resolved ``spec`` with ``seed``.

    sd-scripts gen_img's keys (``prompt``, ``negative-prompt``, ``seed``, ``steps``, ``scale``, ``sampler``, SDXL
    ``original-width`` ...), plus ``width``, ``height`` and ``extra`` (e.g. ``model``, ``step``, ``epoch``,
    ``clip-skip``; None values are left out), and A1111's ``parameters`` chunk so A1111 / civitai show the settings.
    """
    values: dict[str, Any] = {
        "prompt": spec.prompt,
        "negative-prompt": spec.negative_prompt,
        "seed": seed,
        "steps": spec.steps,
        "scale": spec.scale,
        "sampler": spec.sampler,
        "width": spec.width,
        "height": spec.height,
        "original-width": spec.original_width,
        "original-height": spec.original_height,
        "crop-top": spec.crop_top,
        "crop-left": spec.crop_left,
        "network-multipliers": ",".join(map(str, spec.network_multipliers)) if spec.network_multipliers else None,
        "guidance": spec.guidance,
        **extra,
    }
    info = PngInfo()
    for key, value in values.items():
        if value is not None:
            info.add_text(key, str(value))
    info.add_text("parameters", a1111_parameters(spec, seed, extra.get("model")))
    return info


def a1111_parameters(spec: PromptSpec, seed: int, model: str | None = None) -> str:
    """A1111's ``parameters`` text: prompt, ``Negative prompt: ...``, then ``Steps: 30, Sampler: ..., ...``."""
    fields = [
        f"Steps: {spec.steps}",
        f"Sampler: {spec.sampler}",
        f"CFG scale: {spec.scale}",
        f"Seed: {seed}",
        f"Size: {spec.width}x{spec.height}",
    ]
    if spec.guidance is not None:  # FLUX.1 dev's embedded guidance, under Forge's name for it
        fields.insert(3, f"Distilled CFG Scale: {spec.guidance}")
    if model:
        fields.append(f"Model: {model}")
    negative = f"\nNegative prompt: {spec.negative_prompt}" if spec.negative_prompt else ""
    return f"{spec.prompt}{negative}\n{', '.join(fields)}"


def save_png(image: Image.Image, path: Path, info: PngInfo) -> Path:
    """Write ``image`` with its text chunks (the folder is created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, pnginfo=info)
    return path


def make_grid(images: Sequence[Image.Image], columns: int | None = None) -> Image.Image:
    """All ``images`` in a grid (row-major, ``ceil(sqrt(n))`` columns by default); cells are as large as the largest
    image, smaller images sit at the top-left of their cell on black."""
    if not images:
        raise ValueError("make_grid: no images")
    columns = columns or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    cell_w, cell_h = max(i.width for i in images), max(i.height for i in images)
    grid = Image.new("RGB", (columns * cell_w, rows * cell_h))
    for n, image in enumerate(images):
        grid.paste(image.convert("RGB"), ((n % columns) * cell_w, (n // columns) * cell_h))
    return grid


def log_to_trackers(trackers: Sequence[Any], images: dict[str, Image.Image], step: int) -> None:
    """Log ``{tag: image}`` to accelerate trackers: TensorBoard (``add_images``, NHWC uint8) and wandb
    (``wandb.Image``). Other trackers are skipped with a debug message."""
    for tracker in trackers:
        name = getattr(tracker, "name", "")
        if name == "tensorboard":
            arrays = {tag: np.asarray(image.convert("RGB"))[None] for tag, image in images.items()}
            tracker.log_images(arrays, step=step, dataformats="NHWC")
        elif name == "wandb":
            tracker.log_images({tag: [image] for tag, image in images.items()}, step=step)
        else:
            log.debug("tracker %r: image logging not supported, samples only saved to disk", name)
