"""Gradient accumulation against an oracle that is not the code under test: accumulating k batches of b samples
gives the same optimizer step as one batch of k·b samples, on the same samples and random draws, to fp32
tolerance, in every training script.

Each sample's noise and timestep depend only on the sample (its file name and the epoch), and the latents are the
VAE distribution's mean, so the two runs draw the same values whatever their batch layout. Accumulation that
divides twice (the loop's 1/k and accelerate's own) halves every step here.
"""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import pytest
import torch
from _scripts import SCRIPTS, family_of, run_script, script_args
from _token_helpers import token_dataset

import library.objectives.ddpm as O
import library.run.train_step as T
from library.files.weights import load_state_dict
from library.run import loop
from library.run.demo import make_tiny_model

# one script of each trainable kind also shows that the comparison notices a step of half the length
SENSITIVITY = ("sdxl_train_network", "train_textual_inversion", "fine_tune")


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    """Two different images, one repeat: every epoch (and so every optimizer step) sees both."""
    four = token_dataset(tmp_path_factory.mktemp("four"))
    folder = tmp_path_factory.mktemp("two") / "1_shapetok shape"
    folder.mkdir()
    for png in sorted(next(four.iterdir()).glob("*.png"))[:2]:
        shutil.copy(png, folder / png.name)
        shutil.copy(png.with_suffix(".txt"), folder / png.with_suffix(".txt").name)
    return folder.parent


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(root / name, name) for name in ("sd1", "sdxl")}


def per_sample_draws(monkeypatch) -> None:
    """Noise and timestep from each sample's own seed; latents = the VAE's mean (no sampling)."""
    make_example = O.make_example
    noise_now = {}

    def fixed_noise_example(cfg, latents, schedule, generator=None, *, timesteps=None, noise=None):
        return make_example(cfg, latents, schedule, generator, timesteps=timesteps, noise=noise_now["noise"])

    def per_sample_loss(m, batch, generator, *, timesteps=None):
        seeds = [zlib.crc32(f"{Path(p).name}/{batch.epoch}".encode()) for p in batch.image_paths]
        vae = m.parts.vae
        with torch.no_grad():
            pixels = batch.pixels.to(next(vae.parameters()).dtype)
            batch.latents = (vae.encode(pixels).latent_dist.mean * m.family.vae_scale).float()
        shape = batch.latents.shape[1:]
        noise_now["noise"] = torch.stack(
            [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds]
        )
        return T.batch_loss(m, batch, generator, timesteps=torch.tensor([s % 1000 for s in seeds]))

    monkeypatch.setattr(O, "make_example", fixed_noise_example)  # the DDPM objective's draws
    monkeypatch.setattr(loop, "batch_loss", per_sample_loss)


def trained_after(script, models, data, out, batch, accum, *extra):
    argv = script_args(script, models[family_of(script)], data, out, "--train_batch_size", str(batch),
                       "--gradient_accumulation_steps", str(accum), "--optimizer_type", "SGDNesterov",
                       "--learning_rate", "0.05", "--save_state", "--save_model_as", "safetensors", *extra,
                       steps=2)  # fmt: skip
    result = run_script(script, argv)
    assert result.steps == 2 and result.failed is None
    return load_state_dict(result.state / "trained.safetensors")[0]


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_accumulating_two_batches_of_one_equals_one_batch_of_two(script, models, two_images, tmp_path, monkeypatch):
    per_sample_draws(monkeypatch)
    one_batch = trained_after(script, models, two_images, tmp_path / "b2", 2, 1, "--max_grad_norm", "0")
    accumulated = trained_after(script, models, two_images, tmp_path / "a2", 1, 2, "--max_grad_norm", "0")
    floats = [k for k, v in one_batch.items() if v.is_floating_point()]
    if script in SENSITIVITY:  # the tolerance below sees a step half as long (a double division): it can fail
        half = trained_after(script, models, two_images, tmp_path / "half", 2, 1, "--max_grad_norm", "0",
                             "--learning_rate", "0.025")  # fmt: skip
        apart = sum(not torch.allclose(half[k], one_batch[k], rtol=1e-4, atol=1e-6) for k in floats)
        assert apart >= max(1, len(floats) // 4), "the runs barely trained: the comparison would prove nothing"
    for key in floats:
        torch.testing.assert_close(accumulated[key], one_batch[key], rtol=1e-4, atol=1e-6, msg=key)


def test_accumulation_clips_the_accumulated_gradient(models, two_images, tmp_path, monkeypatch):
    """--max_grad_norm acts on the window's mean gradient, as it does on the bigger batch's."""
    per_sample_draws(monkeypatch)
    one_batch = trained_after("train_network", models, two_images, tmp_path / "b2", 2, 1, "--max_grad_norm", "0.01")
    accumulated = trained_after("train_network", models, two_images, tmp_path / "a2", 1, 2, "--max_grad_norm", "0.01")
    for key, value in one_batch.items():
        torch.testing.assert_close(accumulated[key], value, rtol=1e-4, atol=1e-6, msg=key)
