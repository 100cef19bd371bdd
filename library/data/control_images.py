"""Control images of the edit models (kohya-ss/musubi-tuner's ``control_directory``), from disk to the batch.

A family whose model takes control (reference) images says so with ``DataArgs.control_images`` (the run sets it from
the family's options: ``takes_control_images``); any other family refuses the keys before training. A subset's
settings (:class:`ControlSettings`): ``control_directory``, ``no_resize_control``, ``control_resolution = [w, h]``
(or one integer).

Matching (musubi-tuner's ``dataset/datasources.py: ImageDirectoryDatasource``): an image ``a.png`` takes every file
of the control folder named ``a.<ext>`` or ``a_<digits>.<ext>``, the one without a suffix first, then by the number
(several control images per target: ``a_0.png``, ``a_1.png`` ...); images with longer names match first and a
control file goes to one image only. An image without a control file is an error naming it and the folder, before
training.

Sizes (musubi-tuner's ``image_video_dataset.py: ImageDataset``): by default a control image is resized and
centre-cropped to its target's bucket; with ``control_resolution`` to the bucket of that area nearest its own aspect
ratio (``BucketSelector.calculate_bucket_resolution``); with ``no_resize_control`` it keeps its size cut down to the
bucket step, or with ``control_resolution`` too its own size when not larger than that area (its bucket when larger). The resize is musubi-tuner's
``resize_image_to_bucket``: scale to cover (Lanczos up, OpenCV's area filter down), round half up, centre crop. The
alpha channel is dropped after resizing, as its caching step does. Unlike musubi-tuner, the EXIF orientation is
applied, as it is to the target image, so a rotated photo and its control image stay aligned.

Caching: with latent caching each control image's latents are an entry of the latent store, keyed on the control
file's bytes, the size it is trained at and the encoder (:func:`control_key`), so an edited control image is encoded
again. An edit model's prompt sees each control image at that size too (:func:`sized`; its text-cache entry is keyed
on the files' bytes and these sizes). Batches carry ``controls``: one (B, C, h, w) tensor per control index (latents
when cached, else pixels in [-1, 1]); a batch whose samples disagree in control count or shape is refused with the
files named.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from PIL import Image, ImageOps

from library.cli.problems import Problems

from .cache_store import cache_key, file_digest

KEYS = ("control_directory", "no_resize_control", "control_resolution")
_IMAGE_TYPES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(frozen=True)
class ControlSettings:
    """A subset's control images: the folder, ``no_resize_control``, ``control_resolution`` as (width, height)."""

    directory: str
    no_resize: bool = False
    resolution: tuple[int, int] | None = None


def _resolution(value: object, where: str, problems: Problems) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
        return int(value[0]), int(value[1])
    problems.error(f"{where}.control_resolution", f"expected an integer or [width, height], got {value!r}")
    return None


def subset_settings(sub: dict, tables: list[dict], cli: dict, problems: Problems, where: str):
    """The :class:`ControlSettings` of a dataset-file subset (``tables``: its dataset and [general] tables, read for
    the two size keys; ``cli``: the flags' fallbacks, ``control_images`` whether the model takes control images),
    None without ``control_directory``. The target's flips and random crops would leave the control image behind:
    refused with it."""
    folder = sub.get("control_directory")
    others = [k for k in KEYS[1:] if any(k in t for t in [sub, *tables])]
    if folder is None:
        for key in others:
            problems.error(f"{where}.{key}", "has no effect without control_directory; remove it or add the folder")
        return None
    if not cli.get("control_images"):
        problems.error(f"{where}.control_directory", "the edit models' control images: this model does not take "
                       "them; train an edit model (e.g. --model_version edit) or remove the key")  # fmt: skip
        return None
    if not isinstance(folder, str) or not os.path.isdir(folder):
        problems.error(f"{where}.control_directory", f"folder {folder!r} not found")
        return None

    def pick(key: str, default: object) -> object:
        return next((t[key] for t in [sub, *tables] if key in t), default)

    for key in ("flip_aug", "random_crop"):
        if pick(key, cli.get(key)):
            problems.error(f"{where}.{key}", "would change the target image but not its control image; remove it")
    no_resize = pick("no_resize_control", False)
    if not isinstance(no_resize, bool):
        problems.error(f"{where}.no_resize_control", f"expected true or false, got {no_resize!r}")
    return ControlSettings(folder, bool(no_resize), _resolution(pick("control_resolution", None), where, problems))


def _digits(stem: str, control_stem: str, path: str) -> int:
    if control_stem == stem:
        return 0
    suffix = control_stem.rsplit("_", 1)[-1]
    if not suffix.isdigit():
        raise ValueError(f"{path}: a control image's name is the target's name, or it plus _<number>")
    return int(suffix) + 1


def match(image_paths: list[str], folder: str) -> dict[str, list[str]]:
    """{image path: its control image paths in order} by musubi-tuner's rule (module docstring)."""
    left = {os.path.join(folder, n) for n in os.listdir(folder) if n.lower().endswith(_IMAGE_TYPES)}
    out: dict[str, list[str]] = {}
    for image in sorted(image_paths, key=lambda p: len(os.path.basename(p)), reverse=True):
        stem = os.path.splitext(os.path.basename(image))[0]
        found = [p for p in left if os.path.basename(p).startswith((stem + ".", stem + "_"))]
        left.difference_update(found)
        if found:
            out[image] = sorted(found, key=lambda p: _digits(stem, os.path.splitext(os.path.basename(p))[0], p))
    return out


def attach(records: list, settings: ControlSettings | None, where: str, problems: Problems) -> list:
    """``records`` with their control image paths (``ImageRecord.controls``); a missing control image is an error
    naming the image and the folder."""
    if settings is None:
        return records
    if not opencv_available():
        problems.error(f"{where}.control_directory", OPENCV)
        return records
    try:
        found = match([r.path for r in records], settings.directory)
    except ValueError as e:
        problems.error(f"{where}.control_directory", str(e))
        return records
    out = []
    for rec in records:
        if rec.path not in found:
            stem = os.path.splitext(os.path.basename(rec.path))[0]
            problems.error(rec.path, f"no control image {stem}.* or {stem}_<n>.* in control_directory "
                           f"{settings.directory}")  # fmt: skip
            continue
        out.append(replace(rec, controls=tuple(found[rec.path])))
    return out


def bucket_for_area(size: tuple[int, int], resolution: tuple[int, int], step: int) -> tuple[int, int]:
    """musubi-tuner's ``BucketSelector.calculate_bucket_resolution``: the (width, height) of ``resolution``'s area,
    sides multiples of ``step``, nearest ``size``'s aspect ratio among five candidates."""
    area = resolution[0] * resolution[1]
    aspect = size[0] / size[1]
    width = int(math.sqrt(area * aspect)) // step * step
    best, best_diff = (width, int(math.sqrt(area / aspect)) // step * step), float("inf")
    for i in range(-2, 3):
        w = width + i * step
        h = (area // w) // step * step
        if abs(w / h - aspect) < best_diff:
            best, best_diff = (w, h), abs(w / h - aspect)
    return best


def target_size(control: tuple[int, int], bucket: tuple[int, int], settings: ControlSettings, step: int):
    """The (width, height) a control image of size ``control`` is trained at beside a target in ``bucket``."""
    if settings.no_resize:
        res = settings.resolution
        if res is None:
            return control[0] - control[0] % step, control[1] - control[1] % step
        return bucket_for_area(control, res, step) if control[0] * control[1] > res[0] * res[1] else tuple(control)
    if settings.resolution is not None:
        return bucket_for_area(control, settings.resolution, step)
    return tuple(bucket)


def open_control(path: str) -> Image.Image:
    """The control image as musubi-tuner opens it (RGB or RGBA kept, other modes to RGB), EXIF orientation applied."""
    with Image.open(path) as im:
        img = ImageOps.exif_transpose(im)
        img.load()
    return img if img.mode in ("RGB", "RGBA") else img.convert("RGB")


def header_size(path: str) -> tuple[int, int]:
    """(width, height) of the image at ``path`` as :func:`open_control` gives it, from the header (no decoding)."""
    with Image.open(path) as im:
        (w, h), orientation = im.size, im.getexif().get(0x0112, 1)
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


OPENCV = ("control images are downscaled as musubi-tuner does, with OpenCV's INTER_AREA, and OpenCV is not installed: "
          "pip install opencv-python-headless (the extra \".[canny]\")")  # fmt: skip


def opencv_available() -> bool:
    """Whether ``cv2`` imports (an optional dependency: only control images and the canny tools need it)."""
    try:
        import cv2  # noqa: F401
    except ImportError:
        return False
    return True


def resize_to(img: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """musubi-tuner's ``resize_image_to_bucket``: (H, W, C) uint8 covering ``size`` then centre-cropped to it."""
    if tuple(size) == img.size:
        return np.array(img)
    scale = max(size[0] / img.width, size[1] / img.height)
    w, h = int(img.width * scale + 0.5), int(img.height * scale + 0.5)
    if scale > 1:
        arr = np.array(img.resize((w, h), Image.LANCZOS))
    else:
        import cv2  # checked when the dataset was read (attach)

        arr = cv2.resize(np.array(img), (w, h), interpolation=cv2.INTER_AREA)
    left, top = (w - size[0]) // 2, (h - size[1]) // 2
    return arr[top : top + size[1], left : left + size[0]]


def control_pixels(path: str, bucket: tuple[int, int], settings: ControlSettings, step: int) -> torch.Tensor:
    """(3, h, w) float in [-1, 1]: the control image at ``path`` as trained beside a target in ``bucket``."""
    img = open_control(path)
    arr = resize_to(img, target_size(img.size, bucket, settings, step))[..., :3]
    return torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1).float() / 127.5 - 1.0


def control_key(path: str, size: tuple[int, int], encoder_id: str) -> str:
    """Key of a control image's latents: its bytes, the size it is trained at (which holds the resize settings) and
    the encoder."""
    return cache_key("control", image=file_digest(path), size=list(size), encoder=encoder_id)


def stack(samples: list[list[torch.Tensor]], paths: list[str]) -> list[torch.Tensor] | None:
    """One (B, ...) tensor per control index from each sample's list; a batch that disagrees is refused."""
    if not samples or not samples[0]:
        return None
    shapes = {tuple(tuple(t.shape) for t in s) for s in samples}
    if len(shapes) > 1:
        raise ValueError(f"a batch mixes control images of different counts or sizes ({', '.join(paths)}); use "
                         "batch_size = 1 for this dataset or control images of one size per bucket")  # fmt: skip
    return [torch.stack([s[i] for s in samples]) for i in range(len(samples[0]))]


def sized(ds, i: int, k: int) -> tuple[tuple[str, tuple[int, int]], ...]:
    """(path, (width, height) it is trained at) of each control image of record ``i`` of dataset plan ``ds`` at
    resolution ``k``, () when it has none: what an edit model's prompt encoder is given, as musubi-tuner's text
    caching takes the control images its dataset has resized (``qwen_image_cache_text_encoder_outputs.py``)."""
    rec = ds.records[i]
    settings = ds.subset(rec).control
    if not rec.controls or settings is None:
        return ()
    bucket, step = ds.assignments[k][i].bucket, ds.config.bucket_reso_steps
    return tuple((p, target_size(header_size(p), bucket, settings, step)) for p in rec.controls)


def _todo(plan, encoder_id: str, cache) -> list[tuple]:
    """(key, anchor, control path, bucket, size, settings, bucket step) of every control latent the plan can ask for; fills
    ``cache.controls`` with each latent slot's (key, anchor)."""
    out = []
    for d, ds in enumerate(plan.datasets):
        step = ds.config.bucket_reso_steps
        for i, rec in enumerate(ds.records):
            settings = ds.subset(rec).control
            if not rec.controls or settings is None:
                continue
            sizes = [header_size(p) for p in rec.controls]
            for k in range(len(ds.config.resolutions)):
                bucket = ds.assignments[k][i].bucket
                keys = []
                for path, own in zip(rec.controls, sizes):
                    size = target_size(own, bucket, settings, step)
                    keys.append((control_key(path, size, encoder_id), rec.path))
                    out.append((keys[-1][0], rec.path, path, bucket, size, settings, step))
                cache.controls[(d, i, k)] = keys
    return out


def cache_controls(plan, cache, encode_fn, encoder_id: str, batch_size: int, downscale: int) -> None:
    """Encode every control image's latents the plan can use that is not cached yet (into ``cache.store``),
    ``batch_size`` images of one size at a time; ``cache.controls`` maps each latent slot (dataset, record,
    resolution) to its entries' (key, anchor)."""
    todo, seen = [], set()
    for entry in _todo(plan, encoder_id, cache):
        key, anchor = entry[:2]
        if key not in seen and not cache.store.has(key, anchor):
            seen.add(key)
            todo.append(entry)
    todo.sort(key=lambda t: t[4])
    start = 0
    while start < len(todo):
        size = todo[start][4]
        chunk = [t for t in todo[start : start + batch_size] if t[4] == size]
        pixels = torch.stack([control_pixels(path, bucket, settings, step)
                              for _key, _anchor, path, bucket, _size, settings, step in chunk])  # fmt: skip
        with torch.no_grad():
            latents = encode_fn(pixels)
        if tuple(latents.shape[-2:]) != (size[1] // downscale, size[0] // downscale):
            raise ValueError(f"encode_fn returned {tuple(latents.shape)} for control images of {size}")
        for (key, anchor, *_), lat in zip(chunk, latents):
            cache.store.save(key, anchor, {"latents": lat})
        start += len(chunk)


def cached(cache, slot: tuple[int, int, int]) -> list[torch.Tensor]:
    """The control latents of a latent slot (dataset, record, resolution), [] when it has none."""
    return [cache.store.load(key, anchor)["latents"] for key, anchor in cache.controls.get(slot, ())]


def rendered(ds, i: int, k: int) -> list[torch.Tensor]:
    """The control pixels of record ``i`` of dataset plan ``ds`` at resolution ``k``, [] when it has none."""
    rec = ds.records[i]
    settings = ds.subset(rec).control
    if not rec.controls or settings is None:
        return []
    bucket = ds.assignments[k][i].bucket
    return [control_pixels(p, bucket, settings, ds.config.bucket_reso_steps) for p in rec.controls]
