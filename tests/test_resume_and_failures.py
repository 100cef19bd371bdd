"""Runs that repeat, and failures that stay clean, on the tiny SD1 model in-process.

Oracles: a resumed run repeats the uninterrupted one bit for bit; bad input exits 2 with one `error:` line before any
model loads and leaves the output folder byte for byte as it was; a save that fails on a full disk names the file,
keeps every earlier file and leaves a state that resumes to the uninterrupted result.
"""

from __future__ import annotations

import errno
import hashlib
import pickle
import shutil

import pytest
import torch
from test_train_network import args_for, train

import train_network
from library.files.weights import load_state_dict, save_state_dict
from library.run import loop
from library.run import setup as run_setup


def snapshot(folder):
    """{relative path: (size, mtime_ns, sha256)} of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def cli(monkeypatch, capsys, argv):
    """train_network.py from the command line: (exit code, stdout, stderr)."""
    monkeypatch.setattr("sys.argv", ["train_network.py", *argv])
    code = train_network.main()
    out = capsys.readouterr()
    return code, out.out, out.err


def no_model_load(monkeypatch):
    """Make loading the model fail loudly: the check under test must come before it."""

    def refuse(*a, **kw):
        raise AssertionError("the model was loaded before the problem was reported")

    monkeypatch.setattr(run_setup, "load_model", refuse)


def one_error_line(err: str) -> str:
    """The one `error:` message of ``err`` (a ConfigError lists its problems below it); no traceback, no second
    error."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if "error: " in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return err[err.index("error: ") :]


# ------------------------------------------------------------------------------------------ resume a finished run
@pytest.fixture(scope="module")
def finished(tiny_dir, dataset, tmp_path_factory):
    """A 3-step run with a state every 2 steps and at the end (t-step00000002-state, t-state)."""
    out = tmp_path_factory.mktemp("finished")
    argv = args_for(tiny_dir / "sd1", dataset, out, "--save_every_n_steps", "2", "--save_state", steps=3)
    result = train("sd1", *argv)
    assert (out / "t-state").is_dir() and (out / "t-step00000002-state").is_dir()
    return out, argv, result


@pytest.mark.parametrize("resume", ["t-state", "."])  # the state folder, or the output folder (newest state)
def test_resuming_a_finished_run_says_so_and_writes_nothing(finished, monkeypatch, capsys, resume):
    out, argv, _ = finished
    before = snapshot(out)
    no_model_load(monkeypatch)
    code, stdout, err = cli(monkeypatch, capsys, [*argv, "--resume", str(out / resume)])
    assert code == 0 and "Traceback" not in err
    assert "reaches --max_train_steps 3" in stdout and "nothing left to train" in stdout
    assert snapshot(out) == before


def test_resuming_a_finished_epoch_run_with_save_state(tiny_dir, dataset, tmp_path, monkeypatch, capsys):
    """--max_train_epochs with --save_state: resuming the final state is a no-op (it used to crash on
    'Trainer' object has no attribute 'epoch_batches'); giving one more epoch trains exactly that epoch. The four
    images once each, batch 2: an epoch of two steps (the example folder's 10 repeats made it 10 steps)."""
    once = tmp_path / "data" / "1_sks shape"
    once.mkdir(parents=True)
    for file in (dataset / "10_sks shape").iterdir():
        shutil.copy(file, once / file.name)
    argv = args_for(tiny_dir / "sd1", once.parent, tmp_path / "a", "--max_train_epochs", "1", "--save_state",
                    "--train_batch_size", "2")  # fmt: skip
    first = train("sd1", *argv)
    before = snapshot(tmp_path / "a")
    code, stdout, _ = cli(monkeypatch, capsys, [*argv, "--resume", str(tmp_path / "a" / "t-state")])
    assert code == 0 and "reaches --max_train_epochs 1" in stdout and snapshot(tmp_path / "a") == before
    more = [a if a != "1" or argv[i - 1] != "--max_train_epochs" else "2" for i, a in enumerate(argv)]
    resumed = train("sd1", *more, "--resume", str(tmp_path / "a" / "t-state"), "--output_dir", str(tmp_path / "b"))
    full = train("sd1", *more, "--output_dir", str(tmp_path / "c"))
    assert first.steps == 2 and resumed.steps == full.steps == 2 * first.steps and resumed.losses == full.losses


def test_resume_from_the_output_folder_picks_the_newest_state(finished, tiny_dir, dataset, tmp_path, caplog):
    out, _, _ = finished
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "b", "--save_every_n_steps", "2", "--save_state", steps=5)
    (out / "t-step00000004-state.partial").mkdir(exist_ok=True)  # an unfinished state is never picked
    with caplog.at_level("INFO", logger="sdtrain"):
        resumed = train("sd1", *argv, "--resume", str(out))
    assert f"resumed from {out / 't-state'} (the newest state in {out.resolve()}) at step 3" in caplog.text
    full = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "c", steps=5))
    assert resumed.steps == 5 and resumed.losses == full.losses


# ------------------------------------------------------------------------------------------ states that do not fit
@pytest.mark.parametrize(
    "change, named",
    [
        (["--network_dim", "8"], "--network_dim 4 but this command line gives 8"),
        (["--optimizer_type", "SGDNesterov"], "--optimizer_type adamw but this command line gives sgdnesterov"),
        (["--network_args", "algo=loha"], "--network_args algo lora but this command line gives loha"),
    ],
)
def test_a_state_with_other_settings_is_refused_up_front(finished, monkeypatch, capsys, change, named):
    out, argv, _ = finished
    before = snapshot(out)
    no_model_load(monkeypatch)
    code, _, err = cli(monkeypatch, capsys, [*argv, *change, "--max_train_steps", "5", "--resume", str(out)])
    assert code == 2 and named in one_error_line(err) and snapshot(out) == before


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda d: (d / "optimizer.pt").write_bytes((d / "optimizer.pt").read_bytes()[:100]), "optimizer.pt"),
        (lambda d: (d / "trained.safetensors").write_bytes(b"\x00" * 10), "trained.safetensors"),
        (lambda d: (d / "scheduler.pt").write_bytes(pickle.dumps(_Evil())), "scheduler.pt"),
        (lambda d: (d / "train_state.json").write_text("{not json"), "train_state.json"),
        (lambda d: (d / "scheduler.pt").unlink(), "scheduler.pt"),
    ],
)
def test_a_damaged_state_gives_one_message_naming_the_file(finished, tmp_path, monkeypatch, capsys, damage, named):
    import shutil

    out, argv, _ = finished
    state = tmp_path / "copy-state"
    shutil.copytree(out / "t-step00000002-state", state)
    damage(state)
    no_model_load(monkeypatch)
    code, stdout, err = cli(monkeypatch, capsys, [*argv, "--output_dir", str(tmp_path / "o"), "--resume", str(state)])
    assert code == 2 and str(state / named) in one_error_line(err) and "this must never run" not in stdout
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").glob("*.safetensors"))


def test_a_state_of_another_shape_without_recorded_settings_is_named(finished, tmp_path, monkeypatch, capsys):
    """States written before settings were recorded: the shapes are compared when the state loads."""
    import json
    import shutil

    out, argv, _ = finished
    state = tmp_path / "old-state"
    shutil.copytree(out / "t-step00000002-state", state)
    counters = json.loads((state / "train_state.json").read_text())
    del counters["settings"]
    (state / "train_state.json").write_text(json.dumps(counters))
    code, _, err = cli(monkeypatch, capsys, [*argv, "--network_dim", "8", "--output_dir", str(tmp_path / "o"),
                                             "--max_train_steps", "5", "--resume", str(state)])  # fmt: skip
    assert code == 2 and "trained.safetensors does not fit this run" in one_error_line(err)


# ------------------------------------------------------------------------------------------ checked before training
@pytest.mark.parametrize("lr", ["nan", "inf", "1e39", "-1"])
def test_a_learning_rate_that_float32_cannot_hold_is_refused(tiny_dir, dataset, tmp_path, monkeypatch, capsys, lr):
    no_model_load(monkeypatch)
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "o", "--learning_rate", lr)
    code, _, err = cli(monkeypatch, capsys, argv)
    assert code == 2 and "--learning_rate" in one_error_line(err) and not (tmp_path / "o").exists()
    code, _, err = cli(monkeypatch, capsys, [*argv[:-2], "--unet_lr", lr])
    assert code == 2 and "--unet_lr" in one_error_line(err)


def test_an_output_folder_that_cannot_be_written_is_refused(tiny_dir, dataset, tmp_path, monkeypatch, capsys):
    no_model_load(monkeypatch)
    (tmp_path / "file").write_text("keep me")
    code, _, err = cli(monkeypatch, capsys, args_for(tiny_dir / "sd1", dataset, tmp_path / "file"))
    assert code == 2 and "is a file, not a folder" in one_error_line(err)
    code, _, err = cli(monkeypatch, capsys, args_for(tiny_dir / "sd1", dataset, tmp_path / "file" / "sub"))
    assert code == 2 and "is a file, so the folder cannot be created" in one_error_line(err)
    assert (tmp_path / "file").read_text() == "keep me"

    def read_only(*a, **kw):  # what a read-only folder does (the tests may run as root, who can write anyway)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("library.run.run_files.tempfile.TemporaryFile", read_only)
    code, _, err = cli(monkeypatch, capsys, args_for(tiny_dir / "sd1", dataset, tmp_path / "ro"))
    assert code == 2 and "cannot write in" in one_error_line(err) and "Permission denied" in err


def test_network_weights_missing_a_tensor_names_the_file_and_module(finished, tmp_path, monkeypatch, capsys):
    out, argv, _ = finished
    tensors, meta = load_state_dict(out / "t.safetensors")
    key = sorted(k for k in tensors if k.endswith("lora_up.weight"))[0]
    del tensors[key]
    broken = save_state_dict(tensors, tmp_path / "broken.safetensors", metadata=meta)
    code, _, err = cli(monkeypatch, capsys, [*argv, "--output_dir", str(tmp_path / "o"), "--network_weights",
                                             str(broken)])  # fmt: skip
    module = key.split(".")[0]
    assert code == 2 and str(broken) in one_error_line(err) and module in err and "lora_up.weight" in err


# ------------------------------------------------------------------------------------------ failing during training
def test_a_full_disk_while_saving_names_the_file_and_leaves_a_resumable_state(tiny_dir, dataset, tmp_path,
                                                                              monkeypatch, capsys):  # fmt: skip
    """safetensors' own exception, as a real full disk makes it (not an OSError), raised under its real save_file."""
    import safetensors
    import safetensors.torch

    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "a", "--save_every_n_steps", "2", steps=6)
    full = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "full", "--save_every_n_steps", "2", steps=6))
    real = safetensors.torch.serialize_file  # the writer under safetensors.torch.save_file

    def disk_full_at_step_4(tensors, filename, metadata=None):
        if ".t-step00000004.safetensors" in str(filename):  # the temporary file of the step-4 save
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )  # safetensors 0.8's text on a full tmpfs (test_a_full_filesystem_is_a_save_error shows the real one)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "serialize_file", disk_full_at_step_4)
    code, stdout, err = cli(monkeypatch, capsys, argv)
    assert code == 1 and "Traceback" not in err
    assert f"error: {tmp_path / 'a' / 't-step00000004.safetensors'} could not be written (No space left" in err
    assert "the files saved before it are intact" in err
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["t-step00000002.safetensors", "t-step00000004-state"]  # no temporary file left behind
    a, b = load_state_dict(tmp_path / "a" / names[0])[0], load_state_dict(tmp_path / "full" / names[0])[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
    monkeypatch.undo()
    resumed = train("sd1", *argv, "--resume", str(tmp_path / "a" / "t-step00000004-state"))
    assert resumed.losses == full.losses
    a, b = load_state_dict(resumed.output)[0], load_state_dict(full.output)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_state_save_is_named_too(tiny_dir, dataset, tmp_path, monkeypatch, capsys):
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "a", "--save_every_n_steps", "2", "--save_state", steps=3)
    real = torch.save

    def disk_full(obj, f, *a, **kw):
        if "optimizer.pt" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr("library.run.run_files.torch.save", disk_full)
    code, _, err = cli(monkeypatch, capsys, argv)
    assert code == 1 and "optimizer.pt could not be written" in one_error_line(err)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["t-step00000002.safetensors"]  # no .partial


def test_ctrl_c_twice_while_a_state_is_written_leaves_no_partial_state(tiny_dir, dataset, tmp_path, monkeypatch,
                                                                       capsys, caplog):  # fmt: skip
    """The second Ctrl-C lands while the step-4 state is written: the run quits (130) without a `*-state.partial`
    folder. One left by a killed process is never resumed from, not even when named, and the next run in that
    output folder removes it."""
    import shutil

    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "a", "--save_every_n_steps", "2", "--save_state", steps=5)
    real = torch.save

    def second_ctrl_c(obj, f, *a, **kw):  # what train_step.Interrupt raises on a second Ctrl-C
        if "t-step00000004-state.partial" in str(f):
            raise KeyboardInterrupt
        return real(obj, f, *a, **kw)

    monkeypatch.setattr("library.run.run_files.torch.save", second_ctrl_c)
    code, _, err = cli(monkeypatch, capsys, argv)
    assert code == 130 and "Traceback" not in err
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["t-step00000002-state", "t-step00000002.safetensors", "t-step00000004.safetensors"]
    monkeypatch.undo()

    partial = tmp_path / "a" / "t-step00000004-state.partial"  # as a killed process leaves it: complete, newest
    shutil.copytree(tmp_path / "a" / "t-step00000002-state", partial)
    no_model_load(monkeypatch)
    code, _, err = cli(monkeypatch, capsys, [*argv, "--resume", str(partial)])
    assert code == 2 and f"--resume {partial}: an unfinished state" in one_error_line(err)
    monkeypatch.undo()
    with caplog.at_level("INFO", logger="sdtrain"):
        resumed = train("sd1", *argv, "--resume", str(tmp_path / "a"))
    assert f"resumed from {tmp_path / 'a' / 't-step00000002-state'} (the newest state" in caplog.text
    assert f"removed {partial}" in caplog.text and not partial.exists() and resumed.steps == 5


# ------------------------------------------------------------------------------------------ TensorBoard run folders
def test_each_run_logs_to_its_own_folder_and_a_resumed_run_continues_it(tiny_dir, dataset, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    stamps = iter(["20260101000000", "20260101000001", "20260101000002"])
    monkeypatch.setattr("library.run.trackers._timestamp", lambda: next(stamps))
    logs = tmp_path / "logs"
    common = ["--logging_dir", str(logs), "--log_prefix", "p-", "--save_every_n_steps", "2", "--save_state"]
    train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "a", *common, steps=4))
    train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "b", *common, steps=2))
    state = tmp_path / "a" / "t-step00000002-state"
    train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "c", *common, "--resume", str(state), steps=4))
    assert sorted(p.name for p in logs.iterdir()) == ["p-20260101000000", "p-20260101000001"]
    events = EventAccumulator(str(logs / "p-20260101000000" / "network_train"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss/current")] == [1, 2, 3, 4]  # steps 3, 4 drawn once, not twice


def test_an_interrupt_at_the_last_step_finishes_the_run(tiny_dir, dataset, tmp_path, monkeypatch):
    """Ctrl-C during the last step: the run is complete, so it writes its final file (a state at the last step
    would leave nothing to resume)."""
    import os
    import signal

    original = loop.Trainer.step_done

    def step_done(self, loss):
        original(self, loss)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loop.Trainer, "step_done", step_done)
    result = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path, steps=3))
    assert not result.interrupted and result.steps == 3 and result.output == tmp_path / "t.safetensors"
    assert result.output.is_file()


def test_a_failed_final_save_resumes_to_just_the_final_file(tiny_dir, dataset, tmp_path, monkeypatch, capsys):
    """The disk fills up at the very end: the state written then is at the step budget, and resuming it writes
    only the missing final file (no step is trained twice), equal to the uninterrupted run's."""
    import safetensors.torch

    full = train("sd1", *args_for(tiny_dir / "sd1", dataset, tmp_path / "full", steps=3))
    argv = args_for(tiny_dir / "sd1", dataset, tmp_path / "a", steps=3)
    real = safetensors.torch.save_file

    def disk_full_at_the_end(tensors, filename, metadata=None):
        if ".t.safetensors." in str(filename):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full_at_the_end)
    code, _, err = cli(monkeypatch, capsys, argv)
    assert code == 1 and "t.safetensors could not be written" in one_error_line(err)
    monkeypatch.undo()
    code, stdout, _ = cli(monkeypatch, capsys, [*argv, "--resume", str(tmp_path / "a" / "t-step00000003-state")])
    assert code == 0 and "t.safetensors is missing, so only it is written" in stdout
    a, b = load_state_dict(tmp_path / "a" / "t.safetensors")[0], load_state_dict(full.output)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_state_of_another_family_names_both(finished, tiny_dir, tmp_path, monkeypatch, capsys):
    """The state records the family it was trained on: resuming it on another family's model says which, not "the
    network settings differ" with a raw load_state_dict error."""
    out, argv, _ = finished
    argv = [*argv]
    argv[argv.index("--pretrained_model_name_or_path") + 1] = str(tiny_dir / "sd2")
    code, _, err = cli(monkeypatch, capsys, [*argv, "--output_dir", str(tmp_path / "o"), "--max_train_steps", "5",
                                             "--resume", str(out / "t-step00000002-state")])  # fmt: skip
    line = one_error_line(err)
    assert code == 2 and "trained on a sd1 model, this run loads a sd2 model" in line and "does not fit" not in line
