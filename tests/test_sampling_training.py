"""Sampling during training: files and PNG text chunks, grid, TensorBoard, EMA weights, and training left untouched
(RNG states, train/eval modes, identical losses with and without sampling)."""

from __future__ import annotations

import copy
import random
import re

import numpy as np
import pytest
import torch
from PIL import Image

from library.sampling import SampleConfig, sample_during_training, should_sample


def _family(name):
    from library.families import get_family

    return get_family(name)


def _cfg(tmp_path, text="a red cat --w 64 --h 64 --s 2 --d 5\na dog --n blurry --w 72 --h 64 --s 2\n", **kw):
    path = tmp_path / "prompts.txt"
    path.write_text(text, encoding="utf-8")
    return SampleConfig(path, **kw)


def test_files_names_and_png_text_chunks(tiny_parts, tmp_path):
    family, parts = _family("sd1"), tiny_parts["sd1"]
    cfg = _cfg(tmp_path, every_n_steps=10, sampler="euler_a", clip_skip=2)
    paths = sample_during_training(cfg, family, parts, output_dir=tmp_path / "out", output_name="mylora", step=10)
    assert len(paths) == 3 and all(p.parent == tmp_path / "out" / "sample" for p in paths)
    assert re.fullmatch(r"mylora_000010_00_\d{14}_5\.png", paths[0].name)  # --d seed in the name, as sd-scripts
    assert re.fullmatch(r"mylora_000010_01_\d{14}\.png", paths[1].name)
    assert re.fullmatch(r"mylora_000010_grid_\d{14}\.png", paths[2].name)
    first, second = Image.open(paths[0]), Image.open(paths[1])
    assert first.size == (64, 64) and second.size == (72, 64) and Image.open(paths[2]).size == (144, 64)
    assert first.text["prompt"] == "a red cat" and first.text["seed"] == "5" and first.text["steps"] == "2"
    assert first.text["sampler"] == "euler_a" and first.text["scale"] == "7.5" and first.text["step"] == "10"
    assert first.text["model"] == "tiny-sd1" and first.text["clip-skip"] == "2"
    assert second.text["negative-prompt"] == "blurry" and second.text["seed"].isdigit()
    assert first.text["parameters"].startswith("a red cat\nSteps: 2, Sampler: euler_a, CFG scale: 7.5, Seed: 5")
    epoch_paths = sample_during_training(cfg, family, parts, output_dir=tmp_path / "o2", output_name=None, step=0,
                                         epoch=0)  # fmt: skip
    assert re.fullmatch(r"e000000_00_\d{14}_5\.png", epoch_paths[0].name)
    # the same prompt and seed give the same pixels at the next round
    again = sample_during_training(cfg, family, parts, output_dir=tmp_path / "o3", output_name="x", step=20)
    assert np.array_equal(np.asarray(Image.open(again[0])), np.asarray(first))


def test_prompt_file_reread_and_bad_edit_skips_round(tiny_parts, tmp_path, caplog):
    family, parts = _family("sd1"), tiny_parts["sd1"]
    cfg = _cfg(tmp_path, text="one --w 64 --h 64 --s 1\n", every_n_steps=1)
    assert len(sample_during_training(cfg, family, parts, output_dir=tmp_path, output_name=None, step=1)) == 2
    cfg.prompts_file.write_text("one --w 64 --h 64 --s 1\ntwo --w 64 --h 64 --s 1\n")
    assert len(sample_during_training(cfg, family, parts, output_dir=tmp_path, output_name=None, step=2)) == 3
    cfg.prompts_file.write_text("one --w 65\n")
    assert sample_during_training(cfg, family, parts, output_dir=tmp_path, output_name=None, step=3) == []
    assert f"{cfg.prompts_file}:1" in caplog.text and "sampling at step 3 skipped" in caplog.text


@pytest.mark.parametrize("family_name", ["sd1", "sdxl"])
def test_rng_states_and_train_modes_are_restored(tiny_parts, tmp_path, family_name):
    family, parts = _family(family_name), copy.deepcopy(tiny_parts[family_name])
    parts.denoiser.train()
    parts.denoiser.conv_in.eval()  # a mixed state must come back exactly
    parts.text_encoders[0].train()
    modes = {name: m.training for name, m in parts.denoiser.named_modules()}

    def draws():
        return torch.rand(4), random.random(), torch.randint(0, 1000, (3,))

    torch.manual_seed(123)
    random.seed(123)
    expected = draws()
    torch.manual_seed(123)
    random.seed(123)
    sample_during_training(_cfg(tmp_path), family, parts, output_dir=tmp_path, output_name=None, step=5)
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert {name: m.training for name, m in parts.denoiser.named_modules()} == modes
    assert parts.text_encoders[0].training and not parts.vae.training


def _train(parts, family, steps, sample_cfg=None, out=None):
    """A tiny fine-tune of the UNet's output conv that draws from the global RNG, as a trainer does."""
    torch.manual_seed(0)
    random.seed(0)
    unet = parts.denoiser
    unet.train()
    params = list(unet.conv_out.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-2)
    with torch.no_grad():
        cond = family.encode_prompt(parts, ["a red cat", "a dog"])
    losses = []
    for step in range(1, steps + 1):
        latents = torch.randn(2, 4, 8, 8)
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (2,))
        keep = random.random()  # Python's RNG is restored too
        pred = family.predict(unet, latents + noise, t, cond)
        loss = torch.nn.functional.mse_loss(pred, noise) * (1 + keep)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if sample_cfg is not None and should_sample(sample_cfg, step=step):
            sample_during_training(sample_cfg, family, parts, output_dir=out, output_name="run", step=step)
    return losses


def test_training_losses_identical_with_and_without_sampling(tiny_parts, tmp_path):
    family = _family("sd1")
    cfg = _cfg(tmp_path, text="a cat --w 64 --h 64 --s 2\n", every_n_steps=2, sampler="euler_a")
    without = _train(copy.deepcopy(tiny_parts["sd1"]), family, 5)
    with_sampling = _train(copy.deepcopy(tiny_parts["sd1"]), family, 5, cfg, tmp_path / "out")
    assert with_sampling == without
    assert len(list((tmp_path / "out" / "sample").glob("run_*_00_*.png"))) == 2  # steps 2 and 4


def test_ema_weights_are_used_and_restored(tiny_parts, tmp_path):
    from library.run.ema import EMA

    family, parts = _family("sd1"), copy.deepcopy(tiny_parts["sd1"])
    params = list(parts.denoiser.conv_out.parameters())
    before = [p.detach().clone() for p in params]
    ema = EMA(params, decay=0.5)
    for s in ema.shadow:
        s.mul_(-1.0)  # averaged weights far from the live ones
    cfg = _cfg(tmp_path, text="a cat --w 64 --h 64 --s 2 --d 1\n")
    plain = sample_during_training(cfg, family, parts, output_dir=tmp_path / "a", output_name=None, step=1)
    with_ema = sample_during_training(cfg, family, parts, output_dir=tmp_path / "b", output_name=None, step=1,
                                      ema_context=ema.applied())  # fmt: skip
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    # oracle: the same image made with the averaged weights put in by hand
    with torch.no_grad():
        for p, s in zip(params, ema.shadow):
            p.copy_(s)
    manual = sample_during_training(cfg, family, parts, output_dir=tmp_path / "c", output_name=None, step=1)
    pixels = [np.asarray(Image.open(p[0])) for p in (plain, with_ema, manual)]
    assert np.array_equal(pixels[1], pixels[2]) and not np.array_equal(pixels[0], pixels[1])


def test_images_logged_to_tensorboard(tiny_parts, tmp_path):
    from accelerate import Accelerator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path / "logs"))
    accelerator.init_trackers("run")
    cfg = _cfg(tmp_path)
    sample_during_training(cfg, _family("sd1"), tiny_parts["sd1"], output_dir=tmp_path, output_name=None, step=7,
                           accelerator=accelerator)  # fmt: skip
    accelerator.end_training()
    events = EventAccumulator(str(tmp_path / "logs" / "run"), size_guidance={"images": 0})
    events.Reload()
    assert set(events.Tags()["images"]) == {"sample_0", "sample_1", "sample_grid"}
    (grid,) = events.Images("sample_grid")
    assert grid.step == 7 and (grid.width, grid.height) == (144, 64)
    assert (events.Images("sample_1")[0].width, events.Images("sample_1")[0].height) == (72, 64)


def test_default_size_is_the_family_native_resolution(tiny_parts):
    from library.sampling import PromptSpec, resolve

    sizes = {n: resolve(PromptSpec("a"), _family(n), tiny_parts[n]) for n in ("sd1", "sd2", "sdxl")}
    assert [(s.width, s.height) for s in sizes.values()] == [(512, 512), (768, 768), (1024, 1024)]
    assert sizes["sd1"].steps == 30 and sizes["sd1"].scale == 7.5 and sizes["sd1"].sampler == "ddim"


def test_train_network_with_sampling_trains_identically(tiny_dir, tmp_path):
    """End to end: train_network.py with samples at first and every 2 steps (and adapter dropout, which reads the
    RNG) writes the same LoRA as the run without samples."""
    pytest.importorskip("networks.inject", reason="needs the networks package (networks branch)")
    import train_network
    from library.files.weights import load_state_dict
    from library.run.demo import make_example_dataset

    data = make_example_dataset(tmp_path / "data")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cat --w 64 --h 64 --s 2\na dog --w 64 --h 64 --s 2 --ss euler_a --d 3\n")

    def run(out, *extra):
        train_network.run([
            "--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--train_data_dir", str(data),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "t",
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
            "--network_dropout", "0.1", "--learning_rate", "1e-3", "--train_batch_size", "2",
            "--max_train_steps", "4", "--max_data_loader_n_workers", "0", "--seed", "1", *extra,
        ], family_names=("sd1", "sd2"))  # fmt: skip
        return load_state_dict(out / "t.safetensors")[0]

    plain = run(tmp_path / "a")
    sampled = run(tmp_path / "b", "--sample_prompts", str(prompts), "--sample_every_n_steps", "2", "--sample_at_first")
    assert plain.keys() == sampled.keys() and all(torch.equal(plain[k], sampled[k]) for k in plain)
    names = sorted(p.name for p in (tmp_path / "b" / "sample").iterdir())
    assert len(names) == 9 and sum("_grid_" in n for n in names) == 3
