"""Weight files: round trips, atomic writes, and pickles that must not run code."""

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from library.files.weights import atomic_path, load_state_dict, read_metadata, save_state_dict


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


_SAVE_ON_A_FULL_DISK = """
import os, sys, torch
from library.files.weights import SaveError, save_state_dict
try:
    save_state_dict({"w": torch.zeros(100_000)}, sys.argv[1] + "/m.safetensors")
except SaveError as e:
    print("SaveError:", e, "| left:", os.listdir(sys.argv[1]))
"""


def test_a_full_filesystem_is_a_save_error(tmp_path):
    """A real full disk: a 64 KiB tmpfs, mounted in a user namespace where the system allows one (skipped where it
    does not). safetensors raises its own SafetensorError there, not an OSError; it must become the SaveError that
    training stops cleanly on, and leave no temporary file."""
    small = tmp_path / "small"
    small.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command")
    mount = f"mount -t tmpfs -o size=64k tmpfs {small} || exit 77"
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                          f'{mount}; exec "$0" -c "$1" {small}', sys.executable, _SAVE_ON_A_FULL_DISK],
                         cwd=root, capture_output=True, text=True, timeout=120)  # fmt: skip
    if run.returncode == 77 or run.stderr.startswith("unshare:"):  # no user namespaces, or no mount in one
        pytest.skip(f"cannot mount a small filesystem here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == (f"SaveError: {small}/m.safetensors could not be written (No space left on device); "
                                  "the files saved before it are intact, and nothing was left half-written under its "
                                  "name | left: []")  # fmt: skip
