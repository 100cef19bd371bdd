"""gen_img.py --control_net_models on the tiny models against diffusers' ControlNet pipelines with the same file,
seed and scheduler: the image, the strength, sd-scripts' step ratio and the canny preprocessor; and the flags'
errors."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import gen_img
import sdxl_gen_img
from library.cli.parse import ConfigError
from library.sampling.schedulers import make_scheduler
from networks.controlnet import ControlNet, controlnet_from_unet

BASE = ["--steps", "3", "--W", "64", "--H", "64", "--scale", "6", "--sampler", "ddim"]
PROMPT = "a red cat --d 4 --n blurry"


def _max_diff(a: Image.Image, b: Image.Image) -> int:
    return int(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max())


def _controlnet_file(parts, path: Path, file_keys: str) -> Path:
    """A ControlNet of the tiny UNet with random (non-zero) weights everywhere, as training leaves it."""
    torch.manual_seed(0)
    net = ControlNet(parts.denoiser, controlnet_from_unet(parts.denoiser), file_keys)
    with torch.no_grad():
        for p in net.controlnet.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    net.remove()
    net.save(path)
    net.controlnet.save_config(path.parent / "config")
    return path


@pytest.fixture(scope="module")
def guides(tmp_path_factory):
    """Two 64x64 guide images (gen_img resizes nothing) with edges for the canny preprocessor."""
    folder = tmp_path_factory.mktemp("guides")
    rng = np.random.default_rng(0)
    out = []
    for i in range(2):
        img = np.zeros((64, 64, 3), np.uint8)
        img[8 + 8 * i : 40 + 8 * i, 16:48] = 255
        img[rng.random((64, 64)) < 0.05] = 128
        out.append(folder / f"g{i}.png")
        Image.fromarray(img).save(out[-1])
    return out


def _pipeline(tiny_dir, name: str, cn_file: Path):
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionXLControlNetPipeline

    controlnet = ControlNetModel.from_single_file(str(cn_file), config=str(cn_file.parent / "config"))
    cls = StableDiffusionXLControlNetPipeline if name == "sdxl" else StableDiffusionControlNetPipeline
    pipe = cls.from_pretrained(str(tiny_dir / name), controlnet=controlnet, local_files_only=True)
    pipe.scheduler = make_scheduler("ddim", pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_sd1_image_equals_diffusers_controlnet_pipeline(tiny_dir, tiny_parts, guides, tmp_path):
    """Our LDM-named file in gen_img.py and in StableDiffusionControlNetPipeline (from_single_file): the same image;
    the multiplier is diffusers' conditioning scale, sd-scripts' ratio 0.2 of 4 steps is diffusers' guidance end
    0.25 (step 0 guided), canny_63_191 equals OpenCV's edges given as the image; two ControlNets add their residuals."""
    import cv2

    cn = _controlnet_file(copy.deepcopy(tiny_parts["sd1"]), tmp_path / "cn" / "cn.safetensors", "ldm")
    pipe = _pipeline(tiny_dir, "sd1", cn)

    def ours(*extra: str, steps: str = "3", lines: int = 1) -> list[Image.Image]:
        prompts = tmp_path / "prompts.txt"
        prompts.write_text(f"{PROMPT}\n" * lines)  # one seed: image n differs from image 0 by its guide image only
        argv = ["--ckpt", str(tiny_dir / "sd1"), "--from_file", str(prompts), "--outdir", str(tmp_path / "out"),
                *BASE, "--control_net_models", str(cn), *extra, "--steps", steps]  # fmt: skip
        return [Image.open(p) for p in gen_img.run(argv)]

    def theirs(image: Image.Image, steps: int = 3, **kw) -> Image.Image:
        return pipe("a red cat", image=image, negative_prompt="blurry", height=64, width=64, guidance_scale=6.0,
                    num_inference_steps=steps, generator=torch.Generator().manual_seed(4), **kw).images[0]  # fmt: skip

    guide = Image.open(guides[0]).convert("RGB")
    image, other = ours("--guide_image_path", str(guides[0]), str(guides[1]), lines=2)  # guide images 0 and 1
    assert _max_diff(image, theirs(guide)) <= 1
    assert _max_diff(image, other) > 0  # the guide image changes the image
    assert _max_diff(image, theirs(guide, controlnet_conditioning_scale=0.0)) > 1  # ... and the ControlNet does
    (half,) = ours("--guide_image_path", str(guides[0]), "--control_net_multipliers", "0.5")
    assert _max_diff(half, theirs(guide, controlnet_conditioning_scale=0.5)) <= 1
    (ratio,) = ours("--guide_image_path", str(guides[0]), "--control_net_ratios", "0.2", steps="4")
    assert _max_diff(ratio, theirs(guide, steps=4, control_guidance_end=0.25)) <= 1
    assert _max_diff(ratio, theirs(guide, steps=4)) > 1  # the ratio did stop the guidance
    (two,) = ours("--control_net_models", str(cn), str(cn), "--control_net_multipliers", "0.25", "0.25",
                  "--guide_image_path", str(guides[0]))  # two ControlNets add up: 0.25 + 0.25 is 0.5  # fmt: skip
    assert _max_diff(two, half) <= 1 and _max_diff(two, image) > 1
    edges = cv2.Canny(cv2.cvtColor(np.asarray(guide), cv2.COLOR_RGB2GRAY), 63, 191)
    (canny,) = ours("--guide_image_path", str(guides[0]), "--control_net_preps", "canny_63_191")
    assert _max_diff(canny, theirs(Image.fromarray(edges).convert("RGB"))) <= 1


def test_sdxl_image_equals_diffusers_controlnet_pipeline(tiny_dir, tiny_parts, guides, tmp_path):
    """sd-scripts' SDXL names (diffusers') in sdxl_gen_img.py and StableDiffusionXLControlNetPipeline."""
    cn = _controlnet_file(copy.deepcopy(tiny_parts["sdxl"]), tmp_path / "cn" / "cn.safetensors", "diffusers")
    argv = ["--ckpt", str(tiny_dir / "sdxl"), "--prompt", PROMPT, "--outdir", str(tmp_path / "out"), *BASE,
            "--control_net_models", str(cn), "--guide_image_path", str(guides[0])]  # fmt: skip
    ours = Image.open(sdxl_gen_img.run(argv)[0])
    theirs = _pipeline(tiny_dir, "sdxl", cn)(
        "a red cat", image=Image.open(guides[0]).convert("RGB"), negative_prompt="blurry", height=64, width=64,
        guidance_scale=6.0, num_inference_steps=3, generator=torch.Generator().manual_seed(4),
    ).images[0]  # fmt: skip
    assert _max_diff(ours, theirs) <= 1


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--control_net_preps", "depth"], "--control_net_preps depth: unknown preprocessor"),
        (["--control_net_ratios", "1.5"], "--control_net_ratios: 1.5 is not a fraction"),
        (["--control_net_multipliers", "1", "1"], "--control_net_multipliers: 2 values for 1"),
        (["--control_net_lllite_models", "x.safetensors"], "cannot be used together"),
    ],
)
def test_bad_control_flags_are_refused(tiny_dir, guides, tmp_path, flags, expect):
    cn = tmp_path / "cn.safetensors"
    cn.write_bytes(b"")
    with pytest.raises(ConfigError, match=expect):
        gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", "a", "--control_net_models", str(cn),
                     "--guide_image_path", str(guides[0]), *flags])  # fmt: skip
