"""When and where trained files are saved; resumable training state.

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
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from library.checkpoints import load_state_dict, save_state_dict

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
    resume: str | None = None
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
        if args.resume and not Path(args.resume, "train_state.json").is_file():
            problems.append(f"--resume {args.resume}: not a state folder written by --save_state (no train_state.json)")
        if problems:
            from library.config import ConfigError

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
            resume=args.resume,
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


def rotate(cfg: SaveConfig, *, epoch: int | None = None, step: int | None = None, num_epochs: int = 0) -> list[Path]:
    """Remove files (and state folders) older than --save_last_n_epochs / --save_last_n_steps allow."""
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
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                removed.append(path)
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
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    save_state_dict(trained, work / "trained.safetensors")
    torch.save(optimizer.state_dict(), work / "optimizer.pt")
    torch.save(scheduler.state_dict(), work / "scheduler.pt")
    if ema is not None:
        save_state_dict(ema.state_dict(), work / "ema.safetensors")
    if scaler is not None:
        torch.save(scaler.state_dict(), work / "scaler.pt")
    for rank, rng in enumerate(rngs):
        torch.save(rng, work / f"rng_{rank}.pt")
    (work / "train_state.json").write_text(json.dumps(counters, indent=2))
    _replace_dir(work, folder)
    return folder


def _replace_dir(src: Path, dst: Path) -> None:
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=dst.name + ".old", dir=dst.parent))
        os.replace(dst, old / "x")
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old)


def load_train_state(folder: str | os.PathLike, rank: int = 0) -> dict[str, Any]:
    """Read a state folder; tensors and pickles are loaded safely (weights_only=True)."""
    folder = Path(folder)
    state: dict[str, Any] = {
        "counters": json.loads((folder / "train_state.json").read_text()),
        "trained": load_state_dict(folder / "trained.safetensors")[0],
        "optimizer": torch.load(folder / "optimizer.pt", weights_only=True),
        "scheduler": torch.load(folder / "scheduler.pt", weights_only=True),
    }
    if (folder / "ema.safetensors").exists():
        state["ema"] = load_state_dict(folder / "ema.safetensors")[0]
    if (folder / "scaler.pt").exists():
        state["scaler"] = torch.load(folder / "scaler.pt", weights_only=True)
    rng_file = folder / f"rng_{rank}.pt"
    state["rng"] = torch.load(rng_file, weights_only=True) if rng_file.exists() else None
    return state
