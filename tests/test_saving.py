"""File naming as sd-scripts, rotation of old files, and the resumable state folder."""

import argparse
import random

import pytest
import torch

from library.cli.parse import ConfigError
from library.device.rng import capture_rng, restore_rng
from library.run.run_files import (
    SaveConfig,
    add_save_args,
    add_state_args,
    embeddings_dir,
    load_train_state,
    model_file,
    rotate,
    save_epoch_now,
    save_step_now,
    save_train_state,
    state_dir,
)


def _cfg(tmp_path, *argv):
    p = argparse.ArgumentParser()
    add_save_args(p)
    add_state_args(p)
    return SaveConfig.from_args(p.parse_args(["--output_dir", str(tmp_path), *argv]))


def test_names_like_sd_scripts(tmp_path):
    cfg = _cfg(tmp_path)
    assert model_file(cfg, epoch=3).name == "epoch-000003.safetensors"
    assert model_file(cfg, step=20).name == "at-step00000020.safetensors"
    assert model_file(cfg).name == "last.safetensors"
    named = _cfg(tmp_path, "--output_name", "sks", "--save_model_as", "pt")
    assert model_file(named, epoch=1).name == "sks-000001.pt" and state_dir(named).name == "sks-state"


def test_when_to_save(tmp_path):
    cfg = _cfg(tmp_path, "--save_every_n_epochs", "2", "--save_every_n_steps", "5")
    assert [e for e in range(1, 7) if save_epoch_now(cfg, e, 6)] == [2, 4]  # never at the last epoch
    assert [s for s in range(1, 16) if save_step_now(cfg, s, 15)] == [5, 10]
    ratio = _cfg(tmp_path, "--save_n_epoch_ratio", "3")
    assert [e for e in range(1, 10) if save_epoch_now(ratio, e, 9)] == [3, 6]


def test_rotation_keeps_last_n(tmp_path):
    cfg = _cfg(
        tmp_path,
        "--save_every_n_epochs",
        "1",
        "--save_last_n_epochs",
        "2",
        "--save_every_n_steps",
        "10",
        "--save_last_n_steps",
        "20",
    )
    for e in range(1, 6):
        model_file(cfg, epoch=e).write_text("x")
        embeddings_dir(model_file(cfg, epoch=e)).mkdir()  # pivotal tuning's token files go with their adapter file
        rotate(cfg, epoch=e, num_epochs=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch-000004.safetensors",
        "epoch-000004_embeddings",
        "epoch-000005.safetensors",
        "epoch-000005_embeddings",
    ]
    for s in (10, 20, 30, 40):
        model_file(cfg, step=s).write_text("x")
        rotate(cfg, step=s)
    assert sorted(p.name for p in tmp_path.glob("at-*")) == [
        "at-step00000020.safetensors",
        "at-step00000030.safetensors",
        "at-step00000040.safetensors",
    ]


def test_state_round_trip(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(1)
    random.seed(2)
    rng = capture_rng({"noise": gen})
    folder = save_train_state(
        tmp_path / "s-state",
        trained=model.state_dict(),
        optimizer=opt,
        scheduler=sched,
        counters={"epoch": 1, "step": 1},
        rngs=[rng],
    )
    expected = (torch.rand(2), random.random(), torch.rand(2, generator=gen))
    state = load_train_state(folder)
    restore_rng(state["rng"], {"noise": gen})
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    assert torch.equal(torch.rand(2, generator=gen), expected[2])
    assert state["counters"] == {"epoch": 1, "step": 1}
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    opt2.load_state_dict(state["optimizer"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    # resaving over an existing folder replaces it atomically
    save_train_state(
        folder, trained=model.state_dict(), optimizer=opt, scheduler=sched, counters={"step": 2}, rngs=[rng]
    )
    assert load_train_state(folder)["counters"] == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-state"]


def test_bad_values(tmp_path):
    with pytest.raises(ConfigError, match="--resume .*neither a state folder"):
        _cfg(tmp_path, "--resume", str(tmp_path))
    p = argparse.ArgumentParser()
    add_save_args(p)
    add_state_args(p)
    with pytest.raises(ConfigError, match="--output_dir is required"):
        SaveConfig.from_args(p.parse_args([]))
