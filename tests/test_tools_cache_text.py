"""tools/cache_text_encoder_outputs.py on the tiny SDXL model.

Oracle: a training run started after the tool finds every caption cached (the text encoders run zero times,
counted) and its losses equal those of a run that filled its own cache."""

from __future__ import annotations

import pytest

from library.cli.parse import ConfigError
from library.families.sd import SDXL
from tools import cache_text_encoder_outputs


def run(main, *argv):
    return main([str(a) for a in argv])


def test_training_after_the_tool_encodes_nothing_and_has_the_same_loss(tiny_dir, tmp_path, monkeypatch):
    import sdxl_train_network
    from library.run.demo import make_example_dataset

    data = make_example_dataset(tmp_path / "data")
    flags = ["--pretrained_model_name_or_path", tiny_dir / "sdxl", "--train_data_dir", data, "--caption_extension",
             ".txt", "--resolution", "64"]  # fmt: skip
    calls = []
    original = type(SDXL).encode_tokens

    def counting(self, parts, tokens, clip_skip=None):
        calls.append(tokens[0].shape[0])
        return original(self, parts, tokens, clip_skip)

    monkeypatch.setattr(type(SDXL), "encode_tokens", counting)
    cached = run(cache_text_encoder_outputs.run, *flags, "--cache_dir", tmp_path / "cache")
    captions = len(cached.text_cache.keys)
    assert captions >= 3 and calls == [1] * captions  # every caption once, --train_batch_size (1) at a time
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == captions
    assert cached.latent_cache is None  # text only: latents are tools/cache_latents.py's job

    train = ["--cache_text_encoder_outputs_to_disk", "--network_module", "networks.lora", "--network_train_unet_only",
             "--max_train_steps", 2, "--max_data_loader_n_workers", 0, "--seed", 1, "--learning_rate", 0.01]  # fmt: skip
    calls.clear()
    after_tool = run(sdxl_train_network.run, *flags, *train, "--cache_dir", tmp_path / "cache", "--output_dir",
                     tmp_path / "a")  # fmt: skip
    assert calls == []  # training found every caption in the tool's cache
    own = run(sdxl_train_network.run, *flags, *train, "--cache_dir", tmp_path / "own", "--output_dir", tmp_path / "b")
    assert sum(calls) == captions  # the control run did encode: the count can see an encoder call
    assert after_tool.losses == own.losses and len(own.losses) == 2

    calls.clear()  # --text_encoder_batch_size sets how many captions go through the encoders at once
    run(cache_text_encoder_outputs.run, *flags, "--cache_dir", tmp_path / "batched", "--text_encoder_batch_size", 3)
    assert calls == [3, captions - 3]


def test_other_families_flags_change_nothing_and_flux_caches_what_its_training_reads(tiny_dir, tmp_path, caplog):
    """sd-scripts' FLUX flags on an SDXL model are accepted, said once each and change nothing (the family is read
    from the model); on a FLUX.1 model the tool takes FLUX's own flags (its T5 length and mask are part of the cache
    key), and flux_train_network.py with the same flags finds every caption cached (no text encoder runs)."""
    import flux_train_network
    from library.families.flux import FLUX_DEV
    from library.families.flux.tiny import build_tiny_flux, write_tiny_files
    from library.run.demo import make_example_dataset

    data = make_example_dataset(tmp_path / "data")
    sdxl = ["--pretrained_model_name_or_path", tiny_dir / "sdxl", "--train_data_dir", data, "--caption_extension",
            ".txt", "--resolution", "64"]  # fmt: skip
    plain = run(cache_text_encoder_outputs.run, *sdxl, "--cache_dir", tmp_path / "plain")
    with caplog.at_level("WARNING"):
        flagged = run(cache_text_encoder_outputs.run, *sdxl, "--cache_dir", tmp_path / "flagged", "--flux",
                      "--t5xxl_dtype", "fp16", "--apply_t5_attn_mask")  # fmt: skip
    for flag in ("--flux", "--t5xxl_dtype", "--apply_t5_attn_mask"):
        assert sum(f"{flag} has no effect here" in r.getMessage() for r in caplog.records) == 1, flag
    assert flagged.text_cache.keys == plain.text_cache.keys

    files = write_tiny_files(build_tiny_flux("flux-dev", blocks=(2, 2)), tmp_path / "flux")
    flux = ["--pretrained_model_name_or_path", files["model"], "--clip_l", files["clip_l"], "--t5xxl",
            files["t5xxl"], "--ae", files["ae"], "--train_data_dir", data, "--caption_extension", ".txt",
            "--resolution", "64", "--t5xxl_max_token_length", "16", "--apply_t5_attn_mask"]  # fmt: skip
    cached = run(cache_text_encoder_outputs.run, *flux, "--flux", "--cache_dir", tmp_path / "flux_cache")
    other = run(cache_text_encoder_outputs.run, *flux[:-1], "--cache_dir", tmp_path / "flux_other")  # no mask
    assert set(cached.text_cache.keys.values()).isdisjoint(other.text_cache.keys.values())  # the mask is in the key
    calls = []
    original = type(FLUX_DEV).encode_tokens

    def counting(self, parts, tokens, clip_skip=None, **kwargs):
        calls.append(tokens[0].shape[0])
        return original(self, parts, tokens, clip_skip, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(type(FLUX_DEV), "encode_tokens", counting)
        result = run(flux_train_network.run, *flux, "--cache_text_encoder_outputs_to_disk", "--cache_dir",
                     tmp_path / "flux_cache", "--network_module", "networks.lora", "--network_train_unet_only",
                     "--max_train_steps", 1, "--max_data_loader_n_workers", 0, "--output_dir", tmp_path / "out",
                     "--guidance_scale", "1.0", "--model_prediction_type", "raw")  # fmt: skip
    assert result.steps == 1 and calls == []


def test_flags_that_cannot_work_are_refused_together(tiny_dir, tmp_path):
    from library.run.demo import make_example_dataset

    data = make_example_dataset(tmp_path / "data")
    with pytest.raises(ConfigError, match="shuffle_caption"):
        run(cache_text_encoder_outputs.run, "--pretrained_model_name_or_path", tiny_dir / "sdxl", "--train_data_dir",
            data, "--shuffle_caption", "--caption_extension", ".txt")  # fmt: skip
