"""musubi-tuner's separate caching steps for Qwen-Image: qwen_image_cache_latents.py and
qwen_image_cache_text_encoder_outputs.py with musubi-tuner's flags write into the dataset config's cache_directory
what the training run then reads: it encodes nothing (the VAE and Qwen2.5-VL calls are counted) and its losses equal
those of a run that caches inside itself. Every flag of the two musubi-tuner scripts is read or refused by name."""

from __future__ import annotations

import pytest
from _qwen_image_commands import doc_command, musubi_toml

import qwen_image_cache_latents
import qwen_image_cache_text_encoder_outputs
import qwen_image_train_network
from library.cli.problems import ConfigError
from library.families.encoders import qwen25vl
from library.families.qwen_image import QWEN_IMAGE

pytest_plugins = ["_qwen_image_helpers"]

# musubi-tuner's cache_latents.setup_parser_common + hv_setup_parser + add_model_version_args
LATENT_FLAGS = """--dataset_config --vae --vae_dtype --device --batch_size --num_workers --skip_existing --keep_cache
--debug_mode --console_width --console_back --console_num_images --disable_cudnn_backend --vae_tiling --vae_chunk_size
--vae_spatial_tile_sample_min_size --edit --edit_plus --model_version""".split()
# cache_text_encoder_outputs.setup_parser_common + qwen_image_setup_parser
TEXT_FLAGS = """--dataset_config --device --batch_size --num_workers --skip_existing --keep_cache --text_encoder --fp8_vl
--edit --edit_plus --model_version""".split()


@pytest.fixture
def counted(monkeypatch):
    """Counts of the VAE encodes and Qwen2.5-VL encodes the family runs, and of the tokenizers it builds."""
    calls = {"vae": 0, "text": 0, "tokenizer": 0}
    encode_latents, encode_tokens = QWEN_IMAGE.encode_latents, QWEN_IMAGE.encode_tokens
    load_tokenizer = qwen25vl.load_tokenizer

    def tokenizer(*a, **k):
        calls["tokenizer"] += 1
        return load_tokenizer(*a, **k)

    def latents(*a, **k):
        calls["vae"] += 1
        return encode_latents(*a, **k)

    def tokens(*a, **k):
        calls["text"] += 1
        return encode_tokens(*a, **k)

    monkeypatch.setattr(QWEN_IMAGE, "encode_latents", latents)
    monkeypatch.setattr(QWEN_IMAGE, "encode_tokens", tokens)
    monkeypatch.setattr(qwen25vl, "load_tokenizer", tokenizer)
    return calls


def test_cached_then_trained_encodes_nothing_and_matches(qwen_files, dataset, tmp_path, counted):
    """The documented workflow: cache latents, cache text, train. The training run encodes nothing, builds no
    tokenizer (about 130 MB of the process at any size) and its losses equal those of the same run caching inside
    itself (another cache_directory, empty), which builds it."""
    (tmp_path / "a").mkdir()
    toml = musubi_toml(dataset, tmp_path / "a" / "dataset.toml")
    assert qwen_image_cache_latents.main(["--dataset_config", str(toml), "--vae", qwen_files["vae"],
                                          "--skip_existing", "--num_workers", "2"]) == 0  # fmt: skip
    assert qwen_image_cache_text_encoder_outputs.main(["--dataset_config", str(toml), "--text_encoder",
                                                       qwen_files["text_encoder"], "--batch_size", "16"]) == 0  # fmt: skip
    assert counted["vae"] == 4 and counted["text"] == 1  # four images, one at a time; four captions in one call
    entries = sorted((tmp_path / "a" / "cache").rglob("*.safetensors"))
    assert len(entries) == 8
    assert counted["tokenizer"] == 1  # the text caching step tokenized
    counted.update(vae=0, text=0, tokenizer=0)
    cached = qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out_a"))
    assert counted == {"vae": 0, "text": 0, "tokenizer": 0}
    assert sorted((tmp_path / "a" / "cache").rglob("*.safetensors")) == entries  # nothing new written

    (tmp_path / "b").mkdir()
    toml_b = musubi_toml(dataset, tmp_path / "b" / "dataset.toml")
    inside = qwen_image_train_network.run(doc_command(qwen_files, toml_b, tmp_path / "out_b"))
    assert counted["vae"] == 4 and counted["text"] >= 1 and counted["tokenizer"] == 1  # cached inside the run
    assert len(cached.losses) == len(inside.losses) == 2
    assert cached.losses == inside.losses


def test_every_musubi_caching_flag_is_read_or_refused():
    """Each flag of musubi-tuner's two Qwen-Image caching scripts parses; the refused ones say so by name."""
    for module, flags in (
        (qwen_image_cache_latents, LATENT_FLAGS),
        (qwen_image_cache_text_encoder_outputs, TEXT_FLAGS),
    ):
        parser = module.build_parser()
        assert [f for f in flags if f not in parser._option_string_actions] == []


@pytest.mark.parametrize(
    ("script", "extra", "message"),
    [
        ("latents", ["--vae_dtype", "float16"], "--vae_dtype is not supported yet"),
        ("latents", ["--debug_mode", "image"], "--debug_mode is not supported yet"),
        ("latents", ["--model_version", "layered"], "--model_version layered is not supported yet"),
        ("latents", ["--vae", "missing.safetensors"], "--vae missing.safetensors: no such file"),
        ("text", ["--device", "nowhere"], "--device nowhere"),
        ("text", ["--model_version", "nope"], "--model_version nope: unknown"),
    ],
)
def test_caching_refusals(qwen_files, dataset, tmp_path, script, extra, message, capsys):
    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    if script == "latents":
        module, model = qwen_image_cache_latents, ["--vae", qwen_files["vae"]]
    else:
        module, model = qwen_image_cache_text_encoder_outputs, ["--text_encoder", qwen_files["text_encoder"]]
    with pytest.raises((ConfigError, FileNotFoundError), match=message):  # before anything is encoded
        module.run(["--dataset_config", str(toml), *model, *extra])
    assert not (tmp_path / "cache").exists()


def test_fp8_vl_caches_and_trains_with_musubis_fp8_row(qwen_files, dataset, tmp_path, counted):
    """--fp8_vl on both sides (the caching script and musubi-tuner's --fp8_base --fp8_scaled training row): the run
    finds every text entry (Qwen2.5-VL is not put in float8 by --fp8_base: musubi-tuner's --fp8_base is the DiT's)
    and encodes nothing; without --fp8_vl the keys differ and the run encodes."""
    toml = musubi_toml(dataset, tmp_path / "dataset.toml")
    assert qwen_image_cache_latents.main(["--dataset_config", str(toml), "--vae", qwen_files["vae"]]) == 0
    text = ["--dataset_config", str(toml), "--text_encoder", qwen_files["text_encoder"], "--fp8_vl"]
    assert qwen_image_cache_text_encoder_outputs.main(text) == 0
    counted.update(vae=0, text=0, tokenizer=0)
    row = ["--fp8_base", "--fp8_scaled", "--fp8_vl"]
    qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out", *row))
    assert counted == {"vae": 0, "text": 0, "tokenizer": 0}
    qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out2", "--fp8_base", "--fp8_scaled"))
    assert counted["vae"] == 0 and counted["text"] > 0  # bfloat16 Qwen2.5-VL: its own entries


def test_fp8_vl_is_a_plain_float8_cast(qwen_files):
    """qwen25vl.store_fp8 (musubi-tuner's --fp8_vl): every Linear of the language model holds float8_e4m3fn, and the
    outputs equal the bfloat16 encoder's whose Linear weights were cast to float8 and back by hand."""
    import copy

    import torch

    from library.families.encoders import qwen25vl

    parts = qwen_files["parts"]
    base = copy.deepcopy(parts.text_encoders[0]).to(torch.bfloat16)
    by_hand, stored = copy.deepcopy(base), copy.deepcopy(base)
    linears = [m for m in by_hand.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        m.weight.data = m.weight.data.to(torch.float8_e4m3fn).to(torch.bfloat16)
    assert qwen25vl.store_fp8(stored, torch.bfloat16) == len(linears) > 0
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in stored.modules() if isinstance(m, torch.nn.Linear))
    tok = parts.tokenizers[0]
    with torch.no_grad():
        want, _ = qwen25vl.encode(by_hand, tok, ["a red cube on a table"])
        got, _ = qwen25vl.encode(stored, tok, ["a red cube on a table"])
        plain, _ = qwen25vl.encode(base, tok, ["a red cube on a table"])
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (got - plain).abs().max() > 0  # float8 rounding shows


def test_a_run_after_the_caching_steps_moves_no_encoder_to_the_device(qwen_files, dataset, tmp_path):
    """On the simulated device: after the caching scripts, the training run's caching phases hold no device memory
    (every entry is found, so neither the VAE nor Qwen2.5-VL is moved there); a run that caches inside itself
    holds them there while it encodes."""
    from library.measure.simulated_device import simulated_device

    (tmp_path / "a").mkdir()
    toml = musubi_toml(dataset, tmp_path / "a" / "dataset.toml")
    assert qwen_image_cache_latents.main(["--dataset_config", str(toml), "--vae", qwen_files["vae"]]) == 0
    text = ["--dataset_config", str(toml), "--text_encoder", qwen_files["text_encoder"]]
    assert qwen_image_cache_text_encoder_outputs.main(text) == 0
    with simulated_device() as cached:
        qwen_image_train_network.run(doc_command(qwen_files, toml, tmp_path / "out_a", "--optimizer_type", "AdamW"))
    (tmp_path / "b").mkdir()
    toml_b = musubi_toml(dataset, tmp_path / "b" / "dataset.toml")
    with simulated_device() as inside:
        qwen_image_train_network.run(doc_command(qwen_files, toml_b, tmp_path / "out_b", "--optimizer_type", "AdamW"))
    phases = ("latent caching", "text caching")
    assert [cached.phase_table()[p] for p in phases] == [0, 0]
    assert all(inside.phase_table()[p] > 0 for p in phases)
