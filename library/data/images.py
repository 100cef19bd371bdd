"""Image loading and augmentation: resize to cover the bucket, crop, flip, colour and face-crop augmentation, masks.

Geometry follows sd-scripts (``trim_and_resize_if_required``, ``crop_target``, ``AugHelper.color_aug``); all
randomness comes from a ``random.Random`` the caller seeds per sample. Sizes are ``(width, height)``; tensors are
``(C, H, W)``.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from PIL import Image, ImageOps

from .buckets import Assignment

Size = tuple[int, int]

_FILTERS = {
    "area": Image.Resampling.BOX,
    "box": Image.Resampling.BOX,
    "lanczos": Image.Resampling.LANCZOS,
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "linear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "cubic": Image.Resampling.BICUBIC,
}


def load_image(path: str, *, keep_alpha: bool = False) -> Image.Image:
    """Decode ``path`` as RGB (or RGBA when ``keep_alpha``), EXIF orientation applied; errors name the file."""
    try:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im)
            has_alpha = im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info)
            return im.convert("RGBA" if keep_alpha and has_alpha else "RGB").copy()
    except OSError as e:
        raise ValueError(f"{path}: cannot decode image ({e}); remove or re-save it") from None


def resample_filter(name: str | None, upscale: bool) -> Image.Resampling:
    """PIL filter for ``--resize_interpolation`` (default: area/box when downscaling, lanczos when upscaling)."""
    if name is None:
        return Image.Resampling.LANCZOS if upscale else Image.Resampling.BOX
    return _FILTERS[name]


def crop_offset(length: int, target: int, rng: random.Random | None) -> int:
    """Left/top offset of a crop of ``target`` from ``length``: centred, or uniform when ``rng`` (random_crop)."""
    if length <= target:
        return 0
    return rng.randint(0, length - target) if rng is not None else (length - target) // 2


def resize_and_crop(
    img: Image.Image, a: Assignment, *, crop_rng: random.Random | None = None, interpolation: str | None = None
) -> tuple[Image.Image, Size]:
    """Resize to ``a.resized`` (covering the bucket) and crop to ``a.bucket``; returns (image, (left, top)).

    The offset is in pixels of the resized image, which is what SDXL's crop conditioning expects.
    """
    if img.size != a.resized:
        upscale = a.resized[0] > img.size[0] or a.resized[1] > img.size[1]
        img = img.resize(a.resized, resample_filter(interpolation, upscale))
    left = crop_offset(img.size[0], a.bucket[0], crop_rng)
    top = crop_offset(img.size[1], a.bucket[1], crop_rng)
    return img.crop((left, top, left + a.bucket[0], top + a.bucket[1])), (left, top)


def face_crop(
    img: Image.Image,
    face: tuple[int, int, int, int],
    target: Size,
    face_range: tuple[float, float],
    rng: random.Random,
    random_crop: bool,
) -> tuple[Image.Image, Size, Size]:
    """Scale so the face spans 1/range of the target's short side, crop ``target`` around it (sd-scripts
    ``crop_target``). Returns (image, (left, top), resized size)."""
    (w, h), (tw, th) = img.size, target
    cx, cy, fw, fh = face
    face_size, size = max(fw, fh, 1), min(tw, th)
    cover = max(th / h, tw / w)
    lo = max(cover, min(1.0, size / (face_size * face_range[1])))
    hi = max(lo, min(1.0, size / (face_size * face_range[0])))
    scale = rng.uniform(lo, hi) if hi > lo else lo
    new_size = (max(tw, int(w * scale + 0.5)), max(th, int(h * scale + 0.5)))
    img = img.resize(new_size, resample_filter(None, scale > 1))
    offsets = []
    for length, t, centre in ((new_size[0], tw, int(cx * scale + 0.5)), (new_size[1], th, int(cy * scale + 0.5))):
        p = centre - t // 2
        if random_crop:
            reach = max(length - centre, centre)
            p += rng.randint(0, reach) + rng.randint(0, reach) - reach
        elif face_range[0] != face_range[1] and face_size > size // 10 and face_size >= 40:
            p += rng.randint(-face_size // 20, face_size // 20)
        offsets.append(max(0, min(p, length - t)))
    left, top = offsets
    return img.crop((left, top, left + tw, top + th)), (left, top), new_size


def color_aug(img: Image.Image, rng: random.Random) -> Image.Image:
    """sd-scripts' weak colour augmentation: with p=0.33, half the time a hue shift of up to +-8 (OpenCV units,
    i.e. +-16 degrees), else gamma in [0.95, 1.05] (applied as 255*(x/255)**gamma)."""
    if rng.random() > 0.33:
        return img
    if rng.random() > 0.5:
        shift = rng.uniform(-8, 8) * 256 / 180  # OpenCV hue spans 0..180, PIL's 0..256
        hsv = np.asarray(img.convert("HSV")).copy()
        hsv[..., 0] = ((hsv[..., 0].astype(np.float32) + shift) % 256).astype(np.uint8)
        return Image.fromarray(hsv, "HSV").convert("RGB")
    gamma = rng.uniform(0.95, 1.05)
    arr = np.asarray(img).astype(np.float32) / 255.0
    return Image.fromarray(np.clip(255.0 * arr**gamma + 0.5, 0, 255).astype(np.uint8), "RGB")


def to_pixels(img: Image.Image) -> torch.Tensor:
    """RGB image -> (3, H, W) float32 in [-1, 1] (ToTensor + Normalize(0.5, 0.5), as sd-scripts)."""
    arr = np.asarray(img.convert("RGB"), dtype=np.float32)
    return torch.from_numpy(arr).permute(2, 0, 1).div(127.5).sub(1.0).contiguous()


def to_mask(img: Image.Image) -> torch.Tensor:
    """Greyscale mask image -> (1, H, W) float32 in [0, 1] (white = full loss weight)."""
    arr = np.asarray(img.convert("L"), dtype=np.float32) / 255.0
    return torch.from_numpy(arr).unsqueeze(0).contiguous()


def load_mask_source(path: str | None, image: Image.Image, alpha_mask: bool) -> Image.Image | None:
    """The mask as an "L" image the size of ``image``: a mask file (its red channel, as sd-scripts, or grey), or the
    image's alpha channel; None when there is no mask."""
    if path is not None:
        with Image.open(path) as m:
            m = ImageOps.exif_transpose(m)
            m = m.getchannel("R") if m.mode in ("RGB", "RGBA") else m.convert("L")
            if m.size != image.size:
                m = m.resize(image.size, Image.Resampling.BILINEAR)
            return m.copy()
    if alpha_mask:
        return image.getchannel("A") if image.mode == "RGBA" else Image.new("L", image.size, 255)
    return None


def render_sample(
    path: str,
    a: Assignment,
    *,
    flip: bool,
    mask_path: str | None = None,
    alpha_mask: bool = False,
    crop_rng: random.Random | None = None,
    color_rng: random.Random | None = None,
    face: tuple[int, int, int, int] | None = None,
    face_range: tuple[float, float] | None = None,
    face_rng: random.Random | None = None,
    interpolation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, Size, Size]:
    """Load one image and turn it into training pixels for bucket ``a.bucket``.

    Returns ``pixels`` (3, H, W) in [-1, 1], ``mask`` (1, H, W) in [0, 1] or None, the crop offset ``(left, top)``
    in the resized image (mirrored when flipped, as SDXL's crop conditioning needs) and the resized size. ``crop_rng``
    set = random crop; ``color_rng`` set = colour augmentation; ``face`` + ``face_range`` = face-centred crop.
    """
    img = load_image(path, keep_alpha=alpha_mask and mask_path is None)
    mask = load_mask_source(mask_path, img, alpha_mask)
    if face is not None and face_range is not None:
        rng = face_rng or random.Random(0)
        state = rng.getstate()
        img, offset, resized = face_crop(img, face, a.bucket, face_range, rng, crop_rng is not None)
        if mask is not None:
            rng.setstate(state)  # replay the same draws so the mask is cut exactly like the image
            mask = face_crop(mask, face, a.bucket, face_range, rng, crop_rng is not None)[0]
    else:
        state = crop_rng.getstate() if crop_rng is not None else None
        img, offset = resize_and_crop(img, a, crop_rng=crop_rng, interpolation=interpolation)
        if mask is not None:
            if crop_rng is not None:
                crop_rng.setstate(state)
            mask = resize_and_crop(mask, a, crop_rng=crop_rng, interpolation="bilinear")[0]
        resized = a.resized
    img = img.convert("RGB")
    if color_rng is not None:
        img = color_aug(img, color_rng)
    if flip:
        img = ImageOps.mirror(img)
        mask = ImageOps.mirror(mask) if mask is not None else None
        offset = (resized[0] - offset[0] - a.bucket[0], offset[1])
    return to_pixels(img), (to_mask(mask) if mask is not None else None), offset, resized
