"""Aspect-ratio buckets, exactly as sd-scripts computes them.

Reference: kohya-ss/sd-scripts ``library/model_util.py::make_bucket_resolutions`` and ``library/train_util.py::
BucketManager.select_bucket`` (NovelAI's aspect-ratio bucketing). All sizes here are ``(width, height)`` in pixels,
the order sd-scripts uses; the batch contract converts to ``(h, w)`` for SDXL's size conditioning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Size = tuple[int, int]  # (width, height)


@dataclass(frozen=True)
class BucketSpec:
    """How one dataset at one training resolution assigns images to buckets.

    ``resolution`` is the target ``(width, height)``; its area is the pixel budget of every bucket. Without
    ``enable_bucket`` there is a single bucket, ``resolution`` itself.
    """

    resolution: Size
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False

    @property
    def max_area(self) -> int:
        return self.resolution[0] * self.resolution[1]


@dataclass(frozen=True)
class Assignment:
    """Where one image goes: its bucket, the size it is resized to before cropping, and the aspect-ratio error."""

    bucket: Size
    resized: Size
    ar_error: float


def make_bucket_resolutions(
    max_reso: Size, min_size: int = 256, max_size: int = 1024, divisible: int = 64
) -> list[Size]:
    """The predefined bucket set for a target resolution (sd-scripts ``make_bucket_resolutions``).

    One square bucket ``floor(sqrt(area) / divisible) * divisible``, plus for every width from ``min_size`` to
    ``max_size`` in steps of ``divisible`` the bucket ``(width, min(max_size, floor(area / width / divisible) *
    divisible))`` and its transpose, when that height is at least ``min_size``. Defaults at 512x512 give 17 buckets;
    1024x1024 with 256..2048 gives 41. Returns the sorted list of ``(width, height)``.
    """
    area = max_reso[0] * max_reso[1]
    side = int(math.sqrt(area) // divisible) * divisible
    resos = {(side, side)}
    width = min_size
    while width <= max_size:
        height = min(max_size, int((area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    return sorted(resos)


def predefined_buckets(spec: BucketSpec) -> list[Size]:
    """The buckets an image may be assigned to; empty under ``bucket_no_upscale`` (buckets then come from images)."""
    if not spec.enable_bucket:
        return [spec.resolution]
    if spec.bucket_no_upscale:
        return []
    return make_bucket_resolutions(spec.resolution, spec.min_bucket_reso, spec.max_bucket_reso, spec.bucket_reso_steps)


def _round_to_steps(x: float, steps: int) -> int:
    rounded = int(x + 0.5)
    return rounded - rounded % steps


def _no_upscale_size(width: int, height: int, spec: BucketSpec) -> Size:
    """Downscale to the area budget keeping the aspect ratio (sd-scripts' ``bucket_no_upscale`` branch)."""
    if width * height <= spec.max_area:
        return width, height
    aspect = width / height
    steps = spec.bucket_reso_steps
    resized_w = math.sqrt(spec.max_area * aspect)
    resized_h = spec.max_area / resized_w
    w_rounded = _round_to_steps(resized_w, steps)
    h_in_w = _round_to_steps(w_rounded / aspect, steps)
    h_rounded = _round_to_steps(resized_h, steps)
    w_in_h = _round_to_steps(h_rounded * aspect, steps)
    ar_by_width = w_rounded / h_in_w if h_in_w else math.inf
    ar_by_height = w_in_h / h_rounded if h_rounded else math.inf
    if abs(ar_by_width - aspect) < abs(ar_by_height - aspect):
        return w_rounded, int(w_rounded / aspect + 0.5)
    return int(h_rounded * aspect + 0.5), h_rounded


def select_bucket(width: int, height: int, spec: BucketSpec, buckets: list[Size]) -> Assignment:
    """Assign an image of ``width`` x ``height`` to a bucket (sd-scripts ``BucketManager.select_bucket``).

    With predefined ``buckets``: an exact size match wins, else the bucket with the nearest aspect ratio (first in
    sorted order on ties); the image is resized so it covers the bucket (the longer relative side is cropped).
    Under ``bucket_no_upscale``: an image larger than the area budget is downscaled to it keeping the aspect
    ratio; the bucket is the resized size rounded down to ``bucket_reso_steps``, so it never exceeds the image.
    """
    aspect = width / height
    if spec.enable_bucket and spec.bucket_no_upscale:
        resized = _no_upscale_size(width, height, spec)
        steps = spec.bucket_reso_steps
        bucket = (resized[0] - resized[0] % steps, resized[1] - resized[1] % steps)
    else:
        if (width, height) in buckets:
            bucket = (width, height)
        else:
            bucket = min(buckets, key=lambda b: abs(b[0] / b[1] - aspect))
        if aspect > bucket[0] / bucket[1]:
            scale = bucket[1] / height
        else:
            scale = bucket[0] / width
        resized = (int(width * scale + 0.5), int(height * scale + 0.5))
    ar_error = bucket[0] / bucket[1] - aspect if bucket[1] else math.inf
    return Assignment(bucket=bucket, resized=resized, ar_error=ar_error)
