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


def test_flags_that_cannot_work_are_refused_together(tiny_dir, tmp_path):
    from library.run.demo import make_example_dataset

    data = make_example_dataset(tmp_path / "data")
    with pytest.raises(ConfigError) as e:
        run(cache_text_encoder_outputs.run, "--pretrained_model_name_or_path", tiny_dir / "sdxl", "--train_data_dir",
            data, "--flux", "--t5xxl_dtype", "fp16", "--apply_t5_attn_mask")  # fmt: skip
    for flag in ("--flux", "--t5xxl_dtype", "--apply_t5_attn_mask"):
        assert f"{flag} is not supported yet (FLUX is not a model family" in str(e.value)
    with pytest.raises(ConfigError, match="shuffle_caption"):
        run(cache_text_encoder_outputs.run, "--pretrained_model_name_or_path", tiny_dir / "sdxl", "--train_data_dir",
            data, "--shuffle_caption", "--caption_extension", ".txt")  # fmt: skip
