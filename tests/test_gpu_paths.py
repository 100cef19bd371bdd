"""The GPU paths, proven on the CPU standing in for the GPU: fp16 loss scaling, float8 storage, torch.compile,
text-encoder checkpointing and the precision each part is loaded in.

* ``--full_fp16``: accelerate makes a GradScaler only on CUDA, so here a CPU GradScaler is forced on; without the
  scaler patch every script stops at the first clip or step ("Attempting to unscale FP16 gradients").
* ``--fp8_base``: no float8 tensor reaches any operator but a cast, in the forward, the backward or a checkpointed
  recompute (CPU kernels accept a float8 weight where cuDNN refuses one), and autograd never unpacks a float8 tensor.
"""

from __future__ import annotations

import pytest
import torch
from _scripts import SCRIPTS, family_of, run_script, script_args
from _token_helpers import token_dataset
from torch.utils._pytree import tree_leaves

import train_network
from library.cli.parse import parse_args
from library.cli.problems import ConfigError
from library.files.weights import load_state_dict
from library.run import config as run_config
from library.run import setup as run_setup
from library.run.demo import make_tiny_model

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return token_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(root / name, name) for name in ("sd1", "sdxl")}


def capture_runs(monkeypatch) -> list:
    runs = []
    start = run_setup.start
    monkeypatch.setattr(run_setup, "start", lambda cfg: runs.append(start(cfg)) or runs[-1])
    return runs


# ------------------------------------------------------------------------------------------------- --full_fp16
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_full_fp16_steps_through_a_grad_scaler(script, models, data, tmp_path, monkeypatch):
    """Every script with fp16 trained tensors and a GradScaler (as on CUDA): the scaler scales the loss, unscales
    the fp16 gradients, clips and steps; the trained tensors are fp16 and change."""
    make = run_setup.make_accelerator
    scalers = []

    def with_scaler(*args, **kwargs):
        acc = make(*args, **kwargs)
        acc.scaler, acc.native_amp = torch.amp.GradScaler("cpu", init_scale=1024.0), True
        scalers.append(acc.scaler)
        return acc

    monkeypatch.setattr(run_setup, "make_accelerator", with_scaler)
    steps = []
    step = torch.amp.GradScaler.step
    monkeypatch.setattr(torch.amp.GradScaler, "step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    runs = capture_runs(monkeypatch)
    argv = script_args(script, models[family_of(script)], data, tmp_path, "--mixed_precision", "fp16", "--full_fp16",
                       "--optimizer_type", "Lion", "--max_grad_norm", "1.0", "--save_model_as", "safetensors",
                       "--save_state", steps=2)  # fmt: skip
    result = run_script(script, argv)
    assert result.failed is None and result.steps == 2 and len(steps) == 2
    trained = load_state_dict(result.state / "trained.safetensors")[0]
    floats = [t for t in trained.values() if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float16 for t in floats)
    assert all(torch.isfinite(t).all() for t in floats)
    assert scalers[0].get_scale() > 0 and all(torch.isfinite(torch.tensor(x)) for x in result.losses)
    assert runs


def test_full_fp16_refuses_adam_state_in_float16_before_loading(models, data, tmp_path):
    """torch's AdamW on float16 weights (its per-tensor and multi-tensor paths, CUDA's default) turns a zero gradient
    into 0/0 on its first step: the NaN the H200 run met at step 2. --full_fp16 with such an optimizer stops before
    any model loads and names the optimizers that work; AdamW8bit passes the check."""
    for foreach in (False, True):  # the premise, as torch computes it today
        weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
        weight.grad = torch.tensor([1e-4, 0.0, 0.0], dtype=torch.float16)
        torch.optim.AdamW([weight], lr=1e-3, foreach=foreach).step()
        assert not torch.isfinite(weight).all()
    argv = script_args("train_network", models["sd1"], data, tmp_path, "--mixed_precision", "fp16", "--full_fp16")

    def read(extra):
        args = parse_args(train_network.build_parser(), [*argv, *extra])
        return run_config.read_config(args, ("sd1", "sd2"), train_network.AdapterMethod.from_args)

    with pytest.raises(ConfigError, match=r"--full_fp16 with --optimizer_type AdamW: .*AdamW8bit"):
        read([])
    for fine in ("AdamW8bit", "Adafactor", "Lion", "SGDNesterov"):
        assert read(["--optimizer_type", fine]).run.full_fp16


# ------------------------------------------------------------------------------------------------- --fp8_base
class NoFloat8Compute(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails any operator other than a cast or a view that gets a float8 tensor (cuDNN's convolution backward, the
    matmuls, ... refuse float8 on CUDA); counts the casts from float8 (the layers that ran in float8 storage)."""

    ALLOWED = {"_to_copy", "copy_", "detach", "alias", "view", "t", "as_strided", "_has_compatible_shallow_copy_type",
               "lift_fresh", "set_", "empty_like", "clone"}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fp8 = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dtype in FLOAT8]
        name = func._schema.name.split("::")[-1]
        if fp8 and name not in self.ALLOWED:
            raise AssertionError(f"{func} got a float8 tensor {tuple(fp8[0].shape)}")
        if fp8 and name == "_to_copy":
            self.casts += 1
        return func(*args, **kwargs)


def check_unpacked(tensor):
    assert tensor.dtype not in FLOAT8, f"autograd unpacked a float8 tensor {tuple(tensor.shape)} for backward"
    return tensor


@pytest.mark.parametrize(
    "family,conv,checkpointing,unpack_check",
    [("sd1", False, False, False), ("sd1", True, False, False), ("sd1", True, False, True), ("sd1", True, True, False),
     ("sd1", True, True, True), ("sdxl", False, False, False), ("sdxl", True, True, False),
     ("sdxl", True, True, True)],
)  # fmt: skip
def test_fp8_base_never_computes_with_float8(family, conv, checkpointing, unpack_check, models, data, tmp_path,
                                             monkeypatch):  # fmt: skip
    """With the unpack check, autograd keeps the compute copies themselves (the layer's recast notes stand aside
    for an outer saved-tensor hook); without it, the notes are made and backward casts again: float8 reaches no
    operator but a cast either way."""
    script = "train_network" if family == "sd1" else "sdxl_train_network"
    extra = ["--mixed_precision", "bf16", "--fp8_base"]
    extra += ["--network_args", "conv_dim=4", "conv_alpha=2"] if conv else []
    extra += ["--gradient_checkpointing"] if checkpointing else []
    runs = capture_runs(monkeypatch)
    mode = NoFloat8Compute()
    unpacked = torch.autograd.graph.saved_tensors_hooks(lambda t: t, check_unpacked)
    with mode, unpacked if unpack_check else __import__("contextlib").nullcontext():
        result = run_script(script, script_args(script, models[family], data, tmp_path, *extra, steps=2))
    assert result.failed is None and result.steps == 2
    parts = runs[0].parts
    stored = [m for m in parts.denoiser.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)]
    assert sum(m.weight.dtype == torch.float8_e4m3fn for m in stored) > len(stored) // 2
    te_linear = next(m for m in parts.text_encoders[0].modules() if isinstance(m, torch.nn.Linear))
    assert te_linear.weight.dtype == torch.float8_e4m3fn  # --fp8_base stores the text encoders too
    assert mode.casts > len(stored)  # the float8 layers did run, through their compute-dtype copies


def test_fp8_base_trains_like_bf16(models, data, tmp_path):
    """float8 storage changes only the rounding of the frozen weights: the loss stays within a few percent."""
    base = script_args("train_network", models["sd1"], data, tmp_path / "a", "--mixed_precision", "bf16", steps=4)
    bf16 = run_script("train_network", base)
    fp8 = run_script("train_network", [*base, "--fp8_base", "--output_dir", str(tmp_path / "b")])
    assert fp8.steps == bf16.steps == 4
    torch.testing.assert_close(torch.tensor(fp8.losses), torch.tensor(bf16.losses), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("script", ["fine_tune", "train_textual_inversion"])
def test_fp8_base_stores_only_frozen_weights(script, models, data, tmp_path, monkeypatch, caplog):
    """fine_tune.py trains the UNet and text encoder: they keep the training dtype, and the run says so; textual
    inversion trains token rows only, so its UNet and text-encoder layers are stored in float8 and it trains."""
    runs = capture_runs(monkeypatch)
    argv = script_args(script, models["sd1"], data, tmp_path, "--mixed_precision", "bf16", "--fp8_base",
                       "--save_model_as", "safetensors", steps=2)  # fmt: skip
    result = run_script(script, argv)
    assert result.failed is None and result.steps == 2
    parts = runs[0].parts
    if script == "fine_tune":
        assert "this script trains the UNet, which stays in float32" in caplog.text
        assert all(p.dtype == torch.float32 for p in parts.denoiser.parameters())
    else:
        assert parts.denoiser.conv_in.weight.dtype == torch.float8_e4m3fn
        te = parts.text_encoders[0]
        assert next(m for m in te.modules() if isinstance(m, torch.nn.Linear)).weight.dtype == torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------- torch.compile
def test_torch_compile_keeps_the_adapter_keys(models, data, tmp_path, monkeypatch):
    """SDXL: compiled before injection, the keys got ``_orig_mod`` and the sgm renaming failed outright.

    The compiled run goes through torch.compile's wrapper (what names the keys) under the ``force_eager`` stance:
    the wrapped UNet runs its Python forward instead of being traced by dynamo (~30 s of tracing on the tiny UNet
    that would check kernels, not the keys this test is about)."""
    family, script = "sdxl", "sdxl_train_network"
    compiled = []
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(kw) or compile_(model, **kw))
    plain = run_script(script, script_args(script, models[family], data, tmp_path / "a", steps=1))
    argv = script_args(script, models[family], data, tmp_path / "b", "--torch_compile", "--dynamo_backend", "eager",
                       steps=1)  # fmt: skip
    with torch.compiler.set_stance("force_eager"):
        result = run_script(script, argv)
    assert compiled == [{"backend": "eager"}]
    keys = set(load_state_dict(result.output)[0])
    assert keys == set(load_state_dict(plain.output)[0]) and not any("orig_mod" in k for k in keys)


# ------------------------------------------------------------------------------------------------- loading
def test_each_part_is_loaded_in_its_own_precision(models, data, tmp_path, monkeypatch):
    """fine_tune.py under mixed precision starts from the file's float32 UNet and text encoder (not half-rounded
    ones); --no_half_vae keeps the file's float32 VAE; frozen parts are half precision."""
    from library.families import get_family

    reference = get_family("sd1").load(models["sd1"])  # float32, as in the file
    runs = capture_runs(monkeypatch)
    captured = {}
    load_model = run_setup.load_model

    def keep_loaded(cfg, acc):
        parts = load_model(cfg, acc)
        captured["unet"] = {k: v.clone() for k, v in parts.denoiser.state_dict().items()}
        captured["te"] = {k: v.clone() for k, v in parts.text_encoders[0].state_dict().items()}
        captured["vae"] = {k: v.clone() for k, v in parts.vae.state_dict().items()}
        return parts

    monkeypatch.setattr(run_setup, "load_model", keep_loaded)
    argv = script_args("fine_tune", models["sd1"], data, tmp_path, "--mixed_precision", "bf16", "--no_half_vae",
                       "--save_model_as", "safetensors", steps=1)  # fmt: skip
    assert run_script("fine_tune", argv).steps == 1
    for name, module in (("unet", reference.denoiser), ("te", reference.text_encoders[0]), ("vae", reference.vae)):
        for key, value in module.state_dict().items():
            assert torch.equal(captured[name][key], value), (name, key)  # float32 bit for bit
    frozen = run_script("train_network", script_args("train_network", models["sd1"], data, tmp_path / "lora",
                                                     "--mixed_precision", "bf16", steps=1))  # fmt: skip
    assert frozen.steps == 1 and runs[-1].parts.vae.encoder.conv_in.weight.dtype == torch.bfloat16
    assert runs[-1].parts.denoiser.conv_in.weight.dtype == torch.bfloat16


def test_trained_text_encoder_checkpoints_its_layers(models, data, tmp_path, monkeypatch):
    """--gradient_checkpointing reaches the text encoder when it is trained (transformers checkpoints a layer only
    in training mode): its layers run through torch.utils.checkpoint, and the run trains."""
    import torch.utils.checkpoint as ckpt
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer

    calls = []
    generator = ckpt._checkpoint_without_reentrant_generator  # what every non-reentrant checkpoint call runs

    def spy(fn, *args, **kwargs):
        inner = fn
        while hasattr(inner, "func"):  # functools.partial around the layer's __call__
            inner = inner.func
        owner = getattr(inner, "__self__", None)
        calls.append(type(owner).__name__ if owner is not None else getattr(inner, "__qualname__", ""))
        return generator(fn, *args, **kwargs)

    monkeypatch.setattr(ckpt, "_checkpoint_without_reentrant_generator", spy)
    argv = script_args("train_network", models["sd1"], data, tmp_path, "--gradient_checkpointing", steps=1)
    assert run_script("train_network", argv).steps == 1
    assert sum(c.startswith(CLIPEncoderLayer.__name__) for c in calls) >= 2, calls[:10]
