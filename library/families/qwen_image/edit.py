"""The Qwen-Image edit models' prompts with their control images (``--model_version edit / edit-2509 / edit-2511``):
each control image as musubi-tuner's ``qwen_image_cache_text_encoder_outputs.py`` gives it to Qwen2.5-VL (alpha
dropped, resized and centre-cropped to the bucket of a 384 x 384 area nearest its aspect ratio, sides multiples of
16: ``BucketSelector.calculate_bucket_resolution`` and ``resize_image_to_bucket``, shared with the control latents in
``library/data/control_images.py``), then ``encoders/qwen25vl_edit.encode_with_images``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import Tensor

from library.data import control_images as CI

from ..encoders import qwen25vl_edit as E

STEP = 16  # musubi-tuner's RESOLUTION_STEPS_QWEN_IMAGE_EDIT


def vl_image(path: str) -> np.ndarray:
    """(H, W, 3) uint8: the control image at ``path`` as the VL model sees it (module docstring)."""
    img = CI.open_control(path)
    img = img.convert("RGB") if img.mode != "RGB" else img
    return np.ascontiguousarray(CI.resize_to(img, CI.bucket_for_area(img.size, E.CONDITION_AREA, STEP)))


def encode(encoder: Any, tokenizer: Any, captions: Sequence[str], controls: Sequence[Sequence[str]],
           version: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(states, mask) of ``captions`` seen with their control image files ``controls`` by the edit model
    ``version``'s prompt encoder."""
    images = [[vl_image(p) for p in paths] for paths in controls]
    return E.encode_with_images(encoder, E.processor(tokenizer), captions, images, version)
