"""musubi-tuner's separate caching steps for Z-Image: zimage_cache_latents.py and zimage_cache_text_encoder_outputs.py
with the command lines of its docs/zimage.md write into the dataset config's cache_directory what the training run
then reads: it encodes nothing (the AE and Qwen3 calls are counted), writes nothing new, and the entries are those a
run caching inside itself writes (the same keys; Qwen3's outputs equal). Every flag of the two musubi-tuner scripts
is read or refused by name."""

from __future__ import annotations

import pytest
from _zimage_helpers import doc_command, musubi_toml
from safetensors.torch import load_file

import zimage_cache_latents
import zimage_cache_text_encoder_outputs
import zimage_train_network
from library.cli.problems import ConfigError
from library.families.zimage import ZIMAGE

pytest_plugins = ["_zimage_helpers"]

# musubi-tuner's cache_latents.setup_parser_common (zimage_cache_latents.py adds none)
LATENT_FLAGS = """--dataset_config --vae --vae_dtype --device --batch_size --num_workers --skip_existing --keep_cache
--debug_mode --console_width --console_back --console_num_images --disable_cudnn_backend""".split()
# cache_text_encoder_outputs.setup_parser_common + zimage_setup_parser
TEXT_FLAGS = """--dataset_config --device --batch_size --num_workers --skip_existing --keep_cache --text_encoder
--fp8_llm""".split()


@pytest.fixture
def counted(monkeypatch):
    """Counts of the AE encodes and Qwen3 encodes the family runs."""
    calls = {"vae": 0, "text": 0}
    encode_latents, encode_tokens = ZIMAGE.encode_latents, ZIMAGE.encode_tokens

    def latents(*a, **k):
        calls["vae"] += 1
        return encode_latents(*a, **k)

    def tokens(*a, **k):
        calls["text"] += 1
        return encode_tokens(*a, **k)

    monkeypatch.setattr(ZIMAGE, "encode_latents", latents)
    monkeypatch.setattr(ZIMAGE, "encode_tokens", tokens)
    return calls


def _entries(folder):
    return {p.relative_to(folder): p for p in folder.rglob("*.safetensors")}


@pytest.mark.parametrize("fp8_llm", [False, True])
def test_cached_then_trained_encodes_nothing(zimage_files, dataset, tmp_path, counted, fp8_llm):
    """The documented workflow (cache latents, cache text with --batch_size 16, train): the training run encodes
    nothing and writes nothing; a run caching inside itself into another (empty) cache_directory writes the same
    keys, and Qwen3's outputs are equal (the AE's latents are draws from its distribution). ``--fp8_llm`` on both
    sides: the same."""
    fp8 = ["--fp8_llm"] if fp8_llm else []
    (tmp_path / "a").mkdir()
    toml = musubi_toml(dataset, tmp_path / "a" / "dataset.toml")
    assert zimage_cache_latents.main(["--dataset_config", str(toml), "--vae", zimage_files["vae"]]) == 0
    text = ["--dataset_config", str(toml), "--text_encoder", zimage_files["text_encoder"], "--batch_size", "16"]
    assert zimage_cache_text_encoder_outputs.main(text + fp8) == 0
    assert counted["vae"] == 4 and counted["text"] == 1  # four images one at a time; four captions in one call
    written = _entries(tmp_path / "a" / "cache")
    assert len(written) == 8
    counted.update(vae=0, text=0)
    run = zimage_train_network.run(doc_command(zimage_files, toml, tmp_path / "out_a", *fp8))
    assert counted == {"vae": 0, "text": 0}
    assert _entries(tmp_path / "a" / "cache") == written and len(run.losses) == 2
    if fp8_llm:
        return  # the run caching inside itself: once, without --fp8_llm
    (tmp_path / "b").mkdir()
    toml_b = musubi_toml(dataset, tmp_path / "b" / "dataset.toml")
    zimage_train_network.run(doc_command(zimage_files, toml_b, tmp_path / "out_b", *fp8))
    assert counted["vae"] == 4 and counted["text"] >= 1  # cached inside the run
    inside = _entries(tmp_path / "b" / "cache")
    assert sorted(inside) == sorted(written)
    texts = 0
    for key in written:
        a, b = load_file(written[key]), load_file(inside[key])
        assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
        if "hidden_states" in a:  # Qwen3's outputs: no draw, so equal
            texts += 1
            assert all(a[k].equal(b[k]) for k in a), key
    assert texts == 4


def test_every_musubi_caching_flag_is_read_or_refused():
    """Each flag of musubi-tuner's two Z-Image caching scripts parses here."""
    for module, flags in ((zimage_cache_latents, LATENT_FLAGS), (zimage_cache_text_encoder_outputs, TEXT_FLAGS)):
        parser = module.build_parser()
        assert [f for f in flags if f not in parser._option_string_actions] == []


@pytest.mark.parametrize(
    ("script", "extra", "message"),
    [
        ("latents", ["--debug_mode", "image"], "--debug_mode is not supported yet"),
        ("latents", ["--vae_dtype", "int8"], "--vae_dtype int8: one of"),
        ("latents", ["--vae", "missing.safetensors"], "--vae missing.safetensors: no such file"),
        ("text", ["--device", "nowhere"], "--device nowhere"),
        ("text", ["--batch_size", "0"], "--batch_size 0: must be >= 1"),
    ],
)
def test_caching_refusals(zimage_files, dataset, tmp_path, script, extra, message):
    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    if script == "latents":
        module, model = zimage_cache_latents, ["--vae", zimage_files["vae"]]
    else:
        module, model = zimage_cache_text_encoder_outputs, ["--text_encoder", zimage_files["text_encoder"]]
    with pytest.raises((ConfigError, FileNotFoundError), match=message):  # before anything is encoded
        module.run(["--dataset_config", str(toml), *model, *extra])
    assert not (tmp_path / "cache").exists()
