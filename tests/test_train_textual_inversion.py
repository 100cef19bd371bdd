"""train_textual_inversion.py / sdxl_train_textual_inversion.py end to end on the tiny models, in-process.

Oracles: diffusers' load_textual_inversion reads the files we write and gives the same prompt embeddings and the same
pixels as our encoder and sampler; every weight but the new rows stays bit-identical; a resumed run repeats the
uninterrupted one bit for bit.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from _token_helpers import TOKEN, token_dataset
from PIL import Image

import gen_img
import train_textual_inversion
from library.cli.parse import ConfigError
from library.families import get_family
from library.files.weights import load_state_dict, read_metadata
from library.run import setup as run_setup


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return token_dataset(tmp_path_factory.mktemp("data"))


def args_for(model, dataset, out, *extra, steps=3):
    return [
        "--pretrained_model_name_or_path", str(model),
        "--train_data_dir", str(dataset),
        "--caption_extension", ".txt",
        "--resolution", "64",
        "--output_dir", str(out),
        "--token_string", TOKEN,
        "--init_word", "shape",
        "--num_vectors_per_token", "2",
        "--learning_rate", "5e-2",
        "--train_batch_size", "2",
        "--max_train_steps", str(steps),
        "--max_data_loader_n_workers", "0",
        "--seed", "1",
        *extra,
    ]  # fmt: skip


def train(family, *argv, runs=None, monkeypatch=None):
    """Run the recipe in-process; with ``runs`` (a list) and ``monkeypatch``, the session's Run is appended to it."""
    if runs is not None:
        start = run_setup.start
        monkeypatch.setattr(run_setup, "start", lambda cfg: runs.append(start(cfg)) or runs[-1])
    names = ("sdxl",) if family == "sdxl" else ("sd1", "sd2")
    return train_textual_inversion.run(list(argv), family_names=names)


def _max_diff(a: Image.Image, b: Image.Image) -> int:
    return int(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max())


def _fresh_pipe(path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _load_into_diffusers(pipe, family, path):
    """SD1/SD2: one call; SDXL: one call per encoder with its key (docs/formats.md "Textual-inversion embeddings")."""
    if len(family.ti_embedding_keys) == 1:
        pipe.load_textual_inversion(str(path), token=TOKEN)
        return
    tensors = load_state_dict(path)[0]
    pipe.load_textual_inversion(tensors["clip_l"], token=TOKEN, text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer)  # fmt: skip
    pipe.load_textual_inversion(tensors["clip_g"], token=TOKEN, text_encoder=pipe.text_encoder_2,
                                tokenizer=pipe.tokenizer_2)  # fmt: skip


@pytest.mark.parametrize("family_name", ["sd1", "sd2", "sdxl"])
def test_only_new_rows_train_and_diffusers_reads_the_file(tiny_dir, dataset, tmp_path, monkeypatch, family_name):
    from library.text.prompt_weighting import encode_weighted

    family = get_family(family_name)
    runs = []
    ext = "safetensors" if family_name != "sd2" else "pt"
    result = train(family_name, *args_for(tiny_dir / family_name, dataset, tmp_path, "--save_model_as", ext),
                   runs=runs, monkeypatch=monkeypatch)  # fmt: skip
    monkeypatch.undo()
    assert result.output == tmp_path / f"{TOKEN}.{ext}" and result.steps == 3
    tensors = load_state_dict(result.output)[0]
    widths = [te.get_input_embeddings().weight.shape[1] for te in runs[0].parts.text_encoders]
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        k: (2, w) for k, w in zip(family.ti_embedding_keys, widths)
    }
    if ext == "safetensors":
        meta = read_metadata(result.output)
        assert meta["modelspec.architecture"].endswith("/textual-inversion") and meta["ss_token_string"] == TOKEN
        assert meta["ss_steps"] == "3" and meta["ss_num_vectors_per_token"] == "2"

    # every weight but the new rows is bit-identical to a fresh load of the model
    parts, fresh = runs[0].parts, family.load(tiny_dir / family_name)
    for module, original in [(parts.denoiser, fresh.denoiser), (parts.vae, fresh.vae),
                             *zip(parts.text_encoders, fresh.text_encoders)]:  # fmt: skip
        ours, theirs = module.state_dict(), original.state_dict()
        for key, value in theirs.items():
            assert torch.equal(ours[key][: value.shape[0]], value), key  # the token table only grew
    init = [te.get_input_embeddings().weight[tok.convert_tokens_to_ids(["shape</w>"])[0]] for te, tok in
            zip(fresh.text_encoders, fresh.tokenizers)]  # fmt: skip
    assert all(not torch.equal(tensors[k][0], v) for k, v in zip(family.ti_embedding_keys, init))  # it trained

    # diffusers reads the file into a fresh pipeline: same prompt embeddings as our encoder during training
    pipe = _fresh_pipe(tiny_dir / family_name)
    _load_into_diffusers(pipe, family, result.output)
    prompt = f"a photo of {TOKEN}"
    ours = encode_weighted(family, parts, [prompt])
    if family_name == "sdxl":
        theirs, _, pooled, _ = pipe.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=False)
        torch.testing.assert_close(ours.pooled, pooled, rtol=0, atol=1e-5)
    else:
        theirs, _ = pipe.encode_prompt(prompt, "cpu", 1, False)
    torch.testing.assert_close(ours.hidden_states, theirs, rtol=0, atol=1e-5)
    plain = encode_weighted(family, fresh, ["a photo of shape shape"])
    assert (ours.hidden_states - plain.hidden_states).abs().max() > 1e-4  # the trained rows are used

    # our sampler (gen_img) with the file gives diffusers' pixels for the same seed and scheduler
    out = gen_img.run(["--ckpt", str(tiny_dir / family_name), "--prompt", f"{prompt} --d 4 --n bad",
                        "--textual_inversion_embeddings", str(result.output), "--outdir", str(tmp_path / "img"),
                        "--steps", "3", "--W", "64", "--H", "64", "--scale", "6"])  # fmt: skip
    theirs_img = pipe(prompt, negative_prompt="bad", height=64, width=64, num_inference_steps=3, guidance_scale=6.0,
                      generator=torch.Generator().manual_seed(4)).images[0]  # fmt: skip
    assert _max_diff(Image.open(out[0]), theirs_img) <= 1


def test_samples_during_training_use_the_embedding(tiny_dir, dataset, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"a photo of {TOKEN} --d 4 --n bad --w 64 --h 64 --s 3 --l 6\n")
    argv = args_for(
        tiny_dir / "sd1",
        dataset,
        tmp_path / "run",
        "--sample_prompts",
        str(prompts),
        "--sample_at_first",
        "--sample_every_n_steps",
        "3",
        "--sample_sampler",
        "ddim",
        "--save_model_as",
        "safetensors",
    )
    result = train("sd1", *argv)
    samples = sorted((tmp_path / "run" / "sample").glob(f"{TOKEN}_*_00_*.png"))
    first, last = [s for s in samples if "_e000000_" in s.name], [s for s in samples if "_000003_" in s.name]
    assert first and last
    again = gen_img.run(["--ckpt", str(tiny_dir / "sd1"), "--prompt", f"a photo of {TOKEN} --d 4 --n bad",
                          "--textual_inversion_embeddings", str(result.output), "--outdir", str(tmp_path / "img"),
                          "--steps", "3", "--W", "64", "--H", "64", "--scale", "6", "--sampler", "ddim"])  # fmt: skip
    assert _max_diff(Image.open(last[0]), Image.open(again[0])) <= 1  # the sample used the trained rows
    assert _max_diff(Image.open(first[0]), Image.open(last[0])) > 0


@pytest.mark.parametrize("extra", [[], ["--use_object_template", "--gradient_accumulation_steps", "2", "--ema"]])
def test_resume_repeats_the_uninterrupted_run_exactly(tiny_dir, dataset, tmp_path, extra):
    common = [*extra, "--save_every_n_steps", "3", "--save_state"]
    full = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "a", *common, steps=6))
    state = tmp_path / "a" / f"{TOKEN}-step00000003-state"
    assert state.is_dir()
    resumed = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "b", *common, "--resume", str(state),
                                     steps=6))  # fmt: skip
    assert resumed.losses == full.losses and resumed.steps == 6
    a, b = load_state_dict(full.output)[0], load_state_dict(resumed.output)[0]
    assert a.keys() == b.keys() == {"emb_params"} and torch.equal(a["emb_params"], b["emb_params"])
    if "--ema" in extra:
        ea, eb = load_state_dict(full.ema_output)[0], load_state_dict(resumed.ema_output)[0]
        assert torch.equal(ea["emb_params"], eb["emb_params"]) and not torch.equal(ea["emb_params"], a["emb_params"])


def test_validation_weights_file_and_nan_stop(tiny_dir, dataset, tmp_path):
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "v", "--validation_split", "0.25", "--validate_every_n_steps",
                    "2", "--use_style_template", steps=4)  # fmt: skip
    result = train("sd1", *argv)
    assert [s for s, _ in result.validation] == [2, 4] and all(v > 0 for _, v in result.validation)
    assert result.output.suffix == ".pt"  # sd-scripts' default format for embeddings
    raw = torch.load(result.output, weights_only=True)
    assert set(raw) == {"emb_params"}

    # --weights continues from a file: its vectors are the starting point
    shutil.copy(result.output, tmp_path / "start.pt")
    cont = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "w", "--weights", str(tmp_path / "start.pt"),
                                  "--learning_rate", "0", steps=1))  # fmt: skip
    assert torch.equal(torch.load(cont.output, weights_only=True)["emb_params"], raw["emb_params"])

    nan = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "n", "--save_every_n_steps", "1",
                                 "--learning_rate", "1e30", "--optimizer_type", "SGDNesterov", "--max_grad_norm", "0",
                                 steps=6))  # fmt: skip
    assert nan.failed and "loss became" in nan.failed and nan.output is None
    saved = sorted((tmp_path / "n").glob(f"{TOKEN}-step*.pt"))
    assert saved and all(torch.isfinite(torch.load(p, weights_only=True)["emb_params"]).all() for p in saved)


def test_bad_input_is_reported(tiny_dir, dataset, tmp_path):
    with pytest.raises(ConfigError) as e:
        train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path, "--token_string", "two words",
                               "--num_vectors_per_token", "0", "--use_object_template", "--use_style_template",
                               "--weights", "missing.pt"))  # fmt: skip
    msg = str(e.value)
    assert "--token_string 'two words'" in msg and "--num_vectors_per_token must be >= 1" in msg
    assert "exclude each other" in msg and "missing.pt: no such file" in msg
    with pytest.raises(ValueError, match="already in the tokenizer's vocabulary"):
        train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path, "--token_string", "photo", "--caption_prefix",
                               "photo"))  # fmt: skip
    with pytest.raises(ValueError, match="tokenises to nothing"):
        train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path, "--init_word", ""))
    with pytest.raises(ConfigError, match="sdxl_train"):
        train("sd1", *args_for(tiny_dir / "sdxl", dataset, tmp_path))


def test_fixed_noise_loss_on_the_training_images_falls(tiny_dir, dataset, tmp_path, monkeypatch):
    """The denoising loss on the training images at fixed noise and timesteps falls by more than blanking every
    caption changes it: the freshly built tiny model's text path moves the loss only that much (~1.5 %), and the new
    rows use it fully. On a text-dependent base (fine-tuned first; ~2 min, too slow for a test) the drop is large
    and reaches the true caption's loss: benchmarks/bench_embedding_loss.py, docs/training.md."""
    from library.run.train_step import validation_loss

    runs = []
    measured = {}
    original = train_textual_inversion.train

    def fixed_noise_loss(models):
        return validation_loss(models, runs[0].make_loader().epoch(0), 123, [100, 300, 500, 700, 900])

    def measure_then_train(run, trainable, groups):
        measured["models"] = models = trainable.step_models(run.step_models)  # the token's caption rewrite
        measured["before"] = fixed_noise_loss(models)
        blank = dataclasses.replace(models, caption_rewrite=lambda captions, generator: ["" for _ in captions])
        measured["blank"] = fixed_noise_loss(blank)
        unet = {k: v.clone() for k, v in run.parts.denoiser.state_dict().items()}
        result = original(run, trainable, groups)
        assert all(torch.equal(v, run.parts.denoiser.state_dict()[k]) for k, v in unet.items())
        return result

    monkeypatch.setattr(train_textual_inversion, "train", measure_then_train)
    train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path, steps=60), runs=runs, monkeypatch=monkeypatch)
    after = fixed_noise_loss(measured["models"])
    drop, text_effect = measured["before"] - after, measured["blank"] - measured["before"]
    assert text_effect > 0 and drop > text_effect, (measured, after)


# ------------------------------------------------------------------------------------------ batches without the token
def _record_steps(monkeypatch, records):
    """After each optimizer step: (rows, Adam's step count, learning rate, training generator state, global RNG)."""
    from library.run.trainer import Trainer

    done = Trainer.step_done

    def step_done(self, loss):
        done(self, loss)
        state = self.optimizer.optimizer.state.get(self.trainable.rows[0], {})
        records.append((self.trainable.rows[0].detach().clone(), int(state.get("step", 0)),
                        self.scheduler.get_last_lr()[0], self.generator.get_state(), torch.get_rng_state()))  # fmt: skip

    monkeypatch.setattr(Trainer, "step_done", step_done)


def test_a_batch_without_the_token_is_a_step_that_changes_nothing(tiny_dir, tmp_path, monkeypatch, caplog):
    """Batch 1 with --caption_dropout_rate 0.5 on captions of which one lacks the token: every step is counted,
    and a step whose caption lacks the token leaves the rows and the optimizer state as they were (it used to crash
    with "element 0 of tensors does not require grad"). Oracle for the counters and the random stream: the same run
    with the rows wired into every batch (a zero gradient there, so an ordinary optimizer step) has the same
    learning rates and draws the same noise and timesteps, step for step."""
    from library.run.token_embeddings import TokenEmbeddings

    data = token_dataset(tmp_path / "data")
    lacking = next(data.rglob("00_circle.txt"))
    lacking.write_text(lacking.read_text().replace(f"{TOKEN} ", ""))
    extra = ["--train_batch_size", "1", "--caption_dropout_rate", "0.5", "--lr_scheduler", "linear"]
    hook, seen = TokenEmbeddings._hook, []

    def recording(self, index, first):  # whether each batch's captions hold the token
        inner = hook(self, index, first)

        def record(module, inputs, output):
            seen.append(bool((inputs[0] >= first).any()))
            return inner(module, inputs, output)

        return record

    monkeypatch.setattr(TokenEmbeddings, "_hook", recording)
    steps = []
    _record_steps(monkeypatch, steps)
    with caplog.at_level("WARNING", logger="sdtrain"):
        result = train("sd1", *args_for(tiny_dir / "sd1", data, tmp_path / "a", *extra, steps=8))
    assert result.steps == 8 and result.output.is_file() and len(seen) == 8
    assert 0 < seen.count(False) < 8, seen  # some batches lacked the token (dropped or without it), others not
    assert f"1 of 4 training captions lack the token '{TOKEN}'" in caplog.text
    assert "caption_dropout_rate can remove the token" in caplog.text
    adam_steps = [s[1] for s in steps]
    assert adam_steps == [sum(seen[: i + 1]) for i in range(8)]  # the optimizer stepped only with the token
    for i in range(1, 8):
        assert torch.equal(steps[i][0], steps[i - 1][0]) == (not seen[i])  # the rows moved only with it

    def reaching(self, index, first):  # the reference: every batch reaches the rows
        inner = hook(self, index, first)
        return lambda module, inputs, output: inner(module, inputs, output) + 0 * self.rows[index].sum()

    monkeypatch.setattr(TokenEmbeddings, "_hook", reaching)
    train("sd1", *args_for(tiny_dir / "sd1", data, tmp_path / "b", *extra, steps=8))
    steps, normal = steps[:8], steps[8:]
    assert [s[1] for s in normal] == list(range(1, 9))  # an optimizer step at every step
    for (_, _, lr, gen, rng), (_, _, lr_ref, gen_ref, rng_ref) in zip(steps, normal, strict=True):
        assert lr == lr_ref and torch.equal(gen, gen_ref) and torch.equal(rng, rng_ref)


def test_captions_without_the_token_anywhere_are_refused_before_the_model_loads(tiny_dir, tmp_path, monkeypatch):
    data = token_dataset(tmp_path / "data")
    for txt in data.rglob("*.txt"):
        txt.write_text(txt.read_text().replace(f"{TOKEN} ", ""))
    monkeypatch.setattr(run_setup, "load_model", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=f"none of the 4 training captions holds the token .*{data.name}") as e:
        train("sd1", *args_for(tiny_dir / "sd1", data, tmp_path / "o"))
    assert "--use_object_template" in str(e.value) and f"--caption_prefix {TOKEN}" in str(e.value)
    with pytest.raises(ConfigError, match="caption dropout removes them all"):
        train("sd1", *args_for(tiny_dir / "sd1", token_dataset(tmp_path / "d2"), tmp_path / "o",
                               "--caption_dropout_every_n_epochs", "1"))  # fmt: skip
    with pytest.raises(pytest.fail.Exception, match="the model loaded"):  # templates hold the token: it goes on
        train("sd1", *args_for(tiny_dir / "sd1", data, tmp_path / "o", "--use_object_template"))
