"""Whole runs with the meta device standing in for the GPU (library/measure/simulated_device.py): every tensor the run puts
on the device is checked the way CUDA checks it, heavy compute left on the host fails, and the device-resident bytes
are counted per phase.

Oracle for the checker itself: a run with a part deliberately left on the host fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sdxl_train_network
import train_network
from library.measure.simulated_device import DeviceMismatch, simulated_device
from library.run import setup as run_setup
from library.run.demo import make_example_dataset, make_tiny_model

SEED_004 = Path(__file__).parent / "corpus" / "guide_sdxl_locon.sh"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(root / name, name) for name in ("sd1", "sdxl")}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_example_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def data_once(tmp_path_factory, data):
    """The example images with one repeat: the guide's batch of 8 takes all four in one batch."""
    import shutil

    root = tmp_path_factory.mktemp("once")
    shutil.copytree(next(data.iterdir()), root / "1_sks shape")
    return root


def seed_004_argv(model: Path, data: Path, out: Path, prompts: Path) -> list[str]:
    """The guide's command (tests/corpus/guide_sdxl_locon.sh) with the tiny paths, 64 px and two steps."""
    import shlex

    text = SEED_004.read_text().replace("\\\n", " ")
    words = shlex.split(text[text.index('"./sdxl_train_network.py"') + len('"./sdxl_train_network.py"') :])
    tiny = {"--pretrained_model_name_or_path": str(model), "--train_data_dir": str(data), "--output_dir": str(out),
            "--resolution": "64,64", "--min_bucket_reso": "32", "--max_bucket_reso": "128", "--max_train_steps": "2",
            "--sample_prompts": str(prompts), "--sample_every_n_steps": "2"}  # fmt: skip
    argv = []
    for word in words:
        flag, eq, value = word.partition("=")
        argv.append(f"{flag}={tiny[flag]}" if eq and flag in tiny else word)
    return argv


def test_seed_004_sdxl_command_runs_on_the_simulated_device(models, data_once, tmp_path):
    """Seed 004's command (--lowram, fp16 with a GradScaler, --no_half_vae, cached latents, trained text-encoder
    adapters, checkpointing, accumulation 6, euler_a samples after step 2): every phase runs with its tensors on the
    device (the checks of library/measure/simulated_device.py), and the samples and the adapter are written."""
    prompts = tmp_path / "sample-prompts.txt"
    prompts.write_text("a sks shape --w 64 --h 64 --s 3\nsks shape, red --w 64 --h 64 --s 3 --n blurry\n")
    argv = seed_004_argv(models["sdxl"], data_once, tmp_path / "out", prompts)
    assert "--lowram" in argv and "--mixed_precision=fp16" in argv and "--gradient_accumulation_steps=6" in argv
    with simulated_device() as sim:
        result = sdxl_train_network.run(argv)
    assert result.failed is None and result.steps == 2 and result.output.is_file()
    assert len(list((tmp_path / "out" / "sample").glob("*.png"))) == 3  # 2 prompts + the grid, at step 2
    table = sim.phase_table()
    assert set(table) == {"load", "latent caching", "step", "sampling", "save"}
    assert table["load"] > 0  # --lowram: the weights went to the device as they were read


def test_only_the_part_that_computes_is_on_the_device(models, data, tmp_path, monkeypatch):
    """Caching latents with the VAE alone on the device, text-encoder outputs with the encoders alone; then the
    step with the denoiser; the VAE and the encoders come in for a sampling round and leave after it."""
    where = {}

    def spy(name, function):
        def wrapped(run, *args, **kwargs):
            parts = run.parts
            out = function(run, *args, **kwargs)
            where[name] = {label: {p.device.type for p in m.parameters()}
                           for label, m in (("unet", parts.denoiser), ("vae", parts.vae),
                                            ("te", parts.text_encoders[0]))}  # fmt: skip
            return out

        return wrapped

    from library import data as data_module

    inside, current = {}, {}
    fill_latent_cache, cache_latents = run_setup.fill_latent_cache, data_module.cache_latents
    cache_texts = data_module.cache_text_encoder_outputs

    def devices(*modules):
        return [next(m.parameters()).device.type for m in modules]

    def keep_run(run):
        current["run"] = run
        return fill_latent_cache(run)

    def latents(plan, encode, *args, **kwargs):  # while the latents are encoded
        def spied(*a):
            parts = current["run"].parts
            inside["latents"] = devices(parts.denoiser, parts.vae, parts.text_encoders[0])
            return encode(*a)

        return cache_latents(plan, spied, *args, **kwargs)

    def texts(plan, encode, *args, **kwargs):  # while the captions are encoded
        def spied(*a):
            parts = current["run"].parts
            inside["texts"] = devices(parts.denoiser, parts.vae, parts.text_encoders[0])
            return encode(*a)

        return cache_texts(plan, spied, *args, **kwargs)

    monkeypatch.setattr(data_module, "cache_latents", latents)
    monkeypatch.setattr(data_module, "cache_text_encoder_outputs", texts)

    monkeypatch.setattr(run_setup, "place_for_training", spy("step", run_setup.place_for_training))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a sks shape --w 64 --h 64 --s 2\n")
    argv = ["--pretrained_model_name_or_path", str(models["sd1"]), "--train_data_dir", str(data), "--caption_extension",
            ".txt", "--resolution", "64", "--output_dir", str(tmp_path), "--output_name", "t", "--network_module",
            "networks.lora", "--network_train_unet_only", "--max_train_steps", "2", "--max_data_loader_n_workers",
            "0", "--seed", "1", "--mixed_precision", "bf16", "--fp8_base", "--cache_latents",
            "--cache_text_encoder_outputs", "--sample_prompts", str(prompts), "--sample_every_n_steps", "2"]  # fmt: skip
    monkeypatch.setattr(run_setup, "fill_latent_cache", keep_run)
    with simulated_device():
        result = train_network.run(argv)
    assert result.steps == 2 and len(list((tmp_path / "sample").glob("*.png"))) == 2
    assert inside == {"latents": ["cpu", "meta", "cpu"], "texts": ["cpu", "cpu", "meta"]}
    assert where["step"] == {"unet": {"meta"}, "vae": {"cpu"}, "te": {"cpu"}}


def test_a_part_left_on_the_host_fails_like_on_a_gpu(models, data, tmp_path, monkeypatch):
    """The checker's own oracle: when sampling does not bring the cached-away VAE to the device, the run fails."""
    import library.sampling.training as sampling_training

    monkeypatch.setattr(sampling_training, "on_device", lambda modules, device: __import__("contextlib").nullcontext())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a sks shape --w 64 --h 64 --s 2\n")
    argv = ["--pretrained_model_name_or_path", str(models["sd1"]), "--train_data_dir", str(data), "--caption_extension",
            ".txt", "--resolution", "64", "--output_dir", str(tmp_path), "--output_name", "t", "--network_module",
            "networks.lora", "--max_train_steps", "1", "--max_data_loader_n_workers", "0", "--seed", "1",
            "--cache_latents", "--sample_prompts", str(prompts), "--sample_every_n_steps", "1"]  # fmt: skip
    with simulated_device(), pytest.raises(DeviceMismatch, match="sampling"):
        train_network.run(argv)


def test_a_step_reads_the_device_once(models, data, tmp_path):
    """One host read per optimizer step (the window's loss, NaN and stop flags together), however many batches the
    window has: no per-batch NaN check, timestep range check or schedule lookup on the host."""
    argv = ["--pretrained_model_name_or_path", str(models["sd1"]), "--train_data_dir", str(data), "--caption_extension",
            ".txt", "--resolution", "64", "--output_dir", str(tmp_path), "--output_name", "t", "--network_module",
            "networks.lora", "--max_train_steps", "2", "--gradient_accumulation_steps", "2",
            "--max_data_loader_n_workers", "0", "--seed", "1", "--mixed_precision", "bf16", "--min_snr_gamma", "5",
            "--huber_schedule", "exponential", "--loss_type", "huber", "--noise_offset", "0.05"]  # fmt: skip
    with simulated_device() as sim:
        result = train_network.run(argv)
    assert result.steps == 2
    assert sim.host_reads_by_phase["step"] == 2


def test_device_mismatch_is_caught_where_meta_kernels_do_not_check():
    """conv2d of a meta input with host weights runs on meta kernels without a word; the simulated device fails it."""
    from library.measure.simulated_device import SimulatedDevice

    x, w = torch.ones(1, 2, 4, 4, device="meta"), torch.ones(2, 2, 3, 3)
    assert torch.nn.functional.conv2d(x, w).device.type == "meta"  # no check without the mode
    with SimulatedDevice(), pytest.raises(DeviceMismatch, match="same device"):
        torch.nn.functional.conv2d(x, w)


def test_grouped_query_attention_without_a_mask_is_counted_as_the_fused_kernel():
    """transformers passes ``enable_gqa=True`` only without a mask, where CUDA's flash kernel takes the fewer key /
    value heads as they are: the count is the fused kernel's (the same as with the heads repeated), not the attention
    matrix of torch's math path; with a mask torch's own path stays (CUDA's fused kernels refuse it)."""
    from library.measure.simulated_device import SimulatedDevice, fused_attention

    def added_peak(heads_kv: int, gqa: bool, mask: bool = False) -> int:
        q = torch.empty(1, 8, 256, 16, device="meta")
        k, v = (torch.empty(1, heads_kv, 256, 16, device="meta") for _ in "kv")
        attn_mask = torch.ones(256, 256, dtype=torch.bool, device="meta") if mask else None
        with SimulatedDevice() as sim, fused_attention():
            before = sim.live_bytes["meta"]
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
            return sim.peak_bytes["meta"] - before

    fused = added_peak(8, False)
    assert fused < 256 * 256 * 8 * 4  # output and softmax statistics, no 8 x 256 x 256 matrix
    assert added_peak(2, True) == fused
    assert added_peak(2, True, mask=True) > 256 * 256 * 8 * 4  # torch's math path: the matrix
