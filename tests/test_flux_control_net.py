"""FLUX.1 ControlNet (flux_train_control_net.py, flux_minimal_inference.py --control_net_models) on a tiny FLUX.1-dev.

Oracles: a fresh ControlNet leaves the transformer's output unchanged, bit for bit (zero-initialised outputs);
its residuals equal diffusers' own ``FluxControlNetModel.forward``; the file's keys and shapes are those of
sd-scripts' ``ControlNetFlux`` for the same model (recorded by benchmarks/flux_controlnet_vs_sdscripts.py, which also
runs sd-scripts' module on our file: strict load, same forward); the file reads back to the trained tensors; a
training batch's control images serve its own prediction only; a trained ControlNet changes samples (``--cn``) and flux_minimal_inference.py's image, multiplier 0 gives the plain
image; 1 step + ``--resume`` repeats 2 uninterrupted steps bit for bit; block swapping (the deprecated
``--double_blocks_to_swap --single_blocks_to_swap``) trains the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

import flux_train_control_net as script
from library.families.base import Cond
from library.families.flux import controlnet as C
from library.families.flux.controlnet_trainable import FluxControlNet
from library.families.flux.tiny import build_tiny_flux, write_tiny_files
from library.families.registry import FAMILIES
from library.files.weights import load_state_dict

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = json.loads((ROOT / "tests" / "data" / "sd_scripts_flux_controlnet_tiny_layout.json").read_text())


def _inputs(b: int = 2) -> tuple[torch.Tensor, torch.Tensor, Cond, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    cond = Cond(torch.randn(b, 7, 32, generator=g), torch.randn(b, 32, generator=g), None)
    image = torch.rand(b, 3, 64, 64, generator=g) * 2 - 1
    return torch.randn(b, 16, 8, 8, generator=g), torch.tensor([700.0, 200.0][:b]), cond, image


def test_fresh_controlnet_is_exact_no_op_and_its_file_is_sd_scripts_layout():
    torch.manual_seed(0)
    family, transformer = FAMILIES["flux-dev"], build_tiny_flux("flux-dev").denoiser
    noisy, t, cond, image = _inputs()
    with torch.no_grad():
        plain = family.predict(transformer, noisy, t, cond)
        net = FluxControlNet.create(transformer)
        net.use_guide_image(image)
        assert torch.equal(family.predict(transformer, noisy, t, cond), plain)  # zero outputs: exactly the base
        file = net.state_dict_for_file()
        assert {k: list(v.shape) for k, v in file.items()} == LAYOUT  # sd-scripts' ControlNetFlux, key by key
        for p in net.model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        guided = family.predict(transformer, noisy, t, cond)
        assert (guided - plain).abs().max() > 1e-3
        # our residuals = diffusers' FluxControlNetModel.forward on the same call (no T5 mask)
        kwargs = dict(hidden_states=torch.randn(2, 16, 64), encoder_hidden_states=cond.hidden_states,
                      pooled_projections=cond.pooled, timestep=t / 1000, guidance=torch.tensor([3.5, 3.5]),
                      img_ids=torch.randint(0, 4, (16, 3)).float(), txt_ids=torch.zeros(7, 3))  # fmt: skip
        theirs = net.model(controlnet_cond=image, return_dict=False, **kwargs)[0]
        for a, b in zip(C.residuals(net.model, image, kwargs), theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        # --mixed_precision bf16: bf16 inputs, fp32 ControlNet weights: the fp32 computation, rounded to bf16
        half = {k: v.bfloat16() for k, v in kwargs.items()}
        same = C.residuals(net.model, image.bfloat16().float(), {k: v.float() for k, v in half.items()})
        for a, b in zip(C.residuals(net.model, image.bfloat16(), half), same, strict=True):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b.bfloat16())
        net.set_multiplier(0.0)
        assert torch.equal(family.predict(transformer, noisy, t, cond), plain)
        net.set_multiplier(1.0)
        # a training batch's images serve its own prediction only (a later sample without --cn is plain)
        net.set_cond_image(image)
        assert torch.equal(family.predict(transformer, noisy, t, cond), guided)
        assert torch.equal(family.predict(transformer, noisy, t, cond), plain)
        # the file reads back into a fresh ControlNet (our loader) with the same forward
        back = FluxControlNet(transformer, C.build_controlnet(transformer, copy_weights=False))
        net.remove()
        back.load_file_tensors(net.state_dict_for_file(), "file")
        back.use_guide_image(image)
        assert torch.equal(family.predict(transformer, noisy, t, cond), guided)
    with pytest.raises(ValueError, match="not a FLUX ControlNet file"):
        back.load_file_tensors({"lora_unet_x.lora_down.weight": torch.zeros(1)}, "lora.safetensors")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Tiny FLUX.1-dev files (3 double, 4 single blocks: room for --blocks_to_swap 2), the demo's shapes and their
    inverted greyscale as conditioning images."""
    from library.run.demo import make_example_dataset

    root = tmp_path_factory.mktemp("flux_cn")
    files = {k: str(v) for k, v in write_tiny_files(build_tiny_flux("flux-dev", blocks=(3, 4)), root / "m").items()}
    data = make_example_dataset(root / "data") / "10_sks shape"
    cond = data.parent / "cond"
    cond.mkdir()
    for img in sorted(data.glob("*.png")):
        ImageOps.invert(Image.open(img).convert("L")).convert("RGB").save(cond / img.name)
    return root, files, data, cond


def _train(setup, out: Path, steps: int, *extra: str):
    root, files, data, cond = setup
    argv = ["--pretrained_model_name_or_path", files["model"], "--clip_l", files["clip_l"], "--t5xxl", files["t5xxl"],
            "--ae", files["ae"], "--train_data_dir", str(data), "--conditioning_data_dir", str(cond),
            "--resolution", "64", "--output_dir", str(out), "--output_name", "cn", "--max_train_steps", str(steps),
            "--learning_rate", "1e-3", "--optimizer_type", "adamw", "--seed", "1", "--train_batch_size", "2",
            "--cache_latents", "--cache_text_encoder_outputs", "--t5xxl_max_token_length", "16",
            "--max_data_loader_n_workers", "0", "--gradient_checkpointing", *extra]  # fmt: skip
    return script.run(argv)


def test_trains_samples_resumes_and_generates(setup, tmp_path):
    root, files, data, cond = setup
    guides = sorted(cond.glob("*.png"))
    prompts = tmp_path / "p.txt"
    line = "sks shape --w 64 --h 64 --d 3 --s 2"
    prompts.write_text(f"{line}\n{line} --cn {guides[0]}\n")  # samples 00 (right after a step) and 01 (--cn)
    full = _train(setup, tmp_path / "a", 2, "--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
                  "--save_every_n_steps", "1", "--save_state")  # fmt: skip
    samples = sorted(p for p in (tmp_path / "a" / "sample").glob("*.png") if "grid" not in p.name)
    without, with_cn = (np.asarray(Image.open(p)) for p in samples)
    assert not np.array_equal(with_cn, without)
    trained = load_state_dict(full.output)[0]
    assert {k: list(v.shape) for k, v in trained.items()} == LAYOUT  # 2 ControlNet blocks of a 3-block model
    assert trained["controlnet_blocks.0.weight"].abs().max() > 0  # the zero outputs trained

    state = next((tmp_path / "a").glob("*00001-state"))  # the state after step 1
    resumed = load_state_dict(_train(setup, tmp_path / "c", 2, "--resume", str(state)).output)[0]
    swapped = load_state_dict(_train(setup, tmp_path / "d", 2, "--double_blocks_to_swap", "1",
                                     "--single_blocks_to_swap", "2").output)[0]  # fmt: skip
    for k, v in trained.items():
        assert torch.equal(resumed[k], v), k
        assert torch.equal(swapped[k], v), k
    _inference_uses_the_file(files, full.output, guides, tmp_path / "gen")


def _inference_uses_the_file(files: dict, controlnet: Path, guides: list[Path], out: Path) -> None:
    import flux_minimal_inference as inference

    base = [
        "--ckpt_path",
        files["model"],
        "--clip_l",
        files["clip_l"],
        "--t5xxl",
        files["t5xxl"],
        "--ae",
        files["ae"],
        "--prompt",
        "sks shape",
        "--seed",
        "3",
        "--steps",
        "2",
        "--width",
        "64",
        "--height",
        "64",
        "--dtype",
        "fp32",
    ]
    cn = ["--control_net_models", str(controlnet), "--guide_image_path"]  # fmt: skip

    def image(name: str, *extra: str) -> np.ndarray:
        [path] = inference.run([*base, "--output_dir", str(out / name), *extra])
        return np.asarray(Image.open(path))

    plain = image("plain")
    assert np.array_equal(image("zero", *cn, str(guides[0]), "--control_net_multipliers", "0"), plain)
    a, b = image("a", *cn, str(guides[0])), image("b", *cn, str(guides[1]))
    assert not np.array_equal(a, plain) and not np.array_equal(a, b)


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--guide_image_path", "{img}"], "--guide_image_path without --control_net_models"),
        (["--control_net_models", "{cn}"], "--guide_image_path: give one control image"),
        (["--control_net_models", "{cn}", "{cn}", "--guide_image_path", "{img}", "--control_net_multipliers", "1"],
         "--control_net_multipliers: 1 value"),
        (["--control_net_models", "missing.safetensors", "--guide_image_path", "{img}"], "missing.safetensors: no such"),
    ],
)  # fmt: skip
def test_inference_control_flags_are_checked_before_loading(tmp_path, flags, expect):
    import flux_minimal_inference as inference
    from library.cli.problems import ConfigError

    (tmp_path / "cn.safetensors").write_bytes(b"")
    (tmp_path / "img.png").write_bytes(b"")
    argv = [
        "--ckpt_path",
        str(tmp_path),
        *(f.format(cn=tmp_path / "cn.safetensors", img=tmp_path / "img.png") for f in flags),
    ]
    with pytest.raises(ConfigError, match=expect):
        inference.InferenceConfig.from_args(inference.build_parser().parse_args(argv))
