"""The edit models' DiT input (the first piece of --model_version edit / edit-2509 / edit-2511; the data side is not
done and those versions are refused): model.forward with reference latents equals diffusers' QwenImageEditPlusPipeline
way of calling QwenImageTransformer2DModel (its own _pack_latents, the references after the noisy latents, their
shapes in img_shapes, the output cut to the noisy tokens), for the plain DiT and an Edit-2511 one (zero_cond_t, which
modulates the reference tokens at t = 0). musubi-tuner's own call_dit on the same inputs: benchmarks/qwen_image_vs_musubi.py."""

from __future__ import annotations

import pytest
import torch

from library.families.qwen_image import model as M


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_reference_latents_as_diffusers_edit_pipeline(zero_cond_t):
    from diffusers import QwenImageEditPlusPipeline

    torch.manual_seed(0)
    dit = M.build(dict(M.TINY, zero_cond_t=zero_cond_t)).eval()
    g = torch.Generator().manual_seed(1)
    b, c = 2, 16
    noisy = torch.randn(b, c, 8, 6, generator=g)
    refs = [torch.randn(b, c, 4, 8, generator=g), torch.randn(b, c, 6, 6, generator=g)]
    states, sigma = torch.randn(b, 5, 16, generator=g), torch.tensor([0.3, 0.8])
    mask = torch.ones(b, 5, dtype=torch.long)
    mask[1, 3:] = 0
    pack = QwenImageEditPlusPipeline._pack_latents
    with torch.no_grad():
        ours = M.forward(dit, noisy, sigma, states, mask, references=refs)
        hidden = torch.cat([pack(noisy, b, c, 8, 6), *(pack(r, b, c, *r.shape[-2:]) for r in refs)], dim=1)
        shapes = [[(1, 4, 3), (1, 2, 4), (1, 3, 3)]] * b
        want = dit(hidden_states=hidden, encoder_hidden_states=states, encoder_hidden_states_mask=mask.bool(),
                   timestep=sigma, img_shapes=shapes, return_dict=False)[0][:, :12]  # fmt: skip
        want = QwenImageEditPlusPipeline._unpack_latents(want, 64, 48, 8).squeeze(2)  # vae_scale_factor 8
        plain = M.forward(dit, noisy, sigma, states, mask)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    assert ours.shape == noisy.shape and (ours - plain).abs().max() > 1e-4  # the references are attended to
