"""train_control_net.py / sdxl_train_control_net.py end to end on the tiny models, in-process: a fresh ControlNet
leaves the UNet's output exactly as it was, a trained one writes sd-scripts' key names that diffusers'
``ControlNetModel.from_single_file`` reads back to the trained weights, a resumed run repeats the uninterrupted one
bit for bit, and the training samples see their ``--cn`` image."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file

import sdxl_train_control_net
import train_control_net
from library.cli.problems import ConfigError
from networks.controlnet import ControlNet, controlnet_from_unet, load_controlnet


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The demo's shapes as training images and their inverted greyscale as conditioning images."""
    from library.run.demo import make_example_dataset

    root = make_example_dataset(tmp_path_factory.mktemp("controlnet")) / "10_sks shape"
    cond = root.parent / "cond"
    cond.mkdir()
    for img in sorted(root.glob("*.png")):
        ImageOps.invert(Image.open(img).convert("L")).convert("RGB").save(cond / img.name)
    return root, cond


def _argv(model: Path, pairs, out: Path, steps: int, *extra: str) -> list[str]:
    images, cond = pairs
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(images),
            "--conditioning_data_dir", str(cond), "--resolution", "64", "--train_batch_size", "2",
            "--output_dir", str(out), "--output_name", "cn", "--max_train_steps", str(steps), "--seed", "42",
            "--learning_rate", "2e-3", "--optimizer_type", "adamw", "--max_data_loader_n_workers", "0",
            "--cache_latents", *extra]  # fmt: skip


@pytest.mark.parametrize("name", ["sd1", "sdxl"])
def test_a_fresh_controlnet_leaves_the_unet_output_unchanged(tiny_parts, name):
    """Zero-initialised output convolutions: with the guide image the UNet's output is bit-identical (step 0)."""
    from library.families.registry import FAMILIES

    family, parts = FAMILIES[name], copy.deepcopy(tiny_parts[name])
    unet = parts.denoiser.eval()
    gen = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 4, 8, 8, generator=gen)
    cond = family.encode_prompt(parts, ["a", "b"])
    time_ids = family.size_conditioning([(64, 64)] * 2, [(0, 0)] * 2, [(64, 64)] * 2)
    kwargs = {} if time_ids is None else {"time_ids": time_ids}
    t = torch.tensor([10, 500])
    with torch.no_grad():
        plain = family.predict(unet, noisy, t, cond, **kwargs)
        net = ControlNet(unet, controlnet_from_unet(unet))
        net.set_cond_image(torch.rand(2, 3, 64, 64, generator=gen))
        controlled = family.predict(unet, noisy, t, cond, **kwargs)
        with torch.no_grad():  # a changed zero convolution does reach the output (the hook runs)
            net.controlnet.controlnet_mid_block.bias.fill_(0.1)
        changed = family.predict(unet, noisy, t, cond, **kwargs)
    net.remove()
    assert torch.equal(plain, controlled)
    assert not torch.allclose(plain, changed)


def _single_file_equals(path: Path, model: torch.nn.Module, tmp_path: Path) -> None:
    """diffusers' ``from_single_file`` (given the tiny config) reads the file to exactly ``model``'s tensors."""
    from diffusers import ControlNetModel

    model.save_config(tmp_path / "config")
    theirs = ControlNetModel.from_single_file(str(path), config=str(tmp_path / "config")).state_dict()
    ours = model.state_dict()
    assert set(theirs) == set(ours)
    for k, t in ours.items():
        assert torch.equal(theirs[k], t), k


def test_sd1_trains_writes_sd_scripts_keys_and_resumes_exactly(tiny_dir, tiny_parts, pairs, tmp_path):
    """2 steps with samples into the LDM-named file diffusers reads; 1 step + --resume repeats it bit for bit; a run
    continued from the file starts from its tensors."""
    model = tiny_dir / "sd1"
    prompts = tmp_path / "prompts.txt"
    guide = sorted(pairs[1].glob("*.png"))[1]
    common = "sks shape --w 64 --h 64 --d 3 --s 2 --l 1"
    prompts.write_text(f"{common} --cn {guide}\n{common}\n")  # samples 00 (with the image) and 01
    sampling = ["--sample_prompts", str(prompts), "--sample_every_n_steps", "2"]
    full = train_control_net.run(_argv(model, pairs, tmp_path / "a", 2, *sampling))
    assert full.failed is None and full.losses[0] != full.losses[1]
    tensors = load_file(str(full.output))
    assert {k.split(".")[0] for k in tensors} == {"input_hint_block", "zero_convs", "middle_block_out",
                                                 "input_blocks", "middle_block", "time_embed"}  # fmt: skip
    assert all(tensors[k].abs().sum() > 0 for k in tensors if k.startswith(("zero_convs", "middle_block_out")))
    unet = copy.deepcopy(tiny_parts["sd1"].denoiser)
    trained = load_controlnet(full.output, unet)  # our reader: LDM names back to diffusers'
    _single_file_equals(full.output, trained, tmp_path)
    samples = {p.stem.split("_")[2]: np.asarray(Image.open(p)) for p in (tmp_path / "a" / "sample").glob("*.png")
               if "grid" not in p.name}  # fmt: skip
    assert set(samples) == {"00", "01"} and not np.array_equal(samples["00"], samples["01"])

    half = train_control_net.run(_argv(model, pairs, tmp_path / "b", 1, "--save_state"))
    state = next((tmp_path / "b").glob("*-state"))
    resumed = train_control_net.run(_argv(model, pairs, tmp_path / "c", 2, "--resume", str(state)))
    assert half.failed is None and resumed.failed is None
    again = load_file(str(resumed.output))
    assert all(torch.equal(tensors[k], again[k]) for k in tensors)
    # --controlnet_model_name_or_path continues from the file: at learning rate 0 a step writes it back unchanged
    kept = train_control_net.run(_argv(model, pairs, tmp_path / "d", 1, "--controlnet_model_name_or_path",
                                       str(full.output), "--learning_rate", "0"))  # fmt: skip
    kept = load_file(str(kept.output))
    assert all(torch.equal(tensors[k], kept[k]) for k in tensors)


def test_sdxl_trains_two_learning_rates_into_diffusers_names(tiny_dir, tiny_parts, pairs, tmp_path):
    """--learning_rate 0 keeps the copied UNet encoder exactly while --control_net_lr trains the ControlNet's own
    modules (zero convolutions), a float32 ControlNet beside the bf16 UNet (--mixed_precision bf16); the file has
    sd-scripts' SDXL (diffusers) names, which from_single_file reads."""
    model = tiny_dir / "sdxl"
    run = sdxl_train_control_net.run(_argv(model, pairs, tmp_path, 2, "--control_net_lr", "2e-3",
                                           "--learning_rate", "0", "--cache_text_encoder_outputs",
                                           "--mixed_precision", "bf16"))  # fmt: skip
    assert run.failed is None
    tensors = load_file(str(run.output))
    unet = copy.deepcopy(tiny_parts["sdxl"].denoiser)
    fresh = controlnet_from_unet(unet).state_dict()
    assert set(tensors) == set(fresh)
    copied = [k for k in fresh if not k.startswith("controlnet_")]
    assert all(torch.equal(tensors[k], fresh[k].bfloat16().float()) for k in copied)  # copied from the bf16 UNet
    assert all(tensors[k].abs().sum() > 0 for k in tensors if k.startswith(("controlnet_down", "controlnet_mid")))
    _single_file_equals(run.output, load_controlnet(run.output, unet), tmp_path)


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--controlnet_model_name_or_path", "missing.safetensors"], "no such file or folder"),
        (["--save_model_as", "diffusers"], "--save_model_as diffusers is not possible here"),
    ],
)
def test_bad_flags_are_refused_before_training(tiny_dir, pairs, tmp_path, flags, expect):
    with pytest.raises(ConfigError, match=expect):
        train_control_net.run(_argv(tiny_dir / "sd1", pairs, tmp_path, 1, *flags))


def test_plan_memory_plans_the_controlnet(tiny_dir, tiny_parts, pairs, tmp_path):
    """--plan_memory builds the ControlNet from the UNet's shapes alone (no weights on the simulated device) and
    plans its float32 tensors as the trained parameters: planned == counted."""
    from library.measure.plan import plan_command

    argv = _argv(tiny_dir / "sd1", pairs, tmp_path, 1, "--plan_memory")
    plan = plan_command(lambda: train_control_net.run(argv), out=lambda line: None)
    counted = sum(p.numel() * 4 for p in controlnet_from_unet(copy.deepcopy(tiny_parts["sd1"].denoiser)).parameters())
    assert plan["phases"]["step"]["holders_mib"]["trained parameters"] == round(counted / 2**20, 1)
