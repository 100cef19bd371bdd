"""sd-scripts' legacy generation entries on the tiny models, in-process: gen_img_diffusers.py and sdxl_gen_img.py (thin
entries to gen_img.py) and sdxl_minimal_inference.py.

Oracles: sd-scripts' argparse flag lists (tests/data, read from its parsers); gen_img.py's image for the same prompt,
seed, sampler and settings; a flag refused names itself and says why.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import gen_img_diffusers
import sdxl_gen_img
import sdxl_minimal_inference
from library.cli.parse import ConfigError, parse_args

DATA = Path(__file__).resolve().parent / "data"
SD_SCRIPTS = {
    "gen_img_diffusers": (gen_img_diffusers.build_parser, "sd_scripts_gen_img_diffusers_flags.json"),
    "sdxl_gen_img": (sdxl_gen_img.build_parser, "sd_scripts_sdxl_gen_img_flags.json"),
}
MINIMAL_FLAGS = {
    "--ckpt_path",
    "--prompt",
    "--prompt2",
    "--negative_prompt",
    "--output_dir",
    "--lora_weights",
    "--interactive",
}  # fmt: skip  (sd-scripts' sdxl_minimal_inference.py: its 7 flags)


def _options(parser):
    return {o: a for a in parser._actions for o in a.option_strings}


@pytest.mark.parametrize("script", SD_SCRIPTS)
def test_every_sd_scripts_flag_is_taken(script):
    build, data = SD_SCRIPTS[script]
    flags = json.loads((DATA / data).read_text())
    assert not sorted(set(flags) - set(_options(build())))


def test_minimal_inference_takes_sd_scripts_7_flags():
    assert MINIMAL_FLAGS <= set(_options(sdxl_minimal_inference.build_parser()))


@pytest.mark.parametrize(
    "flag,value",
    [("--clip_guidance_scale", ["1"]), ("--vgg16_guidance_layer", ["3"]),
     ("--highres_fix_steps", ["10"]), ("--gradual_latent_unsharp_params", ["3,0.5,0.5,1"])],
)  # fmt: skip
def test_the_old_scripts_flags_are_refused_with_the_reason(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} is not supported yet"):
        parse_args(gen_img_diffusers.build_parser(), ["--ckpt", "x", "--prompt", "p", flag, *value])


def test_control_net_weights_is_the_old_name_of_the_multipliers():
    args = parse_args(
        gen_img_diffusers.build_parser(), ["--ckpt", "x", "--prompt", "p", "--control_net_weights", "0.5"]
    )
    assert args.control_net_multipliers == [0.5]


def _pixels(path):
    return np.asarray(Image.open(path), np.int16)


def test_sdxl_gen_img_reads_the_file_as_sdxl(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="sd1"):  # as the old script does; its image: the next test
        sdxl_gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--outdir", str(tmp_path), "--prompt", "a cat"])


def test_sdxl_minimal_inference_interactive_equals_sdxl_gen_img(tiny_dir, tiny_parts, tmp_path, monkeypatch):
    """The image equals sdxl_gen_img.py's (gen_img.py's) for the same prompt, negative prompt, seed, Euler sampler,
    CFG 7 and LoRA at 0.8 (merged here, live there); prompt2 reaches the second text encoder (another prompt2,
    another image)."""
    from _networks_helpers import random_lora_state
    from safetensors.torch import save_file

    from library.families import get_family

    lora = tmp_path / "lora.safetensors"
    save_file(random_lora_state(get_family("sdxl"), tiny_parts["sdxl"]), lora)
    monkeypatch.setattr(sdxl_minimal_inference, "TARGET_SIZE", 64)
    monkeypatch.setattr(sdxl_minimal_inference, "STEPS", 2)
    lines = iter(["a cat", "", "bad", "5", "a cat", "a dog", "bad", "5", ""])
    monkeypatch.setattr("builtins.input", lambda question="": next(lines))
    written = sdxl_minimal_inference.run(["--ckpt_path", str(tiny_dir / "sdxl"), "--output_dir", str(tmp_path / "m"),
                                          "--lora_weights", f"{lora};0.8", "--interactive"])  # fmt: skip
    assert len(written) == 2
    ref = sdxl_gen_img.run(["--ckpt", str(tiny_dir / "sdxl"), "--outdir", str(tmp_path / "g"), "--prompt",
                            "a cat --n bad --d 5", "--steps", "2", "--W", "64", "--H", "64", "--sampler", "euler",
                            "--scale", "7", "--network_module", "networks.lora", "--network_weights", str(lora),
                            "--network_mul", "0.8"])  # fmt: skip
    same, other = _pixels(written[0]), _pixels(written[1])
    assert np.abs(same - _pixels(ref[0])).max() <= 1
    assert np.abs(same - other).max() > 0


def test_sdxl_minimal_inference_refuses_other_models(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="SDXL only"):
        sdxl_minimal_inference.run(["--ckpt_path", str(tiny_dir / "sd1"), "--output_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="--lora_weights"):
        sdxl_minimal_inference.run(["--ckpt_path", str(tiny_dir / "sdxl"), "--lora_weights", "missing.safetensors"])
