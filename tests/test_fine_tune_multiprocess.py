"""Two processes on CPU (accelerate launch --multi_gpu, gloo) against one: fine_tune.py's model goes through
accelerate's DDP, train_network.py's adapters and train_textual_inversion.py's rows average their gradients by
hand; either way both processes end with identical weights, and two processes with batch 1 train what one process
with batch 2 trains (fp32 tolerance) when each sample's noise and timestep depend only on the sample
(tests/_per_sample_noise.py makes them so; the VAE latents are the distribution's mean)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _launch import KEEP_PROCESS_GROUP, two_processes
from _per_sample_noise import install

ROOT = Path(__file__).resolve().parents[1]

_WRAPPER = """
import importlib, json, sys
sys.path[:0] = [{root!r}, {tests!r}]
import fine_tune, train_network, train_textual_inversion
from _per_sample_noise import install

now = {{}}
install(now)
{keep_group}
for script, out, argv in json.loads(open(sys.argv[1]).read()):  # one run after another
    now["out"] = out
    if not importlib.import_module(script).run(argv).output:
        sys.exit(1)
"""

# what each script trains, on top of the common flags
TRAINS = {
    "fine_tune": ["--train_text_encoder", "--learning_rate", "0.05"],
    "train_network": ["--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "2",
                      "--learning_rate", "0.5"],
    "train_textual_inversion": ["--token_string", "shapetok", "--init_word", "shape", "--num_vectors_per_token", "2",
                                "--learning_rate", "0.5"],
}  # fmt: skip


def _argv(out: Path, data: Path, model: Path, batch: int, script: str, *extra: str) -> list[str]:
    return [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
        "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "m",
        "--save_model_as", "safetensors", "--optimizer_type", "SGDNesterov", *TRAINS[script],
        "--train_batch_size", str(batch), "--max_train_steps", "3", "--max_data_loader_n_workers", "0", "--seed", "3",
        *extra,
    ]  # fmt: skip


def _run(tmp: Path, data: Path, model: Path, processes: int, batch: int, jobs: dict[str, tuple]) -> dict:
    """``jobs`` (name -> script and extra flags) run one after another in the same process(es): one process is this
    one, two are a launch; each job's trained parameters, per process."""
    runs = []
    for name, (script, *extra) in jobs.items():
        out = tmp / name
        out.mkdir()
        runs.append((script, str(out), _argv(out, data, model, batch, script, *extra)))
    if processes == 1:
        now = {}
        undo = install(now)
        try:
            with pytest.MonkeyPatch.context() as env:
                env.setenv("ACCELERATE_USE_CPU", "true")  # as the launch (CPU, gloo), also on a machine with a GPU
                for script, out, argv in runs:
                    now["out"] = out
                    assert importlib.import_module(script).run(argv).output, script
        finally:
            undo()
    else:
        listing = tmp / "jobs.json"
        listing.write_text(json.dumps(runs))
        wrapper = tmp / "wrapper.py"
        wrapper.write_text(_WRAPPER.format(root=str(ROOT), tests=str(ROOT / "tests"), keep_group=KEEP_PROCESS_GROUP))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
        result = subprocess.run([*two_processes(), str(wrapper), str(listing)], cwd=tmp, env=env, capture_output=True,
                                text=True, timeout=600)  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return {name: [torch.load(tmp / name / f"params_{i}.pt", weights_only=True) for i in range(processes)]
            for name in jobs}  # fmt: skip


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    """Two different images, one repeat, a new token in the captions: every step sees both."""
    from library.run.demo import make_example_dataset, make_tiny_model

    root = tmp_path_factory.mktemp("two")
    model = make_tiny_model(root / "model", "sd1")
    four = make_example_dataset(root / "four")
    data = root / "data" / "1_sks shape"
    data.mkdir(parents=True)
    for p in sorted((four / "10_sks shape").glob("*.png"))[:2]:
        shutil.copy(p, data / p.name)
        (data / p.with_suffix(".txt").name).write_text(p.with_suffix(".txt").read_text().replace("sks", "shapetok"))
    return model, data.parent


def _doubled_lr() -> str:
    flags = TRAINS["train_network"]
    return str(2 * float(flags[flags.index("--learning_rate") + 1]))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, two_images):
    """Every script trained by one process with batch 2, and train_network.py once more at twice the learning rate:
    the test's process runs the four one after another (each run starts afresh as its command line would: a single
    process resets accelerate's state)."""
    model, data = two_images
    jobs = {script: (script,) for script in TRAINS}
    jobs["doubled"] = ("train_network", "--learning_rate", _doubled_lr())
    return {name: runs[0] for name, runs in _run(tmp_path_factory.mktemp("one"), data, model, 1, 2, jobs).items()}


def test_two_processes_agree_and_equal_one_process_with_the_total_batch(tmp_path, two_images, one_process):
    """Full models go through accelerate's DDP; adapters and embeddings average their gradients by hand: either
    way two processes with batch 1 train what one process with batch 2 trains (a sum instead of the mean would
    double every step). The three scripts run one after another in one launch (one start-up of two processes)."""
    model, data = two_images
    two_runs = _run(tmp_path, data, model, 2, 1, {script: (script,) for script in TRAINS})
    for script, two in two_runs.items():
        one = one_process[script]
        assert all(torch.equal(a, b) for a, b in zip(two[0], two[1])), f"{script}: the processes' weights differ"
        if script == "fine_tune":
            from library.families import get_family

            base = get_family("sd1").load(model)
            start = [*base.denoiser.parameters(), *base.text_encoders[0].parameters()]  # the trainable's order
            assert len(start) == len(one) and sum(not torch.equal(a, b) for a, b in zip(start, one)) > len(one) // 2
        elif script == "train_network":  # a summed gradient = twice the learning rate (SGD): outside the tolerance
            doubled = one_process["doubled"]
            apart = sum(not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(doubled, one))
            assert apart >= max(1, len(one) // 4), "the runs barely trained: the comparison would prove nothing"
        for a, b in zip(two[0], one):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, s=script: f"{s}: {m}")


# ------------------------------------------------------------------------------------------------ FSDP / DeepSpeed
def test_deepspeed_flags_map_to_accelerates_plugin():
    from library.run.engines import DeepSpeedConfig

    ds = DeepSpeedConfig(zero_stage=3, offload_optimizer_device="cpu", offload_param_device="nvme",
                         offload_param_nvme_path="/nvme", zero3_save_16bit_model=True)  # fmt: skip
    config = ds.plugin(batch_size=2, mixed_precision="bf16", max_grad_norm=1.0, full_fp16=False).deepspeed_config
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/nvme"}
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_clipping"] == 1.0
    assert config["bf16"]["enabled"] is True
    fp16 = DeepSpeedConfig(offload_optimizer_device="cpu", fp16_master_weights_and_gradients=True)
    config = fp16.plugin(batch_size=1, mixed_precision="fp16", max_grad_norm=0.0, full_fp16=False).deepspeed_config
    assert config["fp16"]["initial_scale_power"] == 0 and config["fp16"]["fp16_master_weights_and_grads"] is True


def _error(tmp_path, *extra) -> str:
    import fine_tune
    from library.run.demo import make_example_dataset, make_tiny_model

    model, data = make_tiny_model(tmp_path / "model", "sd1"), make_example_dataset(tmp_path / "data")
    with pytest.raises(ValueError) as e:
        fine_tune.run(["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
                        "--output_dir", str(tmp_path / "out"), *extra])  # fmt: skip
    return str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_engines_that_cannot_run_here_say_so(tmp_path, monkeypatch):
    assert "--deepspeed needs CUDA GPUs" in _error(tmp_path, "--deepspeed", "--zero_stage", "3")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert "asks for FSDP, which accelerate runs only on GPUs" in _error(tmp_path)


@pytest.mark.gpu
def test_deepspeed_zero2_trains_on_a_gpu(tmp_path, monkeypatch):
    """One CUDA process with --deepspeed --zero_stage 2 (needs the deepspeed package): trains and saves."""
    pytest.importorskip("deepspeed")
    import fine_tune
    from library.run.demo import make_example_dataset, make_tiny_model

    model, data = make_tiny_model(tmp_path / "model", "sd1"), make_example_dataset(tmp_path / "data")
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512"}
    for name, value in env.items():  # undone after the test: later tests are single-process runs
        monkeypatch.setenv(name, value)
    result = fine_tune.run(["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
                             "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(tmp_path / "o"),
                             "--save_model_as", "safetensors", "--max_train_steps", "2", "--deepspeed",
                             "--zero_stage", "2", "--mixed_precision", "bf16", "--max_data_loader_n_workers", "0"])  # fmt: skip
    assert result.output.exists() and result.steps == 2
