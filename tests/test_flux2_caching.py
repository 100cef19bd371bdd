"""musubi-tuner's separate caching steps for FLUX.2: flux_2_cache_latents.py and flux_2_cache_text_encoder_outputs.py
with the command lines of its docs/flux_2.md write into the dataset config's cache_directory what the training run
then reads: it encodes nothing (the AE and text-encoder calls are counted) and writes nothing new, for klein (Qwen3,
``--model_version`` given) and for dev (Mistral 3, musubi-tuner's default version, the training line without it). Every
flag of the two musubi-tuner scripts is read or refused by name."""

from __future__ import annotations

import pytest
from test_flux2 import doc_command, musubi_toml

import flux_2_cache_latents
import flux_2_cache_text_encoder_outputs
import flux_2_train_network
from library.cli.problems import ConfigError
from library.families.flux2 import FLUX2

pytest_plugins = ["_flux2_helpers"]

# musubi-tuner's cache_latents.setup_parser_common + flux2_utils.add_model_version_args
LATENT_FLAGS = """--dataset_config --vae --vae_dtype --device --batch_size --num_workers --skip_existing --keep_cache
--debug_mode --console_width --console_back --console_num_images --disable_cudnn_backend --model_version""".split()
# cache_text_encoder_outputs.setup_parser_common + flux_2_setup_parser
TEXT_FLAGS = """--dataset_config --device --batch_size --num_workers --skip_existing --keep_cache --text_encoder
--fp8_text_encoder --model_version""".split()


@pytest.fixture
def counted(monkeypatch):
    """Counts of the AE encodes and text-encoder encodes the family runs."""
    calls = {"vae": 0, "text": 0}
    encode_latents, encode_tokens = FLUX2.encode_latents, FLUX2.encode_tokens

    def latents(*a, **k):
        calls["vae"] += 1
        return encode_latents(*a, **k)

    def tokens(*a, **k):
        calls["text"] += 1
        return encode_tokens(*a, **k)

    monkeypatch.setattr(FLUX2, "encode_latents", latents)
    monkeypatch.setattr(FLUX2, "encode_tokens", tokens)
    return calls


def _toml(dataset, tmp_path):
    return musubi_toml(dataset, tmp_path / "dataset.toml", f'cache_directory = "{(tmp_path / "cache").as_posix()}"\n')


def _cache_then_train(files, toml, tmp_path, counted, version, train_argv, text_extra=()):
    given = [] if version is None else ["--model_version", version]
    assert flux_2_cache_latents.main(["--dataset_config", str(toml), "--vae", files["vae"], *given]) == 0
    text = ["--dataset_config", str(toml), "--text_encoder", files["text_encoder"], "--batch_size", "16"]
    assert flux_2_cache_text_encoder_outputs.main(text + given + list(text_extra)) == 0
    assert counted["vae"] == 4 and counted["text"] == 1  # four images one at a time; four captions in one call
    written = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert len(written) == 8
    counted.update(vae=0, text=0)
    run = flux_2_train_network.run(train_argv)
    assert counted == {"vae": 0, "text": 0}
    assert sorted((tmp_path / "cache").rglob("*.safetensors")) == written and len(run.losses) == 2
    return run


def test_klein_cached_then_trained_encodes_nothing(flux2_files, dataset, tmp_path, counted):
    """docs/flux_2.md's caching lines with --model_version (klein base here) and --fp8_text_encoder, then the
    documented training line with --fp8_base --fp8_text_encoder: the run finds every entry."""
    toml = _toml(dataset, tmp_path)
    train = doc_command(flux2_files, toml, tmp_path / "out", "--fp8_base", "--fp8_text_encoder")
    _cache_then_train(flux2_files, toml, tmp_path, counted, "klein-base-4b", train, text_extra=("--fp8_text_encoder",))


def test_dev_cached_with_the_default_version(flux2_dev_files, dataset, tmp_path, counted):
    """dev: the caching scripts without --model_version (musubi-tuner's default, dev: Mistral 3 and its tokenizer
    beside it), the training line without it either (the version read from the weights)."""
    files = {k: str(v) for k, v in flux2_dev_files.items()}
    toml = _toml(dataset, tmp_path)
    train = doc_command(files, toml, tmp_path / "out")
    assert train[:2] == ["--model_version", "klein-base-4b"]
    _cache_then_train(files, toml, tmp_path, counted, None, train[2:])


def test_every_musubi_caching_flag_is_read_or_refused():
    """Each flag of musubi-tuner's two FLUX.2 caching scripts parses here."""
    for module, flags in ((flux_2_cache_latents, LATENT_FLAGS), (flux_2_cache_text_encoder_outputs, TEXT_FLAGS)):
        parser = module.build_parser()
        assert [f for f in flags if f not in parser._option_string_actions] == []


@pytest.mark.parametrize(
    ("script", "extra", "message"),
    [
        ("latents", ["--debug_mode", "image"], "--debug_mode is not supported yet"),
        ("latents", ["--model_version", "klein-9"], "--model_version klein-9: unknown"),
        ("latents", ["--vae", "missing.safetensors"], "--vae missing.safetensors: no such file"),
        ("text", ["--model_version", "dev"], "musubi-tuner's default is dev"),
        ("text", ["--device", "nowhere"], "--device nowhere"),
    ],
)
def test_caching_refusals(flux2_files, dataset, tmp_path, script, extra, message):
    toml = _toml(dataset, tmp_path)
    if script == "latents":
        module, model = flux_2_cache_latents, ["--vae", flux2_files["vae"], "--model_version", "klein-4b"]
    else:
        module, model = flux_2_cache_text_encoder_outputs, ["--text_encoder", flux2_files["text_encoder"]]
    with pytest.raises((ConfigError, ValueError, FileNotFoundError), match=message):  # before anything is encoded
        module.run(["--dataset_config", str(toml), *model, *extra])
    assert not (tmp_path / "cache").exists()
