"""Conditioning images (ControlNet / ControlNet-LLLite training): one per training image, cut like it.

A trainer that takes conditioning images (``DataArgs.conditioning_images``, set by its parser) reads a subset's
``conditioning_data_dir`` as sd-scripts' ``ControlNetDataset`` does: the file with the training image's base name
(any image type), the same size as the training image. Every other trainer reads that key as the folder of loss
masks (``--masked_loss``). What sd-scripts checks with asserts while training (a missing or extra conditioning image,
a size that differs, ``random_crop``) is an error here, before anything loads, naming both files.

The conditioning image follows its target exactly: the same resize to the bucket (same filter), the same centre crop
and the same flip; it never gets colour augmentation. ``Batch.conditioning_images`` is (B, 3, H, W) float in
[-1, 1]: sd-scripts' ``ControlNetDataset`` passes it through ``IMAGE_TRANSFORMS`` (ToTensor, Normalize(0.5, 0.5))
and its LLLite trainer feeds that tensor to the network unchanged.
"""

from __future__ import annotations

import os

import torch
from PIL import ImageOps

from library.cli.problems import Problems

from .buckets import Assignment
from .images import load_image, resize_and_crop, to_pixels
from .sources import IMAGE_EXTENSIONS, MASK_SUFFIX, read_image_size

# The per-subset settings that would cut the training image differently from its conditioning image.
REFUSED_WITH_CONDITIONING = {
    "random_crop": "sd-scripts' ControlNet datasets refuse it too (the conditioning image is centre-cropped)",
    "face_crop_aug_range": "the face-centred crop is not applied to the conditioning image",
}


def conditioning_images_in(folder: str) -> dict[str, str]:
    """{base name: path} of the images directly in ``folder`` (sorted by name; the first of equal stems wins)."""
    out: dict[str, str] = {}
    for name in sorted(os.listdir(folder)):
        low = name.lower()
        if (
            low.endswith(IMAGE_EXTENSIONS)
            and not low.endswith(MASK_SUFFIX)
            and os.path.isfile(os.path.join(folder, name))
        ):
            out.setdefault(os.path.splitext(name)[0], os.path.join(folder, name))
    return out


def match_conditioning(
    image: str, size: tuple[int, int], available: dict[str, str], folder: str, problems: Problems
) -> str | None:
    """The conditioning image of training image ``image`` (``size`` its (width, height)) among ``available``; a
    missing one, or one of another size, is an error naming both files."""
    stem = os.path.splitext(os.path.basename(image))[0]
    path = available.get(stem)
    if path is None:
        problems.error(image, f"no conditioning image named {stem}.* in conditioning_data_dir {folder}; add one")
        return None
    try:
        found = read_image_size(path)
    except ValueError as e:
        problems.error(image, f"its conditioning image is unreadable: {e}")
        return None
    if found != size:
        problems.error(
            image,
            f"is {size[0]}x{size[1]} but its conditioning image {path} is {found[0]}x{found[1]}; the two must be the "
            "same size (resize the conditioning image)",
        )
        return None
    return path


def unpaired(folder: str, available: dict[str, str], used: set[str], problems: Problems, where: str) -> None:
    """Conditioning images without a training image: an error, as in sd-scripts (usually a misnamed pair)."""
    extra = sorted(p for p in available.values() if p not in used)
    if extra:
        shown = ", ".join(os.path.basename(p) for p in extra[:5]) + (" ..." if len(extra) > 5 else "")
        problems.error(
            f"{where}.conditioning_data_dir",
            f"{len(extra)} conditioning images in {folder} have no training image of the same name ({shown}); "
            "rename or remove them",
        )


def render_conditioning(path: str, a: Assignment, *, flip: bool, interpolation: str | None = None) -> torch.Tensor:
    """The conditioning image for bucket ``a`` as (3, H, W) float32 in [-1, 1]: the training image's resize, centre
    crop and flip (:func:`library.data.images.render_sample` without random crop, colour or face augmentation)."""
    img, _ = resize_and_crop(load_image(path), a, interpolation=interpolation)
    if flip:
        img = ImageOps.mirror(img)
    return to_pixels(img)
