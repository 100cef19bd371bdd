"""The console of a run: transformers', diffusers' and huggingface_hub's own progress bars ("Loading weights" while
the text encoder loads) and the notices of transformers, diffusers and bitsandbytes stay off between ours;
``--console_log_level DEBUG`` puts theirs back as they were. Each run stops once set up (model loaded)."""

from __future__ import annotations

import logging

import pytest
from diffusers.utils import logging as diffusers_logging
from huggingface_hub import utils as hub_utils
from transformers.utils import logging as transformers_logging

import train_network
from library.cli import console as logs
from library.run import setup as run_setup

NOTICE_LOGGERS = {  # where each library's notices come from
    "transformers": transformers_logging.get_logger("transformers.modeling_utils"),
    "diffusers": diffusers_logging.get_logger("diffusers.models.modeling_utils"),
    "bitsandbytes": logging.getLogger("bitsandbytes.backends.cpu.ops"),  # "Failed to load CPU gemm_4bit_forward"
}


class SetUp(Exception):
    pass


@pytest.fixture
def their_defaults(monkeypatch):
    """A user's process: the libraries' warnings and bars on (the test session turns their verbosity down through
    the environment), and nothing left from earlier runs in this session."""
    logs.library_output(show=True)
    for name in ("TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    before = [lib.get_verbosity() for lib in (transformers_logging, diffusers_logging)]
    for lib in (transformers_logging, diffusers_logging):
        lib.set_verbosity_warning()
    monkeypatch.setattr(run_setup, "release_unused_parts", lambda run: (_ for _ in ()).throw(SetUp()))
    yield
    logs.library_output(show=True)
    for lib, verbosity in zip((transformers_logging, diffusers_logging), before):
        lib.set_verbosity(verbosity)


def set_up(tiny_dir, dataset, out, capsys, *extra) -> str:
    """A train_network.py run up to its first step; what it wrote to stderr."""
    argv = [
        "--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--train_data_dir", str(dataset),
        "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--network_module",
        "networks.lora", "--max_train_steps", "1", "--max_data_loader_n_workers", "0", *extra,
    ]  # fmt: skip
    with pytest.raises(SetUp):
        train_network.run(argv)
    return capsys.readouterr().err


def shown() -> dict[str, bool]:
    notices = {name: log.isEnabledFor(logging.WARNING) for name, log in NOTICE_LOGGERS.items()}
    bars = {"transformers bars": transformers_logging.is_progress_bar_enabled(),
            "diffusers bars": diffusers_logging.is_progress_bar_enabled(),
            "hub bars": not hub_utils.are_progress_bars_disabled()}  # fmt: skip
    return {**notices, **bars}


def test_their_bars_and_notices_only_with_debug(tiny_dir, dataset, tmp_path, capsys, their_defaults):
    err = set_up(tiny_dir, dataset, tmp_path / "a", capsys)
    assert "Loading weights" not in err and "prediction type" in err  # ours still shows
    assert not any(shown().values()), shown()
    err = set_up(tiny_dir, dataset, tmp_path / "b", capsys, "--console_log_level", "DEBUG")
    assert "Loading weights" in err
    assert all(shown().values()), shown()
    logs.console_logging(None, None, False)  # the next run's logging setup in this process: off again
    assert not any(shown().values()), shown()


def test_a_tool_command_line_shows_only_its_own_bars(tiny_dir, tmp_path, capsys, their_defaults):
    """The post-training tools and preparation scripts (``main`` through ``networks.tool_common.main_guard``) turn
    the libraries' bars and notices off too: merge_models.py loading a diffusers folder prints its own line only."""
    from tools import merge_models

    out = tmp_path / "merged.safetensors"
    assert shown()["transformers bars"]  # a user's process before the tool runs
    assert merge_models.main(["--models", str(tiny_dir / "sd1"), str(tiny_dir / "sd1"), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert out.is_file() and "Loading weights" not in err
    assert not any(shown().values()), shown()
