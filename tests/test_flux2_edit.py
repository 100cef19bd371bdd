"""FLUX.2 edit training (reference images from the dataset's control_directory, as musubi-tuner's flux_2 trains them):
musubi-tuner's docs/flux_2.md line with its dataset TOML and a control folder runs; the DiT gets, for each batch, the
AE's latents of each control image at musubi-tuner's pixels (library/data/control_images.py, checked against
musubi-tuner's own dataset code in tests/test_control_images.py) as references (``model.forward(references=)``,
checked against Flux2KleinPipeline's packing in tests/test_flux2.py), in musubi-tuner's order (``a``, ``a_0``, ...);
without a latent cache the step encodes the control pixels as it encodes the targets'."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from PIL import Image

import flux_2_train_network
from library.data import control_images as CI
from library.families.autoencoders import flux2 as ae
from library.families.flux2 import FLUX2
from tests.test_flux2 import doc_command, musubi_toml

pytest_plugins = ["_flux2_helpers"]


@pytest.fixture(scope="module")
def controls(dataset, tmp_path_factory):
    """A control folder for the demo's images: one control image each (sizes other than the targets'), two for the
    first (``<stem>.png`` then ``<stem>_1.png``)."""
    folder = tmp_path_factory.mktemp("control")
    images = sorted(p for p in (dataset / "10_sks shape").iterdir() if p.suffix == ".png")
    rng = np.random.default_rng(0)
    for i, image in enumerate(images):
        names = [image.stem + ".png"] + ([image.stem + "_1.png"] if i == 0 else [])
        for name in names:
            Image.fromarray(rng.integers(0, 256, (40 + 8 * i, 56, 3), dtype=np.uint8)).save(folder / name)
    return folder


def _recording(monkeypatch):
    seen = []
    original = type(FLUX2).predict

    def predict(self, denoiser, noisy, t, cond, **options):
        seen.append([r.detach().float().clone() for r in options.get("references", ())])
        return original(self, denoiser, noisy, t, cond, **options)

    monkeypatch.setattr(type(FLUX2), "predict", predict)
    return seen


def test_edit_training_gets_the_control_latents(flux2_files, dataset, controls, tmp_path, monkeypatch):
    toml = musubi_toml(dataset, tmp_path / "dataset.toml", f'control_directory = "{controls.as_posix()}"\n')
    toml.write_text(toml.read_text().replace("batch_size = 2", "batch_size = 1"))
    seen = _recording(monkeypatch)
    batches = []
    from library.run import loop

    step_loss = loop.batch_loss

    def batch_loss(m, batch, generator, **kw):
        batches.append(batch)
        return step_loss(m, batch, generator, **kw)

    monkeypatch.setattr(loop, "batch_loss", batch_loss)
    result = flux_2_train_network.run(doc_command(flux2_files, toml, tmp_path / "out"))
    assert result.output.is_file()
    assert len(seen) == len(batches) == 4 and sorted(len(r) for r in seen) == [1, 1, 1, 2]
    vae = copy.deepcopy(flux2_files["parts"].vae).to(torch.bfloat16)  # the run's VAE: --mixed_precision bf16
    settings = CI.ControlSettings(str(controls))
    for refs, batch in zip(seen, batches):
        path = batch.image_paths[0]
        stem = os.path.splitext(os.path.basename(path))[0]
        files = CI.match([path], str(controls))[path]
        assert [os.path.basename(f) for f in files] == [stem + ".png"] + ([stem + "_1.png"] if len(files) > 1 else [])
        bucket = (int(batch.target_sizes[0, 1]), int(batch.target_sizes[0, 0]))
        assert len(refs) == len(files)
        for ref, f in zip(refs, files):
            with torch.no_grad():
                want = ae.encode(vae, CI.control_pixels(f, bucket, settings, 16)[None]).float()
            torch.testing.assert_close(ref, want.to(torch.bfloat16).float())


def test_uncached_controls_are_encoded_like_the_targets(flux2_files):
    """Batches without a latent cache carry control pixels: the step encodes each with the family's encoder."""
    from types import SimpleNamespace

    from library.run.train_step import batch_references

    parts = flux2_files["parts"]
    g = torch.Generator().manual_seed(0)
    pixels = [torch.rand(2, 3, 32, 48, generator=g) * 2 - 1, torch.rand(2, 3, 16, 16, generator=g) * 2 - 1]
    m = SimpleNamespace(family=FLUX2, parts=parts, device=torch.device("cpu"), weight_dtype=torch.float32)
    refs = batch_references(m, SimpleNamespace(controls=pixels, latents=None), None)
    with torch.no_grad():
        for ref, px in zip(refs, pixels, strict=True):
            torch.testing.assert_close(ref, ae.encode(parts.vae, px))
    assert batch_references(m, SimpleNamespace(controls=None, latents=None), None) == []


def test_caching_scripts_cache_the_control_latents(flux2_files, dataset, controls, tmp_path, monkeypatch):
    """docs/flux_2.md's caching lines on a TOML with a control_directory cache the control images' latents beside the
    targets': the edit training run after them encodes nothing and still gives the DiT every control image."""
    import flux_2_cache_latents
    import flux_2_cache_text_encoder_outputs

    cache = (tmp_path / "cache").as_posix()
    extra = f'control_directory = "{controls.as_posix()}"\ncache_directory = "{cache}"\n'
    toml = musubi_toml(dataset, tmp_path / "dataset.toml", extra)
    toml.write_text(toml.read_text().replace("batch_size = 2", "batch_size = 1"))
    version = ["--model_version", "klein-base-4b"]
    assert flux_2_cache_latents.main(["--dataset_config", str(toml), "--vae", flux2_files["vae"], *version]) == 0
    text = ["--dataset_config", str(toml), "--text_encoder", flux2_files["text_encoder"], *version]
    assert flux_2_cache_text_encoder_outputs.main(text) == 0
    calls = []
    for name in ("encode_latents", "encode_tokens"):
        original = getattr(FLUX2, name)
        monkeypatch.setattr(FLUX2, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    seen = _recording(monkeypatch)
    flux_2_train_network.run(doc_command(flux2_files, toml, tmp_path / "out"))
    assert calls == [] and sorted(len(r) for r in seen) == [1, 1, 1, 2]
