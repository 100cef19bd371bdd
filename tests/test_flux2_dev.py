"""FLUX.2 dev on tiny files: the split Mistral 3 file and the tokenizer beside it, the prompt against
Flux2Pipeline's Mistral encoder, training with guidance 1.0 (musubi-tuner's call_dit), and flux_2_generate_image.py's
embedded-guidance image against Flux2Pipeline's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_flux2 import CAPTIONS, _inputs, doc_command, musubi_toml

import flux_2_train_network
from library.families.base import Parts
from library.families.flux2 import FLUX2
from library.families.flux2 import model as M
from library.files.weights import read_metadata

pytest_plugins = ["_flux2_helpers"]


def test_dev_prompt_equals_flux2_pipeline(flux2_dev_files):
    """FLUX.2 dev: the split Mistral 3 file (first part given) and the tokenizer beside it load; our prompt equals
    Flux2Pipeline._get_mistral_3_small_prompt_embeds over Mistral3ForConditionalGeneration with the same weights
    (system message, 512 tokens, layers 10, 20, 30); the architecture reads as dev from the weights."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from library.families.encoders import mistral3
    from library.families.flux2.options import Flux2Options

    parts = FLUX2.load(flux2_dev_files["dit"], vae=flux2_dev_files["vae"],
                       options=Flux2Options(text_encoder=flux2_dev_files["text_encoder"]))  # fmt: skip
    assert parts.scheduler_config["model_version"] == "dev" and parts.denoiser.config.guidance_embeds
    want = flux2_dev_files["encoder"].state_dict()
    got = parts.text_encoders[0].state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                  image_size=28, patch_size=14)  # fmt: skip
    vlm = Mistral3ForConditionalGeneration(Mistral3Config(text_config=dict(mistral3.TINY, model_type="mistral"),
                                                          vision_config=vision)).eval()  # fmt: skip
    vlm.model.language_model.load_state_dict(want)
    with torch.no_grad():
        ref = Flux2Pipeline._get_mistral_3_small_prompt_embeds(vlm, parts.tokenizers[0], CAPTIONS,
                                                                dtype=torch.float32, device="cpu")  # fmt: skip
        ours = FLUX2.encode_prompt(parts, CAPTIONS).hidden_states
    assert ours.shape == (2, 512, 48)
    torch.testing.assert_close(ours, ref)


def test_dev_trains_with_guidance_one(flux2_dev_files, dataset, tmp_path):
    """musubi-tuner's line with --model_version dev trains (the DiT gets guidance 1.0, as musubi-tuner's call_dit);
    without the tokenizer beside the text encoder the run stops before training, naming where it looked."""
    files = {k: str(v) for k, v in flux2_dev_files.items()}
    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    argv = doc_command(files, toml, tmp_path / "out")
    argv[argv.index("klein-base-4b")] = "dev"
    result = flux_2_train_network.run(argv)
    assert read_metadata(result.output)["ss_model_version"] == "dev"
    denoiser = flux2_dev_files["denoiser"]
    x, ctx, t = _inputs(6)
    with torch.no_grad():
        one = denoiser(hidden_states=M.tokens(x), encoder_hidden_states=ctx, timestep=t, guidance=torch.ones(1),
                       img_ids=M.image_ids(4, 6), txt_ids=M.text_ids(5), return_dict=False)[0]  # fmt: skip
        torch.testing.assert_close(M.forward(denoiser, x, t, ctx), one.transpose(1, 2).reshape(x.shape))
    (tmp_path / "te").mkdir()
    for f in Path(files["text_encoder"]).parent.iterdir():
        (tmp_path / "te" / f.name).write_bytes(f.read_bytes())
    argv[argv.index(files["text_encoder"])] = str(tmp_path / "te" / Path(files["text_encoder"]).name)
    with pytest.raises(ValueError, match="Mistral tokenizer was not found"):
        flux_2_train_network.run(argv)


def test_dev_generate_equals_flux2_pipeline(flux2_dev_files, tmp_path):
    """flux_2_generate_image.py on dev (embedded guidance, no CFG) writes the image diffusers' Flux2Pipeline makes
    from the same noise and noise levels."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from PIL import Image
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    import flux_2_generate_image
    from library.families.encoders import mistral3
    from library.families.flux2.options import Flux2Options
    from library.sampling.flow import latent_noise
    from library.sampling.flow_generate import flow_settings, sampling_sigmas

    files = flux2_dev_files
    argv = ["--dit", files["dit"], "--vae", files["vae"], "--text_encoder", files["text_encoder"], "--prompt", "a cat",
            "--image_size", "32", "32", "--infer_steps", "2", "--embedded_cfg_scale", "3.5", "--flow_shift", "2.0",
            "--seed", "2", "--save_path", str(tmp_path / "a")]  # fmt: skip
    (path,) = flux_2_generate_image.run(argv)
    ours = np.asarray(Image.open(path)).astype(int)
    parts = FLUX2.load(files["dit"], vae=files["vae"], options=Flux2Options(text_encoder=files["text_encoder"]))
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                  image_size=28, patch_size=14)  # fmt: skip
    vlm = Mistral3ForConditionalGeneration(Mistral3Config(text_config=dict(mistral3.TINY, model_type="mistral"),
                                                          vision_config=vision)).eval()  # fmt: skip
    vlm.model.language_model.load_state_dict(files["encoder"].state_dict())
    pipe = Flux2Pipeline(FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False), parts.vae, vlm,
                         parts.tokenizers[0], parts.denoiser)  # fmt: skip
    settings = flow_settings(FLUX2, Parts(parts.denoiser, None, [], [], {"static_shift": 2.0}, "flux2"))
    sigmas = sampling_sigmas(settings, 2, 32, 32)[:-1].tolist()
    noise = latent_noise([torch.Generator().manual_seed(2)], 32, 32, 128, 16)
    want = pipe(prompt="a cat", height=32, width=32, num_inference_steps=2, sigmas=sigmas, guidance_scale=3.5,
                latents=noise, output_type="np").images[0]  # fmt: skip
    assert np.abs(ours - np.round(want * 255).astype(int)).max() <= 1
