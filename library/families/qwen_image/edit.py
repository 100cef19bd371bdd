"""The Qwen-Image edit models' prompts with their control images (``--model_version edit / edit-2509 / edit-2511``):
each control image as musubi-tuner's ``qwen_image_cache_text_encoder_outputs.py`` gives it to Qwen2.5-VL: as its
dataset resized it for training (to the target's bucket, ``control_resolution``'s bucket or its own size with
``no_resize_control``: ``control_images.target_size``, alpha kept through that resize), alpha dropped, then resized
and centre-cropped to the bucket of a 384 x 384 area nearest that image's aspect ratio (sides multiples of 16:
``BucketSelector.calculate_bucket_resolution`` and ``resize_image_to_bucket``, shared with the control latents in
``library/data/control_images.py``), then ``encoders/qwen25vl_edit.encode_with_images``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image
from torch import Tensor

from library.data import control_images as CI

from ..encoders import qwen25vl_edit as E

STEP = 16  # musubi-tuner's RESOLUTION_STEPS_QWEN_IMAGE_EDIT


def vl_image(path: str, size: tuple[int, int]) -> np.ndarray:
    """(H, W, 3) uint8: the control image at ``path``, trained at ``size`` (width, height), as the VL model sees it
    (module docstring)."""
    trained = np.ascontiguousarray(CI.resize_to(CI.open_control(path), size)[..., :3])
    img = Image.fromarray(trained)
    return np.ascontiguousarray(CI.resize_to(img, CI.bucket_for_area(img.size, E.CONDITION_AREA, STEP)))


Sized = tuple[str, tuple[int, int]]  # a control image file and the (width, height) its dataset trains it at


def encode(encoder: Any, tokenizer: Any, captions: Sequence[str], controls: Sequence[Sequence[Sized]],
           version: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(states, mask) of ``captions`` seen with their control images ``controls`` (per caption: (file, (width,
    height) it is trained at) each, ``control_images.sized``) by the edit model ``version``'s prompt encoder."""
    images = [[vl_image(p, size) for p, size in entry] for entry in controls]
    return E.encode_with_images(encoder, E.processor(tokenizer), captions, images, version)


OFFICIAL_AREA = (1024, 1024)  # musubi-tuner's VAE_IMAGE_RESOLUTION (--resize_control_to_official_size)


def generation_controls(paths: Sequence[str], official: bool, image_size: tuple[int, int] | None
                        ) -> tuple[list[Tensor], list[np.ndarray]]:  # fmt: skip
    """The control images of ``qwen_image_generate_image.py --control_image_path`` as musubi-tuner's
    ``preprocess_control_image`` makes them: (pixels (1, 3, h, w) in [-1, 1] for the VAE, (H, W, 3) uint8 for the VL
    model) per file. Sizes: ``official`` (``--resize_control_to_official_size``) the bucket of a 1024 x 1024 area for
    the VAE and of 384 x 384 for the VL model; else ``image_size`` (width, height; ``--resize_control_to_image_size``)
    for both; else the bucket of the image's own area for both (step 16, nearest its aspect ratio). Resized with
    the alpha channel, which is then dropped."""
    import torch

    pixels, shown = [], []
    for path in paths:
        img = CI.open_control(path)
        if official or image_size is None:
            size = CI.bucket_for_area(img.size, OFFICIAL_AREA if official else img.size, STEP)
            cond = CI.bucket_for_area(img.size, E.CONDITION_AREA if official else img.size, STEP)
        else:
            size = cond = tuple(image_size)
        arr = np.ascontiguousarray(CI.resize_to(img, size)[..., :3])
        pixels.append(torch.from_numpy(arr).permute(2, 0, 1)[None].float() / 127.5 - 1.0)
        shown.append(np.ascontiguousarray(CI.resize_to(img, cond)[..., :3]))
    return pixels, shown


class EditSampling:
    """The family as an edit model samples with fixed control images: every prompt (and negative prompt, as
    musubi-tuner encodes both) is encoded with ``shown`` by the version's template, and every DiT call gets the
    control ``latents`` (1, 16, h, w) as references, repeated over the batch (true CFG's doubled batch too). Other
    attributes are the family's."""

    def __init__(self, family: Any, version: str, shown: Sequence[np.ndarray], latents: Sequence[Tensor]) -> None:
        self.family, self.version, self.shown, self.latents = family, version, list(shown), list(latents)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.family, name)

    def encode_prompt(self, parts: Any, captions: list[str], *args: Any, **kwargs: Any) -> Any:
        from ..base import Cond

        encoder, proc = parts.text_encoders[0], E.processor(parts.tokenizers[0])
        states, mask = E.encode_with_images(encoder, proc, captions, [self.shown] * len(captions), self.version)
        return Cond(states, None, mask)

    def predict(self, denoiser: Any, noisy: Tensor, t: Tensor, cond: Any, **options: Any) -> Tensor:
        refs = [r.to(noisy.device, noisy.dtype).expand(noisy.shape[0], -1, -1, -1) for r in self.latents]
        return self.family.predict(denoiser, noisy, t, cond, references=refs, **options)
