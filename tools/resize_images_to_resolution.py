"""Downscale a folder's images to maximum areas, keeping aspect (sd-scripts' resize_images_to_resolution.py).

    python tools/resize_images_to_resolution.py src/ dst/ --max_resolution 1024x1024,512x512 [--divisible_by 8]

For each image and each WxH: if it has more than W*H pixels it is scaled by sqrt(W*H / pixels) (never enlarged),
then centre-cropped so both sides are multiples of --divisible_by, and saved as ``<name>+WxH.jpg`` (quality 100)
or ``.png`` with --save_as_png. Every size is made from the original image (sd-scripts resizes each size from the
previous one). Other files of the folder (captions...) are copied unchanged; --copy_associated_files also copies
each image's same-named files as ``<name>+WxH.<ext>``. Default filter: area (box) when shrinking.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from PIL import Image

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.data.images import load_image, resample_filter

logger = logging.getLogger(__name__)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
INTERPOLATIONS = {"area": "area", "cubic": "cubic", "lanczos4": "lanczos", "nearest": "nearest", "linear": "linear",
                  "box": "box"}  # fmt: skip


def parse_resolutions(text: str) -> list[tuple[str, int]]:
    """``"512x512,384x384"`` -> [("512x512", 262144), ...]; ``ValueError`` naming a malformed entry."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        w, sep, h = part.partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
            raise ValueError(f"--max_resolution: {part!r} is not WIDTHxHEIGHT (e.g. 512x512)")
        out.append((part, int(w) * int(h)))
    return out


def fit(size: tuple[int, int], max_pixels: int, divisible_by: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((scaled width, height), (cropped width, height)) for an image of ``size`` (sd-scripts' arithmetic)."""
    w, h = size
    if w * h > max_pixels:
        s = math.sqrt(max_pixels / (w * h))
        w, h = int(w * s), int(h * s)
    scaled = (w, h)
    return scaled, (w - w % divisible_by, h - h % divisible_by)


def resize_one(img: Image.Image, max_pixels: int, divisible_by: int, interpolation: str | None) -> Image.Image:
    scaled, (cw, ch) = fit(img.size, max_pixels, divisible_by)
    if scaled != img.size:
        img = img.resize(scaled, resample_filter(interpolation, upscale=False))
    left, top = (scaled[0] - cw) // 2, (scaled[1] - ch) // 2
    return img.crop((left, top, left + cw, top + ch))


def resize_folder(
    src: Path, dst: Path, resolutions: list[tuple[str, int]], divisible_by: int, interpolation: str | None,
    save_as_png: bool, copy_associated_files: bool,
) -> list[Path]:  # fmt: skip
    """Write the resized images (and copies) into ``dst``; returns the images written."""
    dst.mkdir(parents=True, exist_ok=True)
    written = []
    entries = sorted(p for p in src.iterdir() if p.is_file())
    images = [p for p in entries if p.suffix.lower() in IMAGE_EXTENSIONS]
    for path in entries:
        if path not in images:
            shutil.copy2(path, dst / path.name)
    for path in images:
        img = load_image(str(path))
        for name, max_pixels in resolutions:
            out = resize_one(img, max_pixels, divisible_by, interpolation)
            target = dst / f"{path.stem}+{name}{'.png' if save_as_png else '.jpg'}"
            out.save(target, **({} if save_as_png else {"quality": 100}))
            logger.info("%s %s (%dx%d) as %s", "Resized" if out.size != img.size else "Saved", path.name, *out.size,
                        target.name)  # fmt: skip
            written.append(target)
        if copy_associated_files:
            for other in entries:
                if other.stem == path.stem and other not in images:
                    for name, _ in resolutions:
                        shutil.copy2(other, dst / f"{path.stem}+{name}{other.suffix}")
    return written


def run(argv: Sequence[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src_img_folder", help="folder with the images")
    p.add_argument("dst_img_folder", help="folder to write to (created)")
    p.add_argument("--max_resolution", default="512x512,384x384,256x256,128x128", help="WxH[,WxH...]: maximum areas")
    p.add_argument("--divisible_by", type=int, default=1, help="crop both sides to multiples of this")
    p.add_argument("--interpolation", choices=list(INTERPOLATIONS), default=None, help="filter (default: area)")
    p.add_argument("--save_as_png", action="store_true", help="write PNG instead of JPEG")
    p.add_argument("--copy_associated_files", action="store_true", help="copy same-named files (captions) per size")
    args = p.parse_args(argv)
    problems = []
    src = Path(args.src_img_folder)
    if not src.is_dir():
        problems.append(f"{src}: not a folder")
    if args.divisible_by < 1:
        problems.append(f"--divisible_by must be >= 1, got {args.divisible_by}")
    try:
        resolutions = parse_resolutions(args.max_resolution)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ConfigError(problems)
    interpolation = INTERPOLATIONS.get(args.interpolation) if args.interpolation else None
    return resize_folder(src, Path(args.dst_img_folder), resolutions, args.divisible_by, interpolation,
                         args.save_as_png, args.copy_associated_files)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
