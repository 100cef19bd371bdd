"""Qwen-Image edit training (--model_version edit / edit-2509 / edit-2511 with the dataset's control_directory, as
musubi-tuner's docs/qwen_image.md trains them): musubi-tuner's documented LoRA line with its dataset TOML and a
control folder runs on tiny files (Qwen2.5-VL with its vision tower in ComfyUI's layout); for each batch the DiT gets
the VAE's latents of each control image at musubi-tuner's pixels as references (library/data/control_images.py,
checked against musubi-tuner's own dataset code in tests/test_control_images.py; model.forward(references=) against
diffusers in tests/test_qwen_image_edit.py) and the prompt states that diffusers' QwenImageEditPlusPipeline encodes
from the caption and the control images as trained, then at musubi-tuner's 384 x 384 condition area; the text cache
is keyed on the control images' bytes and sizes."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _qwen_image_commands import doc_command, musubi_toml
from PIL import Image

import qwen_image_cache_latents
import qwen_image_cache_text_encoder_outputs
import qwen_image_train_network
from library.data import control_images as CI
from library.families.autoencoders import qwen_image as ae
from library.families.encoders import qwen25vl
from library.families.encoders import qwen25vl_edit as E
from library.families.qwen_image import QWEN_IMAGE, saving

pytest_plugins = ["_qwen_image_helpers"]


@pytest.fixture(scope="module")
def edit_files(qwen_files, tmp_path_factory):
    """The tiny files with a Qwen2.5-VL that has its vision tower (``model.*`` + ``visual.*``) and that model."""
    vl = E.randomize(E.build(qwen25vl.TINY_TEXT, E.TINY_VISION).eval(), 0)
    path = tmp_path_factory.mktemp("vl") / "tiny_vl.safetensors"
    saving.save_text_encoder(SimpleNamespace(text_encoders=[E.core(vl)]), path)
    return {**qwen_files, "text_encoder": str(path), "vl": vl}


@pytest.fixture(scope="module")
def controls(dataset, tmp_path_factory):
    """One control image per demo image (sizes other than the targets'), two for the first."""
    folder = tmp_path_factory.mktemp("control")
    images = sorted(p for p in (dataset / "10_sks shape").iterdir() if p.suffix == ".png")
    rng = np.random.default_rng(0)
    for i, image in enumerate(images):
        for name in [image.stem + ".png"] + ([image.stem + "_1.png"] if i == 0 else []):
            Image.fromarray(rng.integers(0, 256, (40 + 8 * i, 56, 3), dtype=np.uint8)).save(folder / name)
    return folder


def _counting(method, calls, key):
    def counted(*args, **kwargs):
        calls[key] += 1
        return method(*args, **kwargs)

    return counted


def _edit_command(files, toml, out, version, *extra):
    argv = doc_command(files, toml, out, *extra)
    argv[argv.index("--model_version") + 1] = version
    return argv


@pytest.mark.parametrize("version", ["edit-2509", "edit-2511"])
def test_edit_training_gets_controls_and_prompts_with_images(edit_files, dataset, controls, tmp_path, monkeypatch,
                                                             version):  # fmt: skip
    """edit-2511: the same prompt template as edit-2509; its DiT is built with zero_cond_t (musubi-tuner's rule)."""
    from diffusers import QwenImageEditPlusPipeline

    toml = musubi_toml(dataset, tmp_path / "dataset.toml", f'control_directory = "{controls.as_posix()}"\n')
    toml.write_text(toml.read_text().replace("batch_size = 2", "batch_size = 1"))
    seen, batches, zero_cond = [], [], set()
    original = type(QWEN_IMAGE).predict

    def predict(self, denoiser, noisy, t, cond, **options):
        seen.append(([r.detach().float().clone() for r in options.get("references", ())], cond))
        zero_cond.add(bool(getattr(denoiser.config, "zero_cond_t", False)))
        return original(self, denoiser, noisy, t, cond, **options)

    monkeypatch.setattr(type(QWEN_IMAGE), "predict", predict)
    from library.run import loop

    step_loss = loop.batch_loss

    def batch_loss(m, batch, generator, **kw):
        batches.append(batch)
        return step_loss(m, batch, generator, **kw)

    monkeypatch.setattr(loop, "batch_loss", batch_loss)
    calls = {"vae": 0, "vl": 0}
    for name, key in (("encode_latents", "vae"), ("encode_prompt", "vl")):
        monkeypatch.setattr(QWEN_IMAGE, name, _counting(getattr(QWEN_IMAGE, name), calls, key))
    # musubi-tuner's workflow: its two caching scripts for the edit model, then training, which encodes nothing
    assert qwen_image_cache_latents.main(["--dataset_config", str(toml), "--vae", edit_files["vae"],
                                          "--model_version", version]) == 0  # fmt: skip
    given = ["--edit_plus"] if version == "edit-2509" else ["--model_version", version]  # musubi-tuner's two names
    assert qwen_image_cache_text_encoder_outputs.main(["--dataset_config", str(toml), "--text_encoder",
                                                       edit_files["text_encoder"], *given]) == 0  # fmt: skip
    assert calls["vae"] == 4 + 5 and calls["vl"] >= 1  # four targets and five control images
    entries = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert len(entries) == 4 + 5 + 4  # latents, control latents, one prompt per (caption, control images)
    calls.update(vae=0, vl=0)
    result = qwen_image_train_network.run(_edit_command(edit_files, toml, tmp_path / "out", version))
    assert zero_cond == {version == "edit-2511"}
    assert calls == {"vae": 0, "vl": 0} and sorted((tmp_path / "cache").rglob("*.safetensors")) == entries
    assert result.output.is_file()
    assert len(seen) == len(batches) == 4 and sorted(len(r) for r, _ in seen) == [1, 1, 1, 2]
    vae = copy.deepcopy(edit_files["parts"].vae).to(torch.bfloat16)  # the run's VAE: --mixed_precision bf16
    vl = E.build(qwen25vl.TINY_TEXT, E.TINY_VISION).eval()
    vl.load_state_dict(edit_files["vl"].state_dict())
    vl = vl.to(torch.bfloat16)  # the run's Qwen2.5-VL: --mixed_precision bf16
    proc = E.processor()
    pipe = QwenImageEditPlusPipeline(scheduler=None, vae=None, text_encoder=vl, tokenizer=proc.tokenizer,
                                     processor=proc, transformer=None)  # fmt: skip
    settings = CI.ControlSettings(str(controls))
    for (refs, cond), batch in zip(seen, batches):
        path = batch.image_paths[0]
        files = CI.match([path], str(controls))[path]
        bucket = (int(batch.target_sizes[0, 1]), int(batch.target_sizes[0, 0]))
        assert len(refs) == len(files)
        with torch.no_grad():
            for ref, f in zip(refs, files):
                want = ae.encode(vae, CI.control_pixels(f, bucket, settings, 16)[None]).float()
                torch.testing.assert_close(ref, want.to(torch.bfloat16).float())
            shown = []
            for f in files:  # musubi-tuner: the control image as trained, then the 384 x 384 area's bucket nearest
                img = Image.open(f).convert("RGB")  # its aspect ratio, step 16
                img = Image.fromarray(CI.resize_to(img, CI.target_size(img.size, bucket, settings, 16)))
                size = CI.bucket_for_area(img.size, (384, 384), 16)
                shown.append(Image.fromarray(CI.resize_to(img, size)))
            want, want_mask = pipe._get_qwen_prompt_embeds(batch.captions[0], shown, torch.device("cpu"),
                                                           torch.bfloat16)  # fmt: skip
        n = int(cond.mask[0].sum())
        assert n == want.shape[1]
        torch.testing.assert_close(cond.hidden_states[0, :n].float(), want[0].float(), atol=2e-2, rtol=2e-2)
    last = sorted(controls.iterdir())[-1]  # an edited control image: its prompt entry is encoded again, alone
    Image.fromarray(255 - np.asarray(Image.open(last))).save(last)
    assert qwen_image_cache_text_encoder_outputs.main(["--dataset_config", str(toml), "--text_encoder",
                                                       edit_files["text_encoder"], "--model_version", version]) == 0  # fmt: skip
    assert calls["vl"] == 1 and len(list((tmp_path / "cache").rglob("*.safetensors"))) == len(entries) + 1


def test_generate_with_control_images(edit_files, controls, tmp_path, monkeypatch):
    """qwen_image_generate_image.py --model_version edit-2509 --control_image_path A B (musubi-tuner's flags): each DiT
    call gets the VAE latents of the control images at musubi-tuner's sizes (the bucket of their own area; with
    --resize_control_to_image_size the image size) and the prompt states diffusers' QwenImageEditPlusPipeline encodes
    with those images; true CFG runs with them too; without --control_image_path an edit model is refused."""
    from diffusers import QwenImageEditPlusPipeline

    import qwen_image_generate_image
    from library.cli.problems import ConfigError

    seen = []
    original = type(QWEN_IMAGE).predict

    def predict(self, denoiser, noisy, t, cond, **options):
        seen.append(([r.detach().float().clone() for r in options.get("references", ())], cond, noisy.shape[0]))
        return original(self, denoiser, noisy, t, cond, **options)

    monkeypatch.setattr(type(QWEN_IMAGE), "predict", predict)
    files = sorted(str(p) for p in controls.iterdir())[:2]
    base = ["--dit", edit_files["dit"], "--vae", edit_files["vae"], "--text_encoder", edit_files["text_encoder"],
            "--model_version", "edit-2509", "--prompt", "make it blue", "--image_size", "32", "48",
            "--infer_steps", "2", "--seed", "1", "--guidance_scale", "1.0"]  # fmt: skip
    with pytest.raises(ConfigError, match="--control_image_path"):
        qwen_image_generate_image.run([*base, "--save_path", str(tmp_path / "none")])
    vl = E.build(qwen25vl.TINY_TEXT, E.TINY_VISION).eval()
    vl.load_state_dict(edit_files["vl"].state_dict())
    proc = E.processor()
    pipe = QwenImageEditPlusPipeline(scheduler=None, vae=None, text_encoder=vl, tokenizer=proc.tokenizer,
                                     processor=proc, transformer=None)  # fmt: skip
    vae = edit_files["parts"].vae
    for extra, sizes in (([], None), (["--resize_control_to_image_size"], (48, 32))):
        seen.clear()
        (out,) = qwen_image_generate_image.run([*base, "--save_path", str(tmp_path / "a"), "--control_image_path",
                                                *files, *extra])  # fmt: skip
        assert Image.open(out).size == (48, 32) and len(seen) == 2
        shown = []
        for f in files:
            img = Image.open(f).convert("RGB")
            shown.append(CI.resize_to(img, sizes or CI.bucket_for_area(img.size, img.size, 16)))
        refs, cond, _ = seen[0]
        with torch.no_grad():
            for ref, arr in zip(refs, shown, strict=True):
                pixels = torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)[None].float() / 127.5 - 1
                torch.testing.assert_close(ref, ae.encode(vae, pixels.to(ref.dtype)).float(), atol=1e-4, rtol=1e-4)
            want, _ = pipe._get_qwen_prompt_embeds("make it blue", [Image.fromarray(a) for a in shown],
                                                   torch.device("cpu"), torch.float32)  # fmt: skip
        n = int(cond.mask[0].sum())
        assert n == want.shape[1]
        torch.testing.assert_close(cond.hidden_states[0, :n].float(), want[0], atol=1e-3, rtol=1e-3)
    seen.clear()
    qwen_image_generate_image.run([*base[:-1], "4.0", "--save_path", str(tmp_path / "cfg"), "--control_image_path",
                                   files[0], "--negative_prompt", "blurry"])  # fmt: skip
    assert [(len(r), b) for r, _, b in seen] == [(1, 2), (1, 2)]  # [negative; prompt], both with the control image


def test_edit_lora_resumes_bit_identical(edit_files, dataset, controls, tmp_path):
    """--model_version edit with control images: --resume from the state at step 2 equals the uninterrupted 4-step
    run bit for bit (the caches shared, filled by the first run)."""
    from safetensors.torch import load_file

    toml = musubi_toml(dataset, tmp_path / "dataset.toml", f'control_directory = "{controls.as_posix()}"\n')
    toml.write_text(toml.read_text().replace("batch_size = 2", "batch_size = 1"))
    argv = _edit_command(edit_files, toml, tmp_path / "s", "edit", "--learning_rate", "1e-2", "--optimizer_type",
                         "AdamW")  # fmt: skip
    at = argv.index("--max_train_epochs")  # (it would override --max_train_steps, as in sd-scripts)
    del argv[at : at + 2]
    straight = qwen_image_train_network.run([*argv, "--max_train_steps", "4"])
    resume_dir = ["--output_dir", str(tmp_path / "r")]
    qwen_image_train_network.run([*argv, *resume_dir, "--max_train_steps", "2", "--save_state"])
    resumed = qwen_image_train_network.run([*argv, *resume_dir, "--max_train_steps", "4", "--resume",
                                            str(tmp_path / "r" / "my-lora-state")])  # fmt: skip
    a, b = load_file(str(straight.output)), load_file(str(resumed.output))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(straight.losses) == 4
