"""Weight files: round trips, atomic writes, and pickles that must not run code."""

import os
import pickle

import pytest
import torch

from library.weight_files import atomic_path, load_state_dict, read_metadata, save_state_dict


def test_round_trip_each_format(tmp_path):
    sd = {"a.weight": torch.randn(3, 4), "b": torch.arange(5)}
    for name in ("m.safetensors", "m.ckpt", "m.pt"):
        save_state_dict(sd, tmp_path / name, metadata={"k": "v"}, dtype=torch.float16)
        back, meta = load_state_dict(tmp_path / name)
        assert back["a.weight"].dtype == torch.float16 and back["b"].dtype == torch.int64
        torch.testing.assert_close(back["a.weight"], sd["a.weight"].half())
        assert meta == ({} if name.endswith(".pt") else {"k": "v"})
    assert read_metadata(tmp_path / "m.safetensors") == {"k": "v"}
    assert torch.load(tmp_path / "m.ckpt", weights_only=True).keys() == {"state_dict", "k"}
    assert set(torch.load(tmp_path / "m.pt", weights_only=True)) == {"a.weight", "b"}


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_malicious_pickle_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as f:
        pickle.dump({"state_dict": {"w": _Evil()}}, f)
    with pytest.raises(ValueError, match=r"evil\.ckpt.*weights_only=True.*safetensors"):
        load_state_dict(path)
    assert not (tmp_path / "PWNED").exists()


def test_failed_write_keeps_previous_file(tmp_path):
    target = tmp_path / "out.safetensors"
    save_state_dict({"w": torch.ones(2)}, target)
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("crash mid-write")
    torch.testing.assert_close(load_state_dict(target)[0]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_state_dict(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError, match="folder"):
        load_state_dict(tmp_path)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unsupported weight file type"):
        load_state_dict(tmp_path / "x.txt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match="bad.safetensors: not a valid safetensors"):
        load_state_dict(tmp_path / "bad.safetensors")


def test_saved_file_has_default_permissions(tmp_path):
    save_state_dict({"w": torch.ones(1)}, tmp_path / "p.safetensors")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "p.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
