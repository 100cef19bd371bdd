"""tools/merge_models.py on the tiny models.

Oracles: every merged weight equals Σ ratio·W of the inputs (each input read on its own), and the written model loads
in diffusers (``from_single_file`` with the tiny config folder, ``from_pretrained`` for folders) with those weights."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from library.cli.parse import ConfigError
from library.families import get_family
from library.families.sd import tiny as tiny_mod
from library.files.weights import load_state_dict
from tools import merge_models


def run(*argv):
    return merge_models.run([str(a) for a in argv])


@pytest.fixture(scope="module")
def others(tmp_path_factory):
    """Tiny models with other weights (seed 1): SD1 as a diffusers folder and .ckpt, SD2 as a folder, SDXL as a
    single file."""
    root = tmp_path_factory.mktemp("seed1")
    out = {}
    for name, targets in (("sd1", ("sd1", "sd1.ckpt")), ("sd2", ("sd2",)), ("sdxl", ("sdxl.safetensors",))):
        parts = tiny_mod.build_tiny(name, seed=1)
        for t in targets:
            out[t] = get_family(name).save(parts, root / t)
    return out


@pytest.fixture(scope="module")
def sd1_file(tiny_dir, tmp_path_factory):
    """The tiny SD1 model (seed 0, as in ``tiny_dir``) as a single .safetensors file."""
    sd1 = get_family("sd1")
    return sd1.save(sd1.load(tiny_dir / "sd1"), tmp_path_factory.mktemp("seed0") / "a.safetensors")


def weights(parts) -> dict[str, torch.Tensor]:
    return named_weights(parts.denoiser, parts.vae, parts.text_encoders)


def named_weights(unet, vae, text_encoders) -> dict[str, torch.Tensor]:
    """{component/key: tensor}; text encoders under their canonical HF names (with the ``text_model.`` level that
    transformers >= 5.6 dropped from ``CLIPTextModel``)."""
    from library.families.convert import hf_state_dict

    out = {f"unet/{k}": v for k, v in unet.state_dict().items()}
    out.update({f"vae/{k}": v for k, v in vae.state_dict().items()})
    for i, te in enumerate(text_encoders):
        out.update({f"te{i}/{k}": v for k, v in hf_state_dict(te).items()})
    return out


def expected(paths, ratios, family) -> dict[str, torch.Tensor]:
    loaded = [weights(get_family(family).load(p)) for p in paths]
    return {k: sum(r * w[k] for w, r in zip(loaded, ratios)) if v.is_floating_point() else v
            for k, v in loaded[0].items()}  # fmt: skip


def assert_weights(actual: dict, want: dict, atol=1e-6):
    assert actual.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(actual[k].float(), want[k].float(), atol=atol, rtol=1e-5, msg=k)


def diffusers_weights(pipe, family) -> dict[str, torch.Tensor]:
    tes = [pipe.text_encoder] + ([pipe.text_encoder_2] if family == "sdxl" else [])
    return named_weights(pipe.unet, pipe.vae, tes)


def test_sd1_file_folder_and_ckpt_merge_to_the_weighted_sum_and_load_in_diffusers(tiny_dir, sd1_file, others,
                                                                                   tmp_path):  # fmt: skip
    from diffusers import StableDiffusionPipeline

    single = sd1_file
    inputs, ratios = [single, others["sd1"], others["sd1.ckpt"]], [0.5, 0.7, -0.2]
    out = run("--models", *inputs, "--ratios", *ratios, "--output", tmp_path / "m.safetensors")
    want = expected(inputs, ratios, "sd1")
    assert_weights(weights(get_family("sd1").load(out)), want)
    pipe = StableDiffusionPipeline.from_single_file(str(out), config=str(tiny_dir / "sd1"), local_files_only=True)
    assert_weights(diffusers_weights(pipe, "sd1"), want)
    meta = load_state_dict(out)[1]
    assert meta["modelspec.merged_from"] == "a, sd1, sd1"
    assert "0.5·a + 0.7·sd1 + -0.2·sd1" in meta["modelspec.description"]
    assert meta["modelspec.architecture"] == "stable-diffusion-v1"
    a = weights(get_family("sd1").load(single))
    assert not torch.equal(want["unet/conv_in.weight"], a["unet/conv_in.weight"])  # the inputs do differ


def test_sdxl_default_ratios_into_a_diffusers_folder_load_in_diffusers(tiny_dir, others, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    inputs = [tiny_dir / "sdxl", others["sdxl.safetensors"]]
    out = run("--models", *inputs, "--output", tmp_path / "merged", "--saving_precision", "fp16")
    want = {k: v.half() if v.is_floating_point() else v for k, v in expected(inputs, [0.5, 0.5], "sdxl").items()}
    pipe = StableDiffusionXLPipeline.from_pretrained(str(out), local_files_only=True)
    with safe_open(str(out / "unet" / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        assert f.get_slice("conv_in.weight").get_dtype() == "F16"
    assert_weights(diffusers_weights(pipe, "sdxl"), want, atol=0)


def test_precision_fp16_forms_the_sum_in_fp16(sd1_file, others, tmp_path):
    inputs = [sd1_file, others["sd1.ckpt"]]
    out = run("--models", *inputs, "--ratios", 0.3, 0.7, "--precision", "fp16", "--output", tmp_path / "h.safetensors")
    got = load_state_dict(out)[0]
    a, b = (load_state_dict(p)[0] for p in inputs)
    b = b["state_dict"] if "state_dict" in b else b
    key = "model.diffusion_model.input_blocks.1.1.proj_in.weight"
    assert got[key].dtype == torch.float32  # --saving_precision float (the default)
    assert torch.equal(got[key], (a[key].half() * 0.3 + b[key].half() * 0.7).float())
    assert not torch.equal(got[key], a[key] * 0.3 + b[key] * 0.7)  # a float sum differs: the flag changed the run


def test_unet_only_keeps_the_first_models_vae_and_text_encoders(sd1_file, others, tmp_path):
    inputs = [others["sd1.ckpt"], sd1_file]
    out = run("--models", *inputs, "--ratios", 0.25, 0.75, "--unet_only", "--output", tmp_path / "u.safetensors")
    got, first = weights(get_family("sd1").load(out)), weights(get_family("sd1").load(inputs[0]))
    want = expected(inputs, [0.25, 0.75], "sd1")
    assert_weights({k: v for k, v in got.items() if k.startswith("unet/")},
                   {k: v for k, v in want.items() if k.startswith("unet/")})  # fmt: skip
    rest = [k for k in got if not k.startswith("unet/")]
    assert rest and all(torch.equal(got[k], first[k]) for k in rest)


def test_keys_outside_the_model_and_in_one_model_only_follow_sd_scripts(tiny_dir, others, tmp_path, capsys):
    sd2 = get_family("sd2")
    state, meta = load_state_dict(sd2.save(sd2.load(tiny_dir / "sd2"), tmp_path / "s.safetensors"))
    state.update({"model_ema.decay": torch.tensor(0.999), "alphas_cumprod": torch.rand(10)})
    save_file(state, str(tmp_path / "ema.safetensors"), metadata=meta)
    # first model a single file: its OpenCLIP extras (text_projection) are not in the folder -> first value, both ratios
    out = run("--models", tmp_path / "ema.safetensors", others["sd2"], "--ratios", 0.6, 0.4, "--output",
              tmp_path / "m.safetensors", "--show_skipped")  # fmt: skip
    printed = capsys.readouterr().out
    assert "model_ema.decay" in printed and "alphas_cumprod" in printed
    merged = load_state_dict(out)[0]
    assert "model_ema.decay" not in merged and "alphas_cumprod" not in merged
    key = "cond_stage_model.model.text_projection"
    torch.testing.assert_close(merged[key], state[key] * (0.6 + 0.4))
    # first model a folder: the file's extras are not in the first model -> skipped and listed
    run("--models", others["sd2"], tmp_path / "ema.safetensors", "--output", tmp_path / "n.safetensors",
        "--show_skipped")  # fmt: skip
    assert "not in the first model): logit_scale, text_projection" in capsys.readouterr().out


def test_every_command_line_problem_at_once(tmp_path):
    with pytest.raises(ConfigError) as e:
        run("--models", tmp_path / "nope.safetensors", tmp_path / "b", "--ratios", 1, "--output", tmp_path / "x.pt",
            "--device", "gpu")  # fmt: skip
    text = str(e.value)
    assert "--device gpu: not a device name" in text
    assert "nope.safetensors: no such file" in text and "--ratios has 1 value(s) for 2 --models" in text
    assert "x.pt: save a model as .safetensors, .ckpt or a folder" in text


def test_other_families_architectures_and_objectives_are_refused(tiny_dir, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"(?s)--ratios has 1 .*different families: .*sd1 \(SD1.x\).*sdxl \(SDXL\)"):
        run("--models", tiny_dir / "sd1", tiny_dir / "sdxl", "--output", tmp_path / "x.safetensors", "--ratios", 1)
    sd2 = get_family("sd2")
    eps = sd2.save(sd2.load(tiny_dir / "sd2", v_parameterization=False), tmp_path / "eps.safetensors")
    with pytest.raises(ConfigError, match="predicts epsilon but .* predicts v_prediction"):
        run("--models", tiny_dir / "sd2", eps, "--output", tmp_path / "x.safetensors")
    spec = copy.deepcopy(tiny_mod.TINY["sd1"])
    spec["text_encoders"][0]["intermediate_size"] *= 2
    monkeypatch.setitem(tiny_mod.TINY, "sd1", spec)
    wide = get_family("sd1").save(tiny_mod.build_tiny("sd1"), tmp_path / "wide.safetensors")
    with pytest.raises(ConfigError, match="its text encoder 1 has another architecture .* other shapes"):
        run("--models", tiny_dir / "sd1", wide, "--output", tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
