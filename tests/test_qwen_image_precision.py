"""Qwen-Image in bf16: the DiT rounds its timestep input (t / 1000) to bf16 before embedding it, in diffusers'
``QwenImageTransformer2DModel`` and in musubi-tuner's own copy (``timestep.to(hidden_states.dtype)``), so a bf16
prediction equals the fp32 one at the rounded timestep, not at the drawn one (0.9 -> 0.8984375: 898.4 of 1000).
Training matches the reference this way; tests/test_families_gpu.py marks the family's bf16-vs-fp32 check as this
known difference, and this test fails (telling to drop that mark) if the module stops rounding."""

from __future__ import annotations

import copy

import torch

from library.families import get_family


def _relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_bf16_prediction_is_fp32_at_the_bf16_rounded_timestep():
    family = get_family("qwen_image")
    parts = family.tiny.build(seed=0)
    half = copy.deepcopy(parts)
    half.denoiser.to(torch.bfloat16)
    captions = ["a photo of a cat", "a red house under a blue sky"]
    with torch.no_grad():
        cond = family.encode_prompt(parts, captions)
        size = 4 * family.size_multiple
        pixels = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(0)) * 2 - 1
        latents = family.encode_latents(parts, pixels, generator=torch.Generator().manual_seed(1))
        t = torch.tensor([100.0, 900.0])
        rounded = (t / 1000).to(torch.bfloat16).float() * 1000
        pred = family.predict(half.denoiser, latents.to(torch.bfloat16), t, cond)
        at_rounded = family.predict(parts.denoiser, latents, rounded, cond)
        at_drawn = family.predict(parts.denoiser, latents, t, cond)
    assert rounded[1] != t[1]
    assert _relative_error(pred, at_rounded) < 0.03
    assert _relative_error(pred, at_drawn) > 0.1  # the rounding, not bf16 arithmetic, makes the difference
