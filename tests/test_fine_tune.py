"""fine_tune.py / sdxl_train.py / train_db.py end to end on the tiny models, in-process.

Oracles: diffusers' ``from_single_file`` (local config, offline) and ``from_pretrained`` read the files we write,
and their UNet equals the trained one (the run's own state file) bit for bit; the loss on the training images,
measured with fixed noise and timesteps, falls; which weights changed says what was trained; a resumed run
repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDPMScheduler, DiffusionPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline

import fine_tune
import sdxl_train
import train_db
from library.cli.parse import ConfigError
from library.families import get_family
from library.families.sd.full_training import lr_block_count
from library.files.weights import load_state_dict, read_metadata
from library.run import loop
from library.run.demo import make_example_dataset

FAMILIES = ["sd1", "sd2", "sdxl"]


def args_for(model, dataset, out, *extra, steps=3):
    return [
        "--pretrained_model_name_or_path", str(model),
        "--train_data_dir", str(dataset),
        "--caption_extension", ".txt",
        "--resolution", "64",
        "--output_dir", str(out),
        "--output_name", "m",
        "--learning_rate", "1e-3",
        "--train_batch_size", "2",
        "--max_train_steps", str(steps),
        "--max_data_loader_n_workers", "0",
        "--seed", "1",
        *extra,
    ]  # fmt: skip


def train(family, *argv, script="fine_tune"):
    if family == "sdxl":
        return sdxl_train.run(list(argv))
    return (train_db.run if script == "train_db" else fine_tune.run)(list(argv))


def trained_state(result) -> dict[str, torch.Tensor]:
    """The trained tensors as the run held them in memory (its end-of-training state folder)."""
    return load_state_dict(result.state / "trained.safetensors")[0]


def prefixed(state, prefix):
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def assert_equal_state(expected: dict, module: torch.nn.Module) -> None:
    actual = module.state_dict()
    assert expected.keys() == actual.keys()
    bad = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"


def pipeline_from_single_file(path, config_dir):
    cls = StableDiffusionXLPipeline if (config_dir / "text_encoder_2").is_dir() else StableDiffusionPipeline
    return cls.from_single_file(str(path), config=str(config_dir), local_files_only=True)


@torch.no_grad()
def fixed_loss(family_name: str, model_path, dataset) -> float:
    """Mean diffusion loss of the four training images at fixed noise and timesteps (100, 300, 500, 700)."""
    from PIL import Image

    family = get_family(family_name)
    parts = family.load(model_path)
    paths = sorted(p for p in dataset.rglob("*.png"))
    pixels = torch.stack(
        [torch.tensor(list(Image.open(p).convert("RGB").getdata())).float().reshape(64, 64, 3) for p in paths]
    )
    pixels = pixels.permute(0, 3, 1, 2) / 127.5 - 1
    captions = [p.with_suffix(".txt").read_text().strip() for p in paths]
    gen = torch.Generator().manual_seed(0)
    latents = family.encode_latents(parts, pixels, gen)
    noise = torch.randn(latents.shape, generator=gen)
    t = torch.tensor([100, 300, 500, 700])
    sched = DDPMScheduler.from_config(parts.scheduler_config)
    noisy = sched.add_noise(latents, noise, t)
    target = sched.get_velocity(latents, noise, t) if parts.prediction_type == "v_prediction" else noise
    cond = family.encode_prompt(parts, captions)
    sizes = [[64, 64]] * len(paths)
    time_ids = family.size_conditioning(sizes, [[0, 0]] * len(paths), sizes)
    pred = family.predict(parts.denoiser, noisy, t, cond, time_ids=time_ids)
    return float(torch.nn.functional.mse_loss(pred, target))


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("family", FAMILIES)
def test_trains_and_the_single_file_loads_in_diffusers(family, tiny_dir, dataset, tmp_path):
    result = train(family, *args_for(tiny_dir / family, dataset, tmp_path, "--save_model_as", "safetensors",
                                     "--save_state_on_train_end", steps=8))  # fmt: skip
    assert result.output.name == "m.safetensors" and result.steps == 8
    assert fixed_loss(family, result.output, dataset) < fixed_loss(family, tiny_dir / family, dataset)
    pipe = pipeline_from_single_file(result.output, tiny_dir / family)
    assert_equal_state(prefixed(trained_state(result), "unet."), pipe.unet)  # bitwise
    tensors, meta = load_state_dict(result.output)
    assert meta["modelspec.architecture"] == get_family(family).modelspec_architecture("", pipe_prediction(pipe))
    assert meta["modelspec.sai_model_spec"] == "1.0.1" and meta["ss_steps"] == "8"
    assert ("v_pred" in tensors) == (pipe_prediction(pipe) == "v_prediction")


def pipe_prediction(pipe) -> str:
    return pipe.scheduler.config.prediction_type


@pytest.mark.parametrize(
    "family, flags, weights",
    [("sd1", ["--save_model_as", "diffusers"], ".bin"), ("sdxl", ["--save_model_as", "diffusers_safetensors"],
     ".safetensors")],
)  # fmt: skip
def test_diffusers_folder_loads_with_from_pretrained(family, flags, weights, tiny_dir, dataset, tmp_path):
    """sd-scripts' diffusers formats: ``diffusers`` writes pickled ``.bin`` weights (diffusers' save_pretrained
    with safe_serialization=False), ``diffusers_safetensors`` safetensors; both read back by from_pretrained."""
    result = train(family, *args_for(tiny_dir / family, dataset, tmp_path, *flags, "--save_state_on_train_end",
                                     "--train_text_encoder", steps=2))  # fmt: skip
    assert result.output.is_dir()
    files = {p.relative_to(result.output).as_posix() for p in result.output.rglob("*") if p.suffix in WEIGHT_SUFFIXES}
    te = [f"{name}/{'model' if weights == '.safetensors' else 'pytorch_model'}{weights}"
          for name in ("text_encoder", "text_encoder_2")[: len(get_family(family).spec.text_encoders)]]  # fmt: skip
    assert files == {f"{c}/diffusion_pytorch_model{weights}" for c in ("unet", "vae")} | set(te)
    pipe = DiffusionPipeline.from_pretrained(result.output, local_files_only=True)
    state = trained_state(result)
    assert_equal_state(prefixed(state, "unet."), pipe.unet)
    assert_equal_state(prefixed(state, "text_encoders.0."), pipe.text_encoder)


WEIGHT_SUFFIXES = (".bin", ".safetensors", ".ckpt", ".pt")


@pytest.mark.parametrize(
    "source, flags, expected",
    [
        ("folder", [], "diffusers"),
        ("folder", ["--use_safetensors"], "diffusers_safetensors"),
        ("m.ckpt", [], "ckpt"),
        ("m.ckpt", ["--use_safetensors"], "safetensors"),
        ("m.safetensors", [], "safetensors"),  # sd-scripts would write .ckpt here (docs/training.md)
        ("folder", ["--save_model_as", "ckpt"], "ckpt"),
        ("folder", ["--save_model_as", "ckpt", "--use_safetensors"], "safetensors"),
        ("m.ckpt", ["--save_model_as", "safetensors"], "safetensors"),
        ("m.ckpt", ["--save_model_as", "diffusers"], "diffusers"),
        ("m.ckpt", ["--save_model_as", "diffusers", "--use_safetensors"], "diffusers_safetensors"),
        ("m.ckpt", ["--save_model_as", "diffusers_safetensors"], "diffusers_safetensors"),
    ],
)
def test_output_format_follows_sd_scripts(source, flags, expected, tmp_path):
    """sd-scripts' fine_tune.py / sdxl_train.py / train_db.py: single file for ckpt / safetensors, else a diffusers
    folder; safetensors when --use_safetensors or the format's name says so (--save_model_as ckpt
    --use_safetensors writes a .safetensors file); without --save_model_as, the input's kind."""
    model = tmp_path / source
    model.mkdir() if source == "folder" else model.write_bytes(b"")
    args = fine_tune.build_parser().parse_args(["--pretrained_model_name_or_path", str(model), *flags])
    assert fine_tune.output_format(args) == expected


def test_default_format_is_the_input_format_and_precision_is_applied(tiny_dir, dataset, tmp_path):
    single = get_family("sd1").save(get_family("sd1").load(tiny_dir / "sd1"), tmp_path / "base.ckpt")
    result = train("sd1", *args_for(single, dataset, tmp_path / "a", "--save_precision", "fp16", steps=1))
    assert result.output.name == "m.ckpt"
    tensors = load_state_dict(result.output)[0]
    assert {t.dtype for k, t in tensors.items() if k.startswith("model.diffusion_model.")} == {torch.float16}
    result = train("sd1", *args_for(single, dataset, tmp_path / "b", "--use_safetensors", "--zero_terminal_snr",
                                    steps=1))  # fmt: skip
    meta = read_metadata(result.output)
    assert result.output.name == "m.safetensors" and meta["ss_train_text_encoder"] == "False"
    assert not [k for k in meta if k.startswith("sshs_")]  # whole models carry no adapter hashes (as sd-scripts)
    assert "ztsnr" in load_state_dict(result.output)[0]  # trained with zero terminal SNR: ComfyUI's marker


# ------------------------------------------------------------------------------------------------ what is trained
def te_changed(result, base_parts, index=0) -> bool:
    loaded = get_family(base_parts.family).load(result.output)
    a, b = loaded.text_encoders[index].state_dict(), base_parts.text_encoders[index].state_dict()
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_text_encoder_trains_only_when_asked(tiny_dir, dataset, tmp_path, tiny_parts):
    off = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "off", "--save_model_as", "safetensors"))
    on = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "on", "--save_model_as", "safetensors",
                                "--train_text_encoder", "--learning_rate_te", "1e-3"))  # fmt: skip
    assert not te_changed(off, tiny_parts["sd1"]) and te_changed(on, tiny_parts["sd1"])


def test_sdxl_text_encoder_lr_zero_keeps_that_encoder(tiny_dir, dataset, tmp_path, tiny_parts):
    result = train("sdxl", *args_for(tiny_dir / "sdxl", dataset, tmp_path, "--save_model_as", "safetensors",
                                     "--train_text_encoder", "--learning_rate_te1", "0", "--learning_rate_te2", "1e-3"))  # fmt: skip
    assert not te_changed(result, tiny_parts["sdxl"], 0) and te_changed(result, tiny_parts["sdxl"], 1)


def test_sdxl_learning_rate_zero_trains_the_text_encoders_only(tiny_dir, dataset, tmp_path, tiny_parts, monkeypatch):
    """sdxl_train.py --learning_rate 0 leaves the UNet out of training (sd-scripts: "train text encoders only"):
    not in the optimizer, not a tensor changed, even with Adafactor's relative step (which ignores the lr and so
    changed every UNet tensor); the encoders, at their own --learning_rate_te1 / _te2, do change."""

    groups_seen: list[list[str]] = []
    make = loop.make_optimizer
    monkeypatch.setattr(loop, "make_optimizer",
                        lambda cfg, groups: (groups_seen.append([g["name"] for g in groups]), make(cfg, groups))[1])  # fmt: skip
    result = train("sdxl", *args_for(tiny_dir / "sdxl", dataset, tmp_path, "--save_model_as", "safetensors",
                                     "--optimizer_type", "adafactor", "--train_text_encoder", "--learning_rate_te1",
                                     "1e-3", "--learning_rate_te2", "1e-3", "--learning_rate", "0", steps=1))  # fmt: skip
    assert groups_seen == [["textencoder1", "textencoder2"]]
    loaded, base = get_family("sdxl").load(result.output), tiny_parts["sdxl"]
    unet, base_unet = loaded.denoiser.state_dict(), base.denoiser.state_dict()
    assert all(torch.equal(unet[k], base_unet[k]) for k in base_unet)
    assert te_changed(result, base, 0) and te_changed(result, base, 1)


def test_sdxl_learning_rate_zero_without_a_trained_encoder_is_refused(tiny_dir, dataset, tmp_path):
    """sd-scripts' rule: a text encoder whose lr (its own, else --learning_rate) is 0 is not trained either."""
    for extra in ([], ["--train_text_encoder"], ["--train_text_encoder", "--learning_rate_te1", "0"]):
        text = train_args_error(tiny_dir, dataset, tmp_path, "--learning_rate", "0", *extra)
        assert "--learning_rate 0" in text and "trains nothing" in text


def test_stop_text_encoder_training(tiny_dir, dataset, tmp_path):
    """train_db.py trains the text encoder until the given step: after 4 steps with a stop at 2, the encoder equals
    the one of a 2-step run, while the UNet kept training."""
    common = ["--save_model_as", "safetensors", "--save_state_on_train_end"]
    two = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "two", *common, steps=2), script="train_db")
    four = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "four", *common,
                                  "--stop_text_encoder_training", "2", steps=4), script="train_db")  # fmt: skip
    a, b = trained_state(two), trained_state(four)
    te = [k for k in a if k.startswith("text_encoders.")]
    assert te and all(torch.equal(a[k], b[k]) for k in te)
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("unet."))
    never = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "never", *common,
                                   "--stop_text_encoder_training", "-1", steps=1), script="train_db")  # fmt: skip
    assert not any(k.startswith("text_encoders.") for k in trained_state(never))


def test_no_token_padding_trains_on_unpadded_captions(tiny_dir, dataset, tmp_path):
    """train_db.py --no_token_padding: the UNet sees the captions' tokens padded only to the batch's longest caption
    (<BOS> tokens <EOS>), which changes what is trained: the same seeded run gives other losses than the padded one.
    With --cache_text_encoder_outputs the losses are those of the run that encodes every step."""
    from library.run import config as run_config
    from library.run import setup as run_setup
    from library.run.model_trainable import ModelTrainingConfig
    from library.run.train_step import batch_cond

    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "probe", "--no_token_padding")
    args = train_db.build_parser().parse_args(argv)
    cfg = run_config.read_config(
        args, ("sd1", "sd2"), ModelTrainingConfig.reader(get_family("sd1"), "dreambooth"), fine_tune.MODEL_FORMATS
    )
    run = run_setup.start(cfg)
    batch = next(iter(run.make_loader().epoch(0)))
    tok = run.parts.tokenizers[0]
    longest = max(len(tok(c).input_ids) for c in batch.captions)  # with <BOS> and <EOS>
    with torch.no_grad():
        unpadded = batch_cond(run.step_models, batch).hidden_states
        padded = run.family.encode_prompt(run.parts, list(batch.captions)).hidden_states
    assert 4 < longest < 77 and unpadded.shape == (2, longest, 32) and padded.shape == (2, 77, 32)

    plain = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "plain", steps=2), script="train_db")
    flag = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "flag", "--no_token_padding", steps=2),
                 script="train_db")  # fmt: skip
    assert flag.failed is None and len(flag.losses) == len(plain.losses) == 2
    assert all(math.isfinite(x) for x in flag.losses) and flag.losses[0] != plain.losses[0]

    frozen = ["--no_token_padding", "--stop_text_encoder_training", "-1"]  # cached outputs need a frozen encoder
    encoded = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "enc", *frozen, steps=2), script="train_db")
    cached = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "cached", *frozen,
                                    "--cache_text_encoder_outputs", steps=2), script="train_db")  # fmt: skip
    assert cached.losses == pytest.approx(encoded.losses, rel=1e-5)  # the cache holds padded outputs, cut per batch


def test_block_lr_zero_freezes_the_block(tiny_dir, dataset, tmp_path, tiny_parts):
    from library.families.loading import shipped_configs

    assert lr_block_count(shipped_configs("sdxl-base")["unet"]) == 23  # sd-scripts' 23 SDXL blocks
    unet = tiny_parts["sdxl"].denoiser
    n = lr_block_count(unet.config)
    lrs = ["0"] + ["1e-3"] * (n - 2) + ["0"]  # embeddings and the output layer frozen
    result = train("sdxl", *args_for(tiny_dir / "sdxl", dataset, tmp_path, "--save_model_as", "safetensors",
                                     "--block_lr", ",".join(lrs)))  # fmt: skip
    trained = get_family("sdxl").load(result.output).denoiser.state_dict()
    base = unet.state_dict()
    for k in base:
        same = torch.equal(trained[k], base[k])
        frozen = k.startswith(("time_embedding.", "add_embedding.", "conv_norm_out.", "conv_out."))
        assert same == frozen or (not frozen and same and "bias" in k), k
    bad = train_args_error(tiny_dir, dataset, tmp_path, "--block_lr", "1e-3,1e-3")
    assert "--block_lr has 2 values" in bad


def train_args_error(tiny_dir, dataset, tmp_path, *extra) -> str:
    with pytest.raises(ValueError) as e:
        train("sdxl", *args_for(tiny_dir / "sdxl", dataset, tmp_path / "err", *extra))
    return str(e.value)


# ------------------------------------------------------------------------------------------------ state, EMA, NaN
def test_resume_repeats_the_uninterrupted_run_exactly(tiny_dir, dataset, tmp_path):
    common = ["--save_model_as", "safetensors", "--save_every_n_steps", "2", "--save_state", "--train_text_encoder",
              "--ema"]  # fmt: skip
    full = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "a", *common, steps=4))
    state = tmp_path / "a" / "m-step00000002-state"
    resumed = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "b", *common, "--resume", str(state),
                                     steps=4))  # fmt: skip
    assert resumed.losses == full.losses
    for x, y in ((full.output, resumed.output), (full.ema_output, resumed.ema_output)):
        a, b = load_state_dict(x)[0], load_state_dict(y)[0]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    live, ema = load_state_dict(full.output)[0], load_state_dict(full.ema_output)[0]
    unet_keys = [k for k in live if k.startswith("model.diffusion_model.")]
    assert any(not torch.equal(live[k], ema[k]) for k in unet_keys)  # the EMA file is not the live model


def test_nan_loss_stops_and_keeps_saved_files(tiny_dir, dataset, tmp_path):
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path, "--save_model_as", "safetensors", "--save_every_n_steps",
                    "1", "--learning_rate", "1e30", "--optimizer_type", "SGDNesterov", steps=6)  # fmt: skip
    result = train("sd1", *argv)
    assert result.failed and "loss became" in result.failed and result.output is None
    saved = sorted(tmp_path.glob("m-step*.safetensors"))
    assert saved and not (tmp_path / "m.safetensors").exists()
    for path in saved:
        assert all(torch.isfinite(t).all() for t in load_state_dict(path)[0].values() if t.is_floating_point())


def test_bad_input_is_one_clear_error(tiny_dir, dataset, tmp_path):
    with pytest.raises(ConfigError) as e:
        train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path, "--save_model_as", "pt", "--train_text_encoder",
                               "--cache_text_encoder_outputs", "--fused_backward_pass", "--optimizer_type",
                               "adafactor"))  # fmt: skip
    text = str(e.value)
    assert "--save_model_as pt" in text and "--cache_text_encoder_outputs" in text
    assert "--fused_backward_pass" not in text  # accepted with Adafactor
    with pytest.raises(ConfigError) as e:
        train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path, "--no_token_padding", "--max_token_length", "150",
                               "--weighted_captions"), script="train_db")  # fmt: skip
    for other in ("--max_token_length", "--weighted_captions"):
        assert f"--no_token_padding with {other} is not supported yet" in str(e.value)


# ------------------------------------------------------------------------------------------------ DreamBooth
def test_prior_preservation_loss_is_the_hand_computed_formula(tiny_dir, dataset, tmp_path):
    """train_db.py with class images: regularisation samples are balanced to the instance samples (sd-scripts'
    rule), and a mixed batch's loss is mean_i(w_i * mean((pred_i - target_i)^2)), w = --prior_loss_weight for class
    images, 1 for instance images."""
    from library.objectives.noising import make_example
    from library.run import config as run_config
    from library.run import setup as run_setup
    from library.run.model_trainable import ModelTrainingConfig
    from library.run.train_step import batch_cond, batch_latents, batch_loss

    reg = make_example_dataset(tmp_path / "reg")
    (reg / "10_sks shape").rename(reg / "1_shape")
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "out", "--reg_data_dir", str(reg), "--prior_loss_weight",
                    "0.3", "--train_batch_size", "4", "--save_model_as", "safetensors")  # fmt: skip
    args = train_db.build_parser().parse_args(argv)
    cfg = run_config.read_config(
        args, ("sd1", "sd2"), ModelTrainingConfig.reader(get_family("sd1"), "dreambooth"), fine_tune.MODEL_FORMATS
    )
    run = run_setup.start(cfg)
    batches = list(run.make_loader().epoch(0))
    flags = torch.cat([b.is_reg for b in batches])
    assert int(flags.sum()) == int((~flags).sum()) == 40  # 4 images x 10 repeats; the 4 class images repeat to 40
    batch = next(b for b in batches if b.is_reg.any() and (~b.is_reg).any())
    m, t = run.step_models, torch.tensor([100, 300, 500, 700])
    with torch.no_grad():
        loss = batch_loss(m, batch, torch.Generator().manual_seed(5), timesteps=t).mean()
        gen = torch.Generator().manual_seed(5)  # the same draws, in the same order, by hand
        latents = batch_latents(m, batch, gen)
        cond = batch_cond(m, batch, gen)
        noisy, target, tt, _ = make_example(m.objective.noise, latents, m.objective.schedule, gen, timesteps=t)
        pred = m.family.predict(m.denoiser, noisy, tt, cond)
    w = torch.where(batch.is_reg, 0.3, 1.0)
    expected = (w * ((pred - target) ** 2).mean(dim=(1, 2, 3))).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    unweighted = ((pred - target) ** 2).mean(dim=(1, 2, 3)).mean()
    assert not torch.isclose(loss, unweighted)  # the weight matters in this batch


# ------------------------------------------------------------------------------------------------ fused steps
@pytest.mark.parametrize(
    "optimizer, fused, chunks",
    [("adafactor", ["--fused_backward_pass"], None), ("AdamW", ["--fused_optimizer_groups", "3"], 3)],
)
def test_fused_steps_equal_the_ordinary_step(optimizer, fused, chunks, tiny_dir, dataset, tmp_path, tiny_parts,
                                             monkeypatch):  # fmt: skip
    """The optimizer stepping inside backward (per parameter, or in 3 groups) gives the ordinary step's weights."""
    from library.optim.fused import FusedStep

    common = ["--save_model_as", "safetensors", "--save_state_on_train_end", "--train_text_encoder", "--optimizer_type",
              optimizer, "--max_grad_norm", "0", "--learning_rate", "1e-3"]  # fmt: skip
    if optimizer == "adafactor":
        common += ["--optimizer_args", "relative_step=False", "scale_parameter=False", "warmup_init=False"]
    plain = train("sdxl", *args_for(tiny_dir / "sdxl", dataset, tmp_path / "plain", *common))
    stepped: list[int] = []
    original = FusedStep.step_chunk
    monkeypatch.setattr(
        FusedStep, "step_chunk", lambda self, params: (stepped.append(len(params)), original(self, params))
    )
    fused_run = train("sdxl", *args_for(tiny_dir / "sdxl", dataset, tmp_path / "fused", *common, *fused))
    a, b = trained_state(plain), trained_state(fused_run)
    assert a.keys() == b.keys()
    n_params = sum(1 for k in a if k != "steps_done")
    # most parameters were stepped inside backward (a chunk holding a parameter that gets no gradient, e.g. a text
    # encoder's unused last layer, is left to the ordinary step)
    assert sum(stepped) >= 3 * n_params * 0.6
    assert len(stepped) <= 3 * chunks if chunks else max(stepped) == 1  # 3 groups, or one parameter at a time
    base = {f"unet.{k}": v for k, v in tiny_parts["sdxl"].denoiser.state_dict().items()}
    changed = 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)
        changed += k in base and not torch.equal(a[k], base[k])
    assert changed > len(base) // 2


def test_fused_optimizer_groups_clip_each_parameter_on_its_own():
    """--fused_optimizer_groups with --max_grad_norm clips each parameter's gradient to the norm on its own, as
    sd-scripts' per-parameter hook does, not the chunk's joint norm: two parameters in one chunk, one gradient
    above the limit and one below, give the update of a hand-clipped reference (the small one left as it is)."""
    from library.optim.fused import FusedStep

    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([a, b], lr=1.0)
    fused = FusedStep(optimizer, [[a, b]], max_grad_norm=1.0)
    ga, gb = torch.tensor([3.0, 0.0, 4.0, 0.0]), torch.tensor([0.1, -0.2, 0.2])  # norms 5 and 0.3
    ((a * ga).sum() + (b * gb).sum()).backward()  # the chunk steps inside backward
    fused.remove()
    expected = [-g * min(1.0, 1.0 / (g.norm() + 1e-6)) for g in (ga, gb)]  # torch's clip rule, per parameter
    torch.testing.assert_close(a.detach(), expected[0])
    torch.testing.assert_close(b.detach(), expected[1])


def test_sdxl_encoders_of_equal_width_both_train(dataset, tmp_path):
    """A diffusers SDXL folder whose CLIP-L and CLIP-G are both 32 wide: each encoder is told apart by its place, not
    its width. --train_text_encoder trains both; --learning_rate 0 with only --learning_rate_te1 trains CLIP-L alone."""
    from unittest import mock

    from library.families.encoders import clip
    from library.families.sd import tiny

    spec = dict(tiny.TINY["sdxl"])
    spec["text_encoders"] = [dict(clip.TINY_CLIP_L), dict(clip.TINY_CLIP_G, hidden_size=32, intermediate_size=64,
                                                         projection_dim=32)]  # fmt: skip
    spec["unet"] = dict(spec["unet"], cross_attention_dim=64, projection_class_embeddings_input_dim=6 * 8 + 32)
    with mock.patch.dict(tiny.TINY, {"sdxl": spec}):
        base = tiny.build_tiny("sdxl")
    folder = tiny.save_diffusers(base, tmp_path / "equal")
    both = train("sdxl", *args_for(folder, dataset, tmp_path / "both", "--save_model_as", "safetensors",
                                   "--train_text_encoder", "--learning_rate", "1e-2", steps=2))  # fmt: skip
    assert te_changed(both, base, 0) and te_changed(both, base, 1)
    te1 = train("sdxl", *args_for(folder, dataset, tmp_path / "te1", "--save_model_as", "safetensors",
                                  "--train_text_encoder", "--learning_rate", "0", "--learning_rate_te1", "1e-2",
                                  steps=2))  # fmt: skip
    assert te_changed(te1, base, 0) and not te_changed(te1, base, 1)
