"""The edit models' DiT input, prompt and files (pieces of --model_version edit / edit-2509 / edit-2511; the run:
tests/test_qwen_image_edit_training.py): model.forward with reference latents equals diffusers' QwenImageEditPlusPipeline
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


@pytest.fixture(scope="module")
def vl():
    """A tiny Qwen2.5-VL with its vision tower (seeded) and the processor over the shipped tokenizer."""
    from library.families.encoders import qwen25vl
    from library.families.encoders import qwen25vl_edit as E

    return E.randomize(E.build(qwen25vl.TINY_TEXT, E.TINY_VISION).eval(), 0), E.processor()


@pytest.mark.parametrize("version", ["edit", "edit-2509"])
def test_prompt_with_control_images_equals_diffusers_edit_pipelines(vl, version):
    """The edit models' prompt embeddings with their control images (encode_with_images, a batch of two captions
    with one and two images) equal diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline
    _get_qwen_prompt_embeds (their own templates, set by their __init__) caption by caption; edit takes the first
    image only. musubi-tuner's get_qwen_prompt_embeds_with_image on the same model and processor:
    benchmarks/qwen_image_edit_prompt_vs_musubi.py."""
    import numpy as np
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from PIL import Image

    from library.families.encoders import qwen25vl_edit as E

    model, proc = vl
    cls = QwenImageEditPipeline if version == "edit" else QwenImageEditPlusPipeline
    pipe = cls(scheduler=None, vae=None, text_encoder=model, tokenizer=proc.tokenizer, processor=proc,
               transformer=None)  # fmt: skip
    rng = np.random.default_rng(0)
    images = [[rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)],
              [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8), rng.integers(0, 256, (28, 84, 3), dtype=np.uint8)]]  # fmt: skip
    captions = ["a red cube on a table", "make it blue"]
    with torch.no_grad():
        states, mask = E.encode_with_images(model, proc, captions, images, version)
        for i, (caption, imgs) in enumerate(zip(captions, images)):
            given = [Image.fromarray(x) for x in imgs]
            want, want_mask = pipe._get_qwen_prompt_embeds(caption, given[0] if version == "edit" else given,
                                                           torch.device("cpu"), torch.float32)  # fmt: skip
            n = int(mask[i].sum())
            assert n == want.shape[1] and not mask[i, n:].any()
            torch.testing.assert_close(states[i, :n], want[0], atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the images are seen: other pixels, other states
        other, _ = E.encode_with_images(model, proc, captions[:1], [[255 - images[0][0]]], version)
    assert (other[0] - states[0, : other.shape[1]]).abs().max() > 1e-4


def test_vl_file_with_vision_tower_loads(vl, tmp_path):
    """Qwen2.5-VL with its vision tower read from ComfyUI's single-file layout (``model.*`` language model,
    ``visual.*`` vision tower, ``lm_head`` left out), as musubi-tuner's load_qwen2_5_vl renames it: the loaded model
    encodes a prompt with an image exactly as the model written; a text-only file is refused naming the flag."""
    from types import SimpleNamespace

    import numpy as np

    from library.families.encoders import qwen25vl_edit as E
    from library.families.qwen_image import saving
    from library.files.weights import save_state_dict

    model, proc = vl
    path = saving.save_text_encoder(SimpleNamespace(text_encoders=[E.core(model)]), tmp_path / "vl.safetensors")
    loaded = E.load(path, torch.float32, "cpu")
    image = [[np.random.default_rng(1).integers(0, 256, (56, 84, 3), dtype=np.uint8)]]
    with torch.no_grad():
        want = E.encode_with_images(model, proc, ["make it blue"], image, "edit-2509")
        got = E.encode_with_images(loaded, proc, ["make it blue"], image, "edit-2509")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    text_only = tmp_path / "text.safetensors"
    save_state_dict({"model." + k: v for k, v in E.core(model).language_model.state_dict().items()}, text_only)
    with pytest.raises(ValueError, match=r"--text_encoder .*without its vision tower"):
        E.load(text_only, torch.float32, "cpu")


def test_edit_2511_dit_file(tmp_path):
    """The Edit-2511 DiT (ComfyUI's file with the ``__index_timestep_zero__`` marker) loads with zero_cond_t for
    --model_version edit-2511 (musubi-tuner's load_qwen_image_model) and is refused naming that flag otherwise."""
    from library.families.qwen_image import loading
    from library.files.weights import save_state_dict

    dit = M.build(M.TINY).eval()
    state = {"model.diffusion_model." + k: v for k, v in dit.state_dict().items()}
    path = save_state_dict({**state, loading.EDIT_2511_MARKER: torch.zeros(1)}, tmp_path / "dit.safetensors")
    loaded = loading.load_dit(path, torch.float32, "cpu", zero_cond_t=True)
    assert loaded.zero_cond_t and all(torch.equal(v, dit.state_dict()[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(ValueError, match="--model_version edit-2511"):
        loading.load_dit(path, torch.float32, "cpu")
