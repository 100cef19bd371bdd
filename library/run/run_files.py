"""The files a run writes: names, when to save, rotation, and the resumable state folders.

File names follow sd-scripts: ``<name>-<epoch:06d>.<ext>`` every N epochs (not at the last epoch),
``<name>-step<step:08d>.<ext>`` every N steps, ``<name>.<ext>`` at the end; without ``--output_name`` the stems are
``epoch`` / ``at`` / ``last``. State folders add ``-state``. ``--save_last_n_epochs`` / ``--save_last_n_steps`` (and
their ``_state`` variants) remove older files after each save.

A state folder holds everything needed to continue exactly: trained weights, optimizer, LR scheduler, EMA, grad
scaler, every random generator (per process) and the counters (epoch, step, batches consumed). Pickles are read
back with ``weights_only=True``; the folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from library.cli.parse import add_unsupported
from library.cli.problems import ConfigError
from library.files.weights import is_write_failure, load_state_dict, read_metadata, save_error, save_state_dict
from library.run.resume import REQUIRED_FILES, budget_left, find_state, read_counters

EXTENSIONS = {"safetensors": ".safetensors", "ckpt": ".ckpt", "pt": ".pt"}
# --metadata_<name> flags, written as modelspec.<name>
METADATA_NAMES = (
    "title",
    "author",
    "description",
    "license",
    "tags",
    "usage_hint",
    "thumbnail",
    "merged_from",
    "trigger_phrase",
    "preprocessor",
    "is_negative_embedding",
)
PRECISIONS = {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_save_args(parser: argparse.ArgumentParser, default_format: str | None = "safetensors") -> None:
    g = parser.add_argument_group("saving")
    g.add_argument("--output_dir", type=str, default=None, help="folder for the trained files")
    g.add_argument("--output_name", type=str, default=None, help="file stem of the trained files")
    g.add_argument(
        "--save_model_as",
        type=str,
        default=default_format,
        choices=[None, "ckpt", "pt", "safetensors", "diffusers", "diffusers_safetensors"],
    )
    g.add_argument("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"])
    g.add_argument("--save_every_n_epochs", type=int, default=None)
    g.add_argument("--save_every_n_steps", type=int, default=None)
    g.add_argument("--save_n_epoch_ratio", type=int, default=None, help="save at least N files over the run")
    g.add_argument("--save_last_n_epochs", type=int, default=None, help="keep only the last N epoch files")
    g.add_argument("--save_last_n_steps", type=int, default=None, help="keep only files of the last N steps")
    g.add_argument("--no_metadata", action="store_true", help="write only the minimal metadata")
    g.add_argument("--training_comment", type=str, default=None, help="stored as ss_training_comment")
    reason = "upload the files yourself, e.g. with `huggingface-cli upload`"
    for flag in (
        "--huggingface_repo_id",
        "--huggingface_repo_type",
        "--huggingface_path_in_repo",
        "--huggingface_token",
        "--huggingface_repo_visibility",
    ):
        add_unsupported(g, flag, reason, type=str, default=None)
    add_unsupported(g, "--async_upload", reason, action="store_true")
    m = parser.add_argument_group("metadata")
    for name in METADATA_NAMES:
        m.add_argument(f"--metadata_{name}", type=str, default=None, help=f"modelspec.{name}")


def add_state_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("state")
    g.add_argument("--save_state", action="store_true", help="also save a resumable state with every model file")
    g.add_argument("--save_state_on_train_end", action="store_true", help="save a resumable state at the end")
    g.add_argument("--save_last_n_epochs_state", type=int, default=None)
    g.add_argument("--save_last_n_steps_state", type=int, default=None)
    g.add_argument("--resume", type=str, default=None, help="state folder to resume from")
    reason = "download the state folder and pass it to --resume"
    add_unsupported(g, "--save_state_to_huggingface", reason, action="store_true")
    add_unsupported(g, "--resume_from_huggingface", reason, action="store_true")
    reason = "use --resume <state folder>: it restores the exact position, scheduler and RNG"
    add_unsupported(g, "--initial_epoch", reason, type=int, default=None)
    add_unsupported(g, "--initial_step", reason, type=int, default=None)
    add_unsupported(g, "--skip_until_initial_step", reason, action="store_true")


@dataclass(frozen=True)
class SaveConfig:
    output_dir: str
    output_name: str | None = None
    save_model_as: str = "safetensors"
    save_precision: str | None = None
    save_every_n_epochs: int | None = None
    save_every_n_steps: int | None = None
    save_n_epoch_ratio: int | None = None
    save_last_n_epochs: int | None = None
    save_last_n_steps: int | None = None
    save_state: bool = False
    save_state_on_train_end: bool = False
    save_last_n_epochs_state: int | None = None
    save_last_n_steps_state: int | None = None
    resume: str | None = None  # the state folder a run continues from (the newest one under --resume's folder)
    resume_given: str | None = None  # --resume as the user gave it
    no_metadata: bool = False
    training_comment: str | None = None
    metadata: dict = field(default_factory=dict)  # --metadata_* values by name

    @classmethod
    def from_args(cls, args: argparse.Namespace, allowed_formats: tuple[str, ...] = ("safetensors", "ckpt", "pt")):
        problems = []
        if not args.output_dir:
            problems.append("--output_dir is required: the folder where trained files are written")
        fmt = args.save_model_as or allowed_formats[0]
        if fmt not in allowed_formats:
            problems.append(f"--save_model_as {fmt} is not possible here; choose one of {', '.join(allowed_formats)}")
        for name in ("save_every_n_epochs", "save_every_n_steps", "save_n_epoch_ratio", "save_last_n_epochs"):
            value = getattr(args, name)
            if value is not None and value < 1:
                problems.append(f"--{name} must be >= 1, got {value}")
        resume = None
        if args.resume:
            try:
                resume = str(find_state(args.resume))
                read_counters(Path(resume))
                check_train_state(Path(resume))
            except ValueError as e:
                problems.append(str(e))
        if args.output_dir:
            problems += output_dir_problems(Path(args.output_dir))
        if problems:
            raise ConfigError(problems)
        return cls(
            output_dir=args.output_dir,
            output_name=args.output_name,
            save_model_as=fmt,
            save_precision=args.save_precision,
            save_every_n_epochs=args.save_every_n_epochs,
            save_every_n_steps=args.save_every_n_steps,
            save_n_epoch_ratio=args.save_n_epoch_ratio,
            save_last_n_epochs=args.save_last_n_epochs,
            save_last_n_steps=args.save_last_n_steps,
            save_state=args.save_state,
            save_state_on_train_end=args.save_state_on_train_end,
            save_last_n_epochs_state=args.save_last_n_epochs_state,
            save_last_n_steps_state=args.save_last_n_steps_state,
            resume=resume,
            resume_given=args.resume,
            no_metadata=args.no_metadata,
            training_comment=args.training_comment,
            metadata={
                n: getattr(args, f"metadata_{n}") for n in METADATA_NAMES if getattr(args, f"metadata_{n}", None)
            },
        )

    @property
    def dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.save_precision]

    @property
    def extension(self) -> str:
        return EXTENSIONS.get(self.save_model_as, "")

    def every_n_epochs(self, num_epochs: int) -> int | None:
        if self.save_n_epoch_ratio:
            return max(1, num_epochs // self.save_n_epoch_ratio)
        return self.save_every_n_epochs


def output_dir_problems(folder: Path) -> list[str]:
    """``--output_dir`` must be a folder that exists or can be created, and that can be written: checked by writing
    (and removing) a temporary file in it, or in its nearest existing parent, before any model loads."""
    if folder.exists() and not folder.is_dir():
        return [f"--output_dir {folder}: this is a file, not a folder; give a folder for the trained files"]
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [f"--output_dir {folder}: {existing} is a file, so the folder cannot be created there"]
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        where = "it" if existing == folder else f"{existing}, where it would be created"
        return [f"--output_dir {folder}: cannot write in {where} ({e.strerror or e}); choose a folder you can write to"]
    return []


def stem(cfg: SaveConfig, *, epoch: int | None = None, step: int | None = None) -> str:
    """File stem for an epoch save, a step save, or (neither) the final save."""
    if epoch is not None:
        return f"{cfg.output_name or 'epoch'}-{epoch:06d}"
    if step is not None:
        return f"{cfg.output_name or 'at'}-step{step:08d}"
    return cfg.output_name or "last"


def model_file(cfg: SaveConfig, **when: int | None) -> Path:
    return Path(cfg.output_dir) / (stem(cfg, **when) + cfg.extension)


def state_dir(cfg: SaveConfig, **when: int | None) -> Path:
    return Path(cfg.output_dir) / (stem(cfg, **when) + "-state")


def save_epoch_now(cfg: SaveConfig, epoch: int, num_epochs: int) -> bool:
    every = cfg.every_n_epochs(num_epochs)
    return bool(every) and epoch % every == 0 and epoch < num_epochs


def save_step_now(cfg: SaveConfig, step: int, max_steps: int) -> bool:
    return bool(cfg.save_every_n_steps) and step % cfg.save_every_n_steps == 0 and step < max_steps


def embeddings_dir(model: Path) -> Path:
    """Pivotal tuning's folder of token embeddings that belong to the adapter file ``model``: ``<stem>_embeddings``."""
    return model.with_name(f"{model.stem}_embeddings")


def companion_files(model: Path) -> list[Path]:
    """Files a recipe writes next to the model file ``model`` and that belong to it: ``<stem>_<part><suffix>``
    (sd3_train.py's trained text encoders, ``<stem>_clip_l.safetensors``); removed with it."""
    return sorted(p for p in model.parent.glob(f"{glob.escape(model.stem)}_*{model.suffix}") if p.is_file())


def rotate(cfg: SaveConfig, *, epoch: int | None = None, step: int | None = None, num_epochs: int = 0) -> list[Path]:
    """Remove files (with their embeddings folders and companion files) and state folders older than --save_last_n_epochs /
    --save_last_n_steps allow."""
    removed = []
    for is_state in (False, True):
        if epoch is not None:
            keep = (cfg.save_last_n_epochs_state if is_state else None) or cfg.save_last_n_epochs
            every = cfg.every_n_epochs(num_epochs) or 1
            limit = epoch - every * keep if keep else None
            pattern = re.escape(stem(cfg, epoch=0)[:-6]) + r"(\d{6})"
        else:
            keep = (cfg.save_last_n_steps_state if is_state else None) or cfg.save_last_n_steps
            limit = step - keep - 1 if keep else None
            pattern = re.escape(stem(cfg, step=0)[:-8]) + r"(\d{8})"
        if limit is None or limit < 1:
            continue
        suffix = re.escape("-state" if is_state else cfg.extension)
        regex = re.compile(f"^{pattern}{suffix}$")
        for path in Path(cfg.output_dir).glob("*"):
            match = regex.match(path.name)
            if match and int(match.group(1)) <= limit:
                companion = [] if is_state else [embeddings_dir(path), *companion_files(path)]
                for old in [path, *(c for c in companion if c.exists())]:
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
                    removed.append(old)
    return removed


def save_train_state(
    folder: str | os.PathLike,
    *,
    trained: dict[str, torch.Tensor],
    optimizer: Any,
    scheduler: Any,
    counters: dict,
    rngs: list[dict[str, Any]],
    ema: Any = None,
    scaler: Any = None,
) -> Path:
    """Write a resumable state folder (main process only; ``rngs`` holds every process's RNG states, by rank)."""
    folder = Path(folder)
    work = folder.with_name(folder.name + ".partial")
    current = work
    try:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        save_state_dict(trained, work / "trained.safetensors")
        for name, obj in (("optimizer.pt", optimizer), ("scheduler.pt", scheduler), ("scaler.pt", scaler)):
            if obj is not None:
                current = work / name
                torch.save(obj.state_dict(), current)
        if ema is not None:
            save_state_dict(ema.state_dict(), work / "ema.safetensors")
        for rank, rng in enumerate(rngs):
            current = work / f"rng_{rank}.pt"
            torch.save(rng, current)
        current = work / "train_state.json"
        current.write_text(json.dumps(counters, indent=2))
        current = folder
        _replace_dir(work, folder)
    except BaseException as e:  # also a second Ctrl-C (KeyboardInterrupt): never leave a partial state behind
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(e, Exception) and is_write_failure(e):
            raise save_error(current, e) from e
        raise
    return folder


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename the folder ``src`` onto ``dst``; an existing ``dst`` is put back if the rename is cut short."""
    old = None
    try:
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=dst.name + ".old", dir=dst.parent))
            os.replace(dst, old / "x")
        os.replace(src, dst)
    except BaseException:
        if old is not None and (old / "x").exists() and not dst.exists():
            os.replace(old / "x", dst)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def unfinished_states(cfg: SaveConfig) -> list[Path]:
    """This run's ``*-state.partial`` folders in ``--output_dir``: states whose writing was cut short (a process
    killed while saving). They are never resumed from; a new run removes them."""
    final, step, epoch = stem(cfg), stem(cfg, step=0)[:-8], stem(cfg, epoch=0)[:-6]
    names = rf"{re.escape(final)}|{re.escape(step)}\d{{8}}|{re.escape(epoch)}\d{{6}}"
    regex = re.compile(rf"^(?:{names})-state\.partial$")
    folder = Path(cfg.output_dir)
    return sorted(p for p in folder.iterdir() if p.is_dir() and regex.match(p.name)) if folder.is_dir() else []


def load_train_state(folder: str | os.PathLike, rank: int = 0) -> dict[str, Any]:
    """Read a state folder; tensors and pickles are loaded safely (weights_only=True). A file that is missing,
    truncated or unreadable, or a pickle that weights_only refuses, raises one ``ValueError`` naming that file."""
    folder = Path(folder)
    state: dict[str, Any] = {
        "counters": read_counters(folder, training=False),
        "trained": _read_state_file(folder / "trained.safetensors"),
        "optimizer": _read_state_file(folder / "optimizer.pt"),
        "scheduler": _read_state_file(folder / "scheduler.pt"),
    }
    for key, name in (("ema", "ema.safetensors"), ("scaler", "scaler.pt")):
        if (folder / name).exists():
            state[key] = _read_state_file(folder / name)
    rng_file = folder / f"rng_{rank}.pt"
    state["rng"] = _read_state_file(rng_file) if rng_file.exists() else None
    return state


def check_train_state(folder: Path) -> None:
    """Open every file of a state folder without loading its tensors (safetensors headers, pickles memory-mapped):
    a truncated or unreadable file, or a pickle that weights_only refuses, raises ``ValueError`` naming it, before
    any model loads."""
    read_counters(folder, training=False)
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{', '.join(str(folder / n) for n in missing)}: missing from the state (it was not "
                         "written completely); resume from another state folder")  # fmt: skip
    for path in sorted(folder.iterdir()):
        if path.suffix in (".safetensors", ".pt"):
            _read_state_file(path, peek=True)


def _read_state_file(path: Path, *, peek: bool = False) -> Any:
    """One file of a state folder (``.safetensors``: its tensors; ``.pt``: the pickled object, weights_only).
    ``peek``: only open it (safetensors: the header; pickles: memory-mapped) to find damage early."""
    if path.suffix == ".safetensors":
        try:
            if peek:
                return read_metadata(path)
            return load_state_dict(path)[0]
        except Exception as e:  # safetensors raises its own error types for damaged headers
            detail = str(e).removeprefix(f"{path}: ")
            raise ValueError(f"{path}: this file of the state cannot be read ({detail}); the state is damaged, "
                             "resume from another state folder") from e  # fmt: skip
    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=peek)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: this file of the state holds objects that torch.load(weights_only=True) refuses "
                         f"({str(e).splitlines()[0]}); it was not written by this trainer, so it was not loaded; "
                         "resume from another state folder") from e  # fmt: skip
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"{path}: this file of the state cannot be read ({type(e).__name__}: {e}); it is truncated "
                         "or damaged, resume from another state folder") from e  # fmt: skip


def nothing_left(save: Any, run: Any) -> bool:
    """``--resume`` of a state that already reached the step budget: print why nothing will be trained or written,
    and return True (the entry script then exits 0 before any model loads). When the run's final file is missing
    (its save failed, e.g. on a full disk, and left this state), say that it will be written, and return False:
    the loop then trains nothing and only the final file is saved."""
    if not save.resume:
        return False
    reason = budget_left(read_counters(Path(save.resume)), run.max_train_steps, run.max_train_epochs)
    if reason is None:
        return False
    from library.cli.console import is_main_process

    final = model_file(save)
    if is_main_process():
        if final.exists():
            print(f"--resume {save.resume}: {reason}; nothing left to train, no file was written (raise the limit "
                  "to train further)")  # fmt: skip
        else:
            print(f"--resume {save.resume}: {reason}; {final} is missing, so only it is written from the state")
    return final.exists()
