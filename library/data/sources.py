"""Finding images, captions and masks on disk, and reading each image's size once (headers only).

Nothing here writes anything: the user's dataset folders are only read. Problems (corrupt images, captions that
are not UTF-8, missing mask files, unsupported image types) are collected into a ``Problems`` so that they are
reported all at once, each naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from library.cli.problems import Problems

from .captions import finetune_caption

# The types sd-scripts trains on (library/train_util.py IMAGE_EXTENSIONS), compared case-insensitively.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# Image types that sit in dataset folders but are not trained on (listed in a warning, never silently skipped).
UNSUPPORTED_IMAGE_EXTENSIONS = (".gif", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jxl", ".jfif", ".tga", ".psd")
MASK_SUFFIX = "-masklabel.png"  # OneTrainer's mask file convention: <stem>-masklabel.png next to the image
_ROTATED = (5, 6, 7, 8)  # EXIF orientations that swap width and height


@dataclass(frozen=True)
class ImageRecord:
    """One training image as read at start: size ``(width, height)`` after EXIF orientation, raw caption text."""

    path: str
    size: tuple[int, int]
    caption: str
    subset_index: int
    is_reg: bool
    num_repeats: int
    mask_path: str | None = None
    face: tuple[int, int, int, int] | None = None  # (cx, cy, w, h) from a name_cx_cy_w_h file name
    conditioning_path: str | None = None  # its conditioning image (ControlNet trainers; library/data/conditioning.py)
    controls: tuple[str, ...] = ()  # the edit models' control images (library/data/control_images.py)


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.lower().endswith(MASK_SUFFIX)


def list_images(folder: str) -> tuple[list[str], list[str]]:
    """(image paths, unsupported image paths) directly in ``folder`` (not recursive), sorted by name."""
    names = sorted(e.name for e in os.scandir(folder) if e.is_file() and not e.name.startswith("."))
    images = [os.path.join(folder, n) for n in names if _is_image(n)]
    other = [os.path.join(folder, n) for n in names if n.lower().endswith(UNSUPPORTED_IMAGE_EXTENSIONS)]
    return images, other


def has_images(folder: str) -> bool:
    return bool(list_images(folder)[0])


def read_image_size(path: str) -> tuple[int, int]:
    """``(width, height)`` as the image will be trained (EXIF orientation applied), from the header.

    Raises ``ValueError`` naming the file when it is empty or not a readable image: every image is decoded once
    (a truncated file is found here, before training), PNG files are also checked for bad checksums.
    """
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path}: empty file (0 bytes)")
    try:
        with Image.open(path) as im:
            width, height = im.size
            orientation = im.getexif().get(0x0112, 1)
        with Image.open(path) as im:
            im.verify()  # PNG: chunk checksums
        with Image.open(path) as im:
            im.draft(im.mode, (max(1, width // 8), max(1, height // 8)))  # JPEG: decode at 1/8 scale, every byte read
            im.load()  # a truncated JPEG / WebP / PNG fails here, up front, not later in a DataLoader worker
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{path}: not a readable image ({e})") from None
    if width < 1 or height < 1:
        raise ValueError(f"{path}: image has no pixels ({width}x{height})")
    return (height, width) if orientation in _ROTATED else (width, height)


def _read_text(path: str, problems: Problems) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        problems.error(path, "caption file is not UTF-8 text; re-save it as UTF-8")
        return None


def _caption_file(image: str, ext: str) -> str | None:
    stem = os.path.splitext(image)[0]
    if os.path.isfile(stem + ext):
        return stem + ext
    tokens = os.path.basename(stem).split("_")
    if len(tokens) >= 5:  # face-crop names "name_cx_cy_w_h" fall back to "name<ext>" (sd-scripts)
        alt = os.path.join(os.path.dirname(stem), "_".join(tokens[:-4]) + ext)
        if os.path.isfile(alt):
            return alt
    return None


def face_box(path: str) -> tuple[int, int, int, int] | None:
    tokens = os.path.splitext(os.path.basename(path))[0].split("_")
    if len(tokens) >= 5 and all(t.isdigit() for t in tokens[-4:]):
        cx, cy, w, h = (int(t) for t in tokens[-4:])
        return cx, cy, w, h
    return None


def find_mask(image: str, conditioning_dir: str | None, masked_loss: bool, problems: Problems) -> str | None:
    """The mask image for ``image``: same stem in ``conditioning_dir`` (sd-scripts), else ``<stem>-masklabel.png``."""
    stem = os.path.splitext(os.path.basename(image))[0]
    if conditioning_dir:
        for name in sorted(os.listdir(conditioning_dir)):
            if os.path.splitext(name)[0] == stem and _is_image(name):
                return os.path.join(conditioning_dir, name)
        problems.error(image, f"no mask image named {stem}.* in conditioning_data_dir {conditioning_dir}")
        return None
    label = os.path.splitext(image)[0] + MASK_SUFFIX
    return label if masked_loss and os.path.isfile(label) else None


def _finetune_entries(meta_path: str, problems: Problems) -> list[tuple[str, dict]]:
    try:
        with open(meta_path, encoding="utf-8") as f:
            if meta_path.lower().endswith(".jsonl"):
                rows = [json.loads(line) for line in f if line.strip()]
                return [(r.get("image_path", ""), r) for r in rows]
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problems.error(meta_path, f"not valid JSON ({e})")
        return []
    if not isinstance(data, dict):
        problems.error(meta_path, "expected an object {image_key: {caption, tags, ...}}")
        return []
    return list(data.items())


def _finetune_image(key: str, image_dir: str | None) -> str | None:
    candidates = [key] if os.path.isabs(key) or not image_dir else [os.path.join(image_dir, key), key]
    for base in candidates:
        if os.path.isfile(base) and _is_image(base):
            return base
        for ext in IMAGE_EXTENSIONS + tuple(e.upper() for e in IMAGE_EXTENSIONS):
            if os.path.isfile(base + ext):
                return base + ext
    return None


def dreambooth_items(subset, problems: Problems) -> list[tuple[str, str | None]]:
    """(image path, raw caption or None when no caption file) for an image folder; lists unsupported types."""
    images, other = list_images(subset.image_dir)
    if other:
        shown = ", ".join(os.path.basename(p) for p in other[:5]) + (" ..." if len(other) > 5 else "")
        problems.warn(
            subset.image_dir,
            f"{len(other)} files of unsupported image types are not used ({shown}); convert them to PNG/JPEG/WebP",
        )
    items = []
    for image in images:
        cap_path = _caption_file(image, subset.caption_extension)
        items.append((image, _read_text(cap_path, problems) if cap_path else None))
    return items


def finetune_items(subset, problems: Problems) -> list[tuple[str, str | None]]:
    """(image path, caption + tags) for each entry of a metadata JSON/JSONL file (sd-scripts fine-tune mode)."""
    items = []
    for key, entry in _finetune_entries(subset.metadata_file, problems):
        path = _finetune_image(str(key), subset.image_dir)
        if path is None:
            problems.error(subset.metadata_file, f'image "{key}" not found (looked in {subset.image_dir or "."})')
            continue
        entry = entry if isinstance(entry, dict) else {}
        text = finetune_caption(entry.get("caption"), entry.get("tags"), subset.captions.caption_separator)
        items.append((path, text or None))
    return items
