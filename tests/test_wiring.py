"""The loop's wiring against references outside the code under test: the EMA file against the documented recurrence
rebuilt from the per-step files, SDXL's size and crop conditioning against diffusers' ``_get_add_time_ids`` and
sd-scripts' bucket arithmetic, and --gradient_checkpointing by its checkpoint calls and the memory it saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

import sdxl_train_network
import train_network
from library.files.weights import load_state_dict
from library.run import loop
from library.run import setup as run_setup
from library.run.demo import draw_shape


def lora_args(model: Path, data: Path, out: Path, *extra: str, steps: int = 3) -> list[str]:
    return [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension", ".txt",
        "--resolution", "64", "--output_dir", str(out), "--output_name", "t", "--network_module", "networks.lora",
        "--network_dim", "4", "--network_alpha", "2", "--learning_rate", "1e-2", "--train_batch_size", "1",
        "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0", "--seed", "1", *extra,
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------- EMA
def test_ema_file_follows_the_documented_recurrence(tiny_dir, dataset, tmp_path):
    """library/run/ema.py's recurrence, rebuilt from the live per-step files: the shadow starts at the initial weights
    and, every ``update_every``-th step, moves ``(1 - d)`` of the way to the live weights with ``d = decay **
    update_every``, capped by the warm-up ``(1 + n) / (10 + n)``. decay 0.3, every 2 steps: d = 0.09, below the
    warm-up, so the decay itself shows (the default 0.999 would give 0.1, 0.18, 0.25)."""
    decay, every, steps = 0.3, 2, 6
    argv = lora_args(tiny_dir / "sd1", dataset, tmp_path, "--ema", "--ema_decay", str(decay), "--ema_update_every",
                     str(every), "--save_every_n_steps", "1", "--save_precision", "float", steps=steps)  # fmt: skip
    result = train_network.run(argv)
    assert result.steps == steps

    def files(step: int) -> tuple[dict, dict]:
        stem = "t" if step == steps else f"t-step{step:08d}"
        live, ema = tmp_path / f"{stem}.safetensors", tmp_path / f"{stem}-ema.safetensors"
        return load_state_dict(live)[0], load_state_dict(ema)[0]

    live, ema = zip(*(files(k) for k in range(1, steps + 1)))
    trained = [k for k in live[0] if not k.endswith(".alpha")]
    assert any(not torch.equal(live[0][k], ema[0][k]) for k in trained)  # the shadow lags behind the live weights
    updates = 0
    for k in range(2, steps + 1):  # ema[k - 1] holds the shadow after step k
        if k % every:
            expected = {n: ema[k - 2][n] for n in trained}  # no update at this step
        else:
            d = min(decay**every, (1 + updates) / (10 + updates))
            updates += 1
            expected = {n: ema[k - 2][n].double() - (1 - d) * (ema[k - 2][n].double() - live[k - 1][n].double())
                        for n in trained}  # fmt: skip
        for n in trained:
            torch.testing.assert_close(ema[k - 1][n].double(), expected[n].double(), rtol=1e-5, atol=1e-8, msg=n)
    moved = sum(not torch.allclose(ema[-1][n], ema[0][n], rtol=1e-5, atol=1e-8) for n in trained)
    assert moved > len(trained) // 2  # the recurrence was checked on moving weights


# ------------------------------------------------------------------------------------------------- SDXL time_ids
@pytest.fixture(scope="module")
def odd_sizes(tmp_path_factory):
    """Two images whose aspect ratios match no bucket exactly: one wide (100x60), one tall (56x90)."""
    folder = tmp_path_factory.mktemp("odd") / "1_sks shape"
    folder.mkdir()
    for name, (w, h) in {"wide": (100, 60), "tall": (56, 90)}.items():
        img = draw_shape("circle", (200, 40, 40), (30, 60, 170), max(w, h), (10, 10, max(w, h) - 10, max(w, h) - 10))
        img.resize((w, h)).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"sks shape, a {name} red circle\n")
    return folder.parent


def sd_scripts_center_crop(size: tuple[int, int], bucket: tuple[int, int], flipped: bool) -> tuple[int, int]:
    """sd-scripts' arithmetic (BucketManager.select_bucket with predefined buckets, trim_and_resize_if_required):
    scale the image to cover the bucket along the side that fits, then trim the rest evenly. Returns (left, top) in
    pixels of the resized image; a flipped image's left is measured in the mirrored image."""
    (w, h), (bw, bh) = size, bucket
    scale = bh / h if w / h > bw / bh else bw / w
    resized = (int(w * scale + 0.5), int(h * scale + 0.5))
    left, top = (resized[0] - bw) // 2, (resized[1] - bh) // 2
    return (resized[0] - left - bw if flipped else left), top


@pytest.mark.parametrize("flip", [False, True])
def test_sdxl_step_hands_the_unet_diffusers_time_ids(tiny_dir, odd_sizes, tmp_path, monkeypatch, flip):
    """What the UNet receives equals diffusers' StableDiffusionXLPipeline._get_add_time_ids for (original size, crop
    top-left, target size), the crop being sd-scripts' centre trim of the resized image (mirrored when flipped, as
    diffusers' SDXL training example does; sd-scripts reports a letterbox formula instead, docs/data.md)."""
    from library.families import get_family
    from library.sampling.schedulers import make_scheduler

    seen: list[tuple] = []
    runs = []
    start = run_setup.start
    monkeypatch.setattr(run_setup, "start", lambda cfg: runs.append(start(cfg)) or runs[-1])
    batch_loss = loop.batch_loss

    def spy(m, batch, generator, **kwargs):
        unet = m.denoiser
        forward = unet.forward

        def capture(*args, added_cond_kwargs=None, **kw):
            seen.append((batch.image_paths[0], bool(batch.flipped[0]), tuple(batch.pixels.shape[-2:]),
                         added_cond_kwargs["time_ids"].detach().clone()))  # fmt: skip
            return forward(*args, added_cond_kwargs=added_cond_kwargs, **kw)

        unet.forward = capture
        try:
            return batch_loss(m, batch, generator, **kwargs)
        finally:
            del unet.forward

    monkeypatch.setattr(loop, "batch_loss", spy)
    argv = lora_args(tiny_dir / "sdxl", odd_sizes, tmp_path, "--enable_bucket", "--min_bucket_reso", "32",
                     "--max_bucket_reso", "128", "--bucket_reso_steps", "32", *(["--flip_aug"] if flip else []),
                     steps=4)  # fmt: skip
    assert sdxl_train_network.run(argv).steps == 4
    parts = runs[0].parts
    pipe = get_family("sdxl").pipeline(parts, make_scheduler("ddim", parts.scheduler_config))
    projection = parts.text_encoders[1].config.projection_dim
    assert len(seen) == 4 and {Path(p).stem for p, *_ in seen} == {"wide", "tall"}
    if flip:
        assert {f for _, f, *_ in seen} == {True, False}  # both orientations were drawn (seeded)
    for path, flipped, (th, tw), time_ids in seen:
        w, h = Image.open(path).size
        left, top = sd_scripts_center_crop((w, h), (tw, th), flipped)
        assert (left, top) != (0, 0) and (w, h) != (tw, th)  # a real crop of a resized, non-square image
        expected = pipe._get_add_time_ids((h, w), (top, left), (th, tw), torch.float32, projection)
        assert torch.equal(time_ids.float(), expected.reshape(time_ids.shape).float()), (path, flipped, time_ids)


# ------------------------------------------------------------------------------------------------- checkpointing
def test_gradient_checkpointing_checkpoints_and_lowers_the_step_peak(tiny_dir, dataset, tmp_path, monkeypatch):
    """--gradient_checkpointing: the UNet's blocks run through torch.utils.checkpoint, and the step adds fewer tensor
    bytes to what was alive when it began (counted by library/measure/tensor_memory.py; 13 MiB without, none with, at 256 px)
    than the same step without it; the losses agree."""
    import torch.utils.checkpoint as ckpt

    from library.measure.phases import PhasePeaks, instrumented
    from library.measure.tensor_memory import TensorMemory

    def run(out: Path, *extra: str) -> tuple[list[float], float, int]:
        calls = []
        generator = ckpt._checkpoint_without_reentrant_generator

        def spy(fn, *args, **kwargs):
            calls.append(fn)
            return generator(fn, *args, **kwargs)

        monkeypatch.setattr(ckpt, "_checkpoint_without_reentrant_generator", spy)
        argv = lora_args(tiny_dir / "sd1", dataset, out, "--resolution", "256", "--network_train_unet_only",
                         "--cache_latents", "--cache_text_encoder_outputs", *extra, steps=2)  # fmt: skip
        with TensorMemory() as mem:
            peaks = PhasePeaks(lambda: mem.peak_bytes["cpu"], mem.reset_peak)
            start = {}  # what was alive when each phase began (the test session's other tensors included)
            peaks.listeners.append(lambda phase: start.setdefault(phase, mem.live_bytes["cpu"]))
            with instrumented(peaks):
                result = train_network.run(argv)
        monkeypatch.undo()
        return result.losses, peaks.peaks["step"] - start["step"], len(calls)

    plain_losses, plain_extra, plain_calls = run(tmp_path / "plain")
    ckpt_losses, ckpt_extra, ckpt_calls = run(tmp_path / "ckpt", "--gradient_checkpointing")
    assert plain_calls == 0 and ckpt_calls >= 2 * 8  # resnets and transformer blocks, forward and recompute
    assert plain_extra > 4 * 2**20 and ckpt_extra < 0.5 * plain_extra, (ckpt_extra, plain_extra)
    torch.testing.assert_close(torch.tensor(ckpt_losses), torch.tensor(plain_losses), rtol=1e-4, atol=1e-6)
