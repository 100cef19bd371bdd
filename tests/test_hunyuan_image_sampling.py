"""HunyuanImage 2.1's sampler and hunyuan_image_minimal_inference.py: adaptive projected guidance by its formulas
(library/sampling/guidance.py), sd-scripts' schedule, and the docs' inference line on tiny files, its latents equal
to plain CFG sampled by hand when APG never starts. sd-scripts' own APG / sampler functions are the oracle of
benchmarks/hunyuan_image_vs_sdscripts.py (run by hand: max diff 0)."""

from __future__ import annotations

import pytest
import torch

import hunyuan_image_minimal_inference
from library.families.base import ProjectedGuidance
from library.families.hunyuan_image import HUNYUAN_IMAGE as FAMILY
from library.families.hunyuan_image.options import HunyuanOptions
from library.files.weights import load_state_dict
from library.sampling.flow import sample_euler, shifted_linear_sigmas, with_cfg
from library.sampling.guidance import Momentum, projected_guidance, rescale_guidance, with_apg


def pair(seed: int = 0, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 4, 5, generator=g), torch.randn(batch, 3, 4, 5, generator=g)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double()).flatten(1).sum(1)


# ----------------------------------------------------------------------------- the math
def test_apg_without_projection_momentum_or_cap_is_plain_cfg():
    cond, uncond = pair()
    out = projected_guidance(cond, uncond, 4.0, momentum=None, eta=1.0, norm_threshold=0.0)
    torch.testing.assert_close(out, uncond + 4.0 * (cond - uncond), rtol=1e-6, atol=1e-6)


def test_apg_projection_removes_the_part_along_the_conditional_prediction():
    """eta = 0: the update is orthogonal to c (per image); eta = 0.5: half of the parallel part is kept."""
    cond, uncond = pair(1)
    d = cond - uncond
    parallel = (dot(d, cond) / dot(cond, cond)).view(-1, 1, 1, 1).float() * cond
    for eta in (0.0, 0.5):
        update = (projected_guidance(cond, uncond, 1.0, eta=eta) - uncond).double()
        torch.testing.assert_close(update, (d - parallel + eta * parallel).double(), rtol=1e-5, atol=1e-5)
    orthogonal = projected_guidance(cond, uncond, 1.0, eta=0.0) - uncond
    assert dot(orthogonal, cond).abs().max() < 1e-4 * dot(cond, cond).max()


def test_norm_threshold_caps_each_image_and_momentum_averages_by_its_formula():
    cond, uncond = pair(2)
    uncond[1] = cond[1] - 0.01 * uncond[1]  # image 1: a difference below the cap
    norms = (cond - uncond).flatten(1).norm(dim=1)
    cap = float(norms[0] / 2)
    assert norms[1] < cap
    out = projected_guidance(cond, uncond, 1.0, eta=1.0, norm_threshold=cap)
    torch.testing.assert_close((out - uncond).flatten(1).norm(dim=1), torch.stack([torch.tensor(cap), norms[1]]))
    # momentum beta: a1 = d1, a2 = d2 + beta d1 (sd-scripts' MomentumBuffer; beta -0.5 its sampler's)
    (c1, u1), (c2, u2) = pair(3), pair(4)
    momentum = Momentum(-0.5)
    projected_guidance(c1, u1, 1.0, momentum=momentum, eta=1.0)
    second = projected_guidance(c2, u2, 1.0, momentum=momentum, eta=1.0)
    torch.testing.assert_close(second, u2 + (c2 - u2) - 0.5 * (c1 - u1), rtol=1e-5, atol=1e-5)


def test_guidance_rescale_matches_the_conditional_std():
    cond, uncond = pair(5)
    guided = uncond + 5.0 * (cond - uncond)
    full = rescale_guidance(guided, cond, 1.0)
    torch.testing.assert_close(full.flatten(1).std(dim=1), cond.flatten(1).std(dim=1))
    torch.testing.assert_close(rescale_guidance(guided, cond, 0.3), 0.3 * full + 0.7 * guided)
    assert rescale_guidance(guided, cond, 0.0) is guided


def test_with_apg_is_cfg_up_to_its_start_step_then_apg():
    """Steps 0..start: plain CFG at --l; after: APG at its own scale, the momentum counted from step 0; a prompt
    with rendered text starts later (sd-scripts' apply_classifier_free_guidance)."""
    settings = ProjectedGuidance(start_step=1, text_start_step=3)
    preds = [pair(10 + i) for i in range(5)]
    calls = iter(range(5))

    def velocity(x2: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
        cond, uncond = preds[next(calls)]
        return torch.cat([uncond, cond])

    guided = with_apg(velocity, 3.5, settings, [False, True])
    x, momentum = torch.zeros(2, 3, 4, 5), Momentum(-0.5)
    for step, (cond, uncond) in enumerate(preds):
        out = guided(x, torch.ones(2))
        apg = projected_guidance(cond, uncond, 10.0, momentum=momentum, eta=0.0, norm_threshold=10.0)
        cfg = uncond + 3.5 * (cond - uncond)
        torch.testing.assert_close(out[0], (apg if step > 1 else cfg)[0])
        torch.testing.assert_close(out[1], (apg if step > 3 else cfg)[1])


def test_schedule_is_the_shifted_plain_grid():
    sigmas = shifted_linear_sigmas(4, 5.0)
    grid = torch.linspace(1, 0, 5)
    torch.testing.assert_close(sigmas, 5 * grid / (1 + 4 * grid))
    assert sigmas[0] == 1 and sigmas[-1] == 0 and sigmas.dtype == torch.float32
    settings = FAMILY.flow_sampling(FAMILY.tiny.build(seed=0, blocks=1))
    assert settings.linear_shift and settings.static_shift == 5.0 and settings.apg is not None
    assert settings.apg.renders_text('a sign saying "open"') and not settings.apg.renders_text("a sign")


# ----------------------------------------------------------------------------- the script
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    parts = FAMILY.tiny.build(seed=0, blocks=2)
    return FAMILY.tiny.write_files(parts, tmp_path_factory.mktemp("hunyuan_inference"), "tiny")


def docs_line(files, out, *extra: str) -> list[str]:
    """docs/hunyuan_image_train_network.md's inference line, tiny paths and size, fewer steps."""
    return ["--dit", str(files["dit"]), "--text_encoder", str(files["text_encoder"]), "--byt5", str(files["byt5"]),
            "--vae", str(files["vae"]), "--attn_mode", "torch", "--prompt", "A cute cartoon penguin in a snowy landscape",
            "--image_size", "64", "96", "--infer_steps", "6", "--guidance_scale", "3.5", "--flow_shift", "5.0",
            "--seed", "542017", "--save_path", str(out), *extra]  # fmt: skip


def test_docs_inference_line_runs_and_without_apg_equals_plain_cfg(files, tmp_path):
    (png,) = hunyuan_image_minimal_inference.run(docs_line(files, tmp_path / "img"))
    assert png.suffix == ".png" and png.stat().st_size > 0
    (latent_file,) = hunyuan_image_minimal_inference.run(
        docs_line(files, tmp_path / "lat", "--output_type", "latent", "--apg_start_step_general", "6")
    )
    latent = load_state_dict(latent_file)[0]["latent"]
    # by hand: plain CFG (APG starts after the last step), the shifted grid, the family's predict
    parts = FAMILY.load(files["dit"], vae=files["vae"],
                        options=HunyuanOptions(text_encoder=str(files["text_encoder"]), byt5=str(files["byt5"])))  # fmt: skip
    with torch.no_grad():
        cond = FAMILY.encode_prompt(parts, ["", "A cute cartoon penguin in a snowy landscape"])
        noise = torch.randn(1, 4, 2, 3, generator=torch.Generator().manual_seed(542017))

        def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            return FAMILY.predict(parts.denoiser, x, (sigma * 1000).to(torch.int64), cond).float()

        expected = sample_euler(with_cfg(velocity, 3.5), noise, shifted_linear_sigmas(6, 5.0))
    torch.testing.assert_close(latent, expected, rtol=1e-4, atol=1e-5)
    (apg_file,) = hunyuan_image_minimal_inference.run(
        docs_line(files, tmp_path / "apg", "--output_type", "latent", "--apg_start_step_general", "2")
    )
    assert not torch.allclose(load_state_dict(apg_file)[0]["latent"], expected, atol=1e-3)  # APG from step 3 on


def test_unsupported_inference_flags_are_named(files, tmp_path):
    from library.cli.problems import ConfigError

    with pytest.raises(ConfigError) as e:
        hunyuan_image_minimal_inference.run(
            docs_line(files, tmp_path, "--attn_mode", "flash", "--include_patterns", "x", "--image_size", "60", "64")
        )
    text = str(e.value)
    assert "--attn_mode flash" in text and "--include_patterns" in text and "multiples of 32" in text


def test_lora_live_equals_the_merged_model_it_saves(files, tmp_path):
    """The docs' --lora_weight / --lora_multiplier: the latents with the LoRA applied equal those of the DiT that
    --save_merged_model writes (Tencent's layout, read back by --dit), and differ from the base model's."""
    from _networks_helpers import make_config, perturb

    from networks.inject import inject

    options = HunyuanOptions(text_encoder=str(files["text_encoder"]), byt5=str(files["byt5"]))
    parts = FAMILY.load(files["dit"], vae=files["vae"], options=options)
    cfg = make_config(module="networks.lora_hunyuan_image", dim=4, alpha=2.0, flags=("--network_train_unet_only",))
    network = inject(cfg, FAMILY.adapter_roots(parts), FAMILY.target_classes)
    with torch.no_grad():
        perturb(network)
    lora = tmp_path / "lora.safetensors"
    network.save(lora, metadata={})
    short = ("--output_type", "latent", "--infer_steps", "3", "--image_size", "64", "64")

    def latent(folder: str, *extra: str) -> torch.Tensor:
        (path,) = hunyuan_image_minimal_inference.run(docs_line(files, tmp_path / folder, *short, *extra))
        return load_state_dict(path)[0]["latent"]

    live = latent("live", "--lora_weight", str(lora), "--lora_multiplier", "1.0")
    merged_file = tmp_path / "merged.safetensors"
    assert hunyuan_image_minimal_inference.run(
        docs_line(files, tmp_path, "--lora_weight", str(lora), "--save_merged_model", str(merged_file))
    ) == [merged_file]
    files_merged = dict(files, dit=merged_file)
    (path,) = hunyuan_image_minimal_inference.run(docs_line(files_merged, tmp_path / "merged", *short))
    torch.testing.assert_close(load_state_dict(path)[0]["latent"], live, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(latent("base"), live, atol=1e-3)
