"""Where each part of a model comes from, for the families whose users have their parts as separate files (FLUX.1:
the BFL transformer + ``--clip_l --t5xxl --ae``; SD3: the SAI file with or without its encoders + ``--clip_l
--clip_g --t5xxl --vae``).

A part comes from its flag's file (or a diffusers folder given to the flag), else from the model file when it
embeds it (keys under the part's prefix), else from the diffusers pipeline folder's subfolder. :class:`ModelFiles`
checks the flags' paths, says which parts nothing provides (before any weight is read), and loads each part from
where it is with the family's own readers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .loading import META_CONFIGS, WEIGHT_SUFFIXES, KeyView, read_weights

log = logging.getLogger(__name__)

# (path, weights (a lazy mapping), stored configs or None, how messages name the source: the flag or "model file")
FileReader = Callable[[Path, Mapping[str, Any], "Mapping | None", str], nn.Module]
FolderReader = Callable[[Path], nn.Module]  # a diffusers / transformers component folder (with config.json)


@dataclass(frozen=True)
class PartSource:
    """One part a model needs: ``flag`` (sd-scripts' flag that gives its file, e.g. "--clip_l"), ``subfolder`` (its
    folder in a diffusers pipeline folder), ``title`` (for messages: "CLIP-L", "VAE"), ``prefix`` (its key prefix
    inside a model file that may embed it; None: model files never hold it)."""

    flag: str
    subfolder: str
    title: str
    prefix: str | None = None


def stored_configs(metadata: Mapping[str, str]) -> dict | None:
    """The part configs our writer stored in a file (``sdtrain.configs`` metadata), or None."""
    return json.loads(metadata[META_CONFIGS]) if META_CONFIGS in metadata else None


class ModelFiles:
    """The model at ``path`` (a single file or a diffusers folder) and the part files ``given`` (flag -> path or
    None) for the parts ``sources``.

    Every given path must exist (``FileNotFoundError``: "<flag> <path>: <not_found>") and be a weight file or a
    folder. Nothing is read until asked: :attr:`state` is a lazy reader of the model file (its header only).
    """

    def __init__(
        self,
        path: Path,
        sources: Sequence[PartSource],
        given: Mapping[str, str | Path | None],
        *,
        not_found: str = "no such file or folder",
    ) -> None:
        self.path = path
        self.folder = path if path.is_dir() else None
        pipeline = self.folder is not None and (path / "transformer" / "config.json").is_file()
        self.root = path if pipeline else None  # a pipeline folder (transformer/, text_encoder/, vae/ ...)
        self.sources = {source.flag: source for source in sources}
        self.given = {flag: Path(p) for flag, p in given.items() if p is not None}
        for flag, p in self.given.items():
            if not p.exists():
                raise FileNotFoundError(f"{flag} {p}: {not_found}")
            if p.is_file() and p.suffix.lower() not in WEIGHT_SUFFIXES:
                raise ValueError(f"{flag} {p}: unsupported file type {p.suffix!r}; expected .safetensors")
        self._read: tuple[Mapping[str, Any], dict[str, str]] | None = None

    # ------------------------------------------------------------------------------------------- the model file
    def _weights(self) -> tuple[Mapping[str, Any], dict[str, str]]:
        if self._read is None:
            self._read = read_weights(self.path) if self.folder is None else ({}, {})
        return self._read

    @property
    def state(self) -> Mapping[str, Any]:
        """The model file's tensors (a lazy reader for .safetensors); {} for a folder."""
        return self._weights()[0]

    @property
    def metadata(self) -> dict[str, str]:
        return self._weights()[1]

    @property
    def stored(self) -> dict | None:
        """The configs stored in the model file (``sdtrain.configs``), else None."""
        return stored_configs(self.metadata)

    # ------------------------------------------------------------------------------------------- where parts are
    def held(self, flag: str) -> bool:
        """Whether the model itself holds the part: keys under its prefix in the model file, or the pipeline folder's
        subfolder with a ``config.json``."""
        source = self.sources[flag]
        if self.folder is None:
            return source.prefix is not None and any(k.startswith(source.prefix) for k in self.state.keys())
        return self.root is not None and (self.root / source.subfolder / "config.json").is_file()

    def missing(self) -> list[str]:
        """The flags of the parts neither a flag nor the model provides, in the order of ``sources``."""
        return [flag for flag in self.sources if flag not in self.given and not self.held(flag)]

    def require(self, problem: Callable[[list[str]], str]) -> None:
        """``ValueError(problem(missing flags))`` when a part is missing; else logs the parts a flag replaces."""
        missing = self.missing()
        if missing:
            raise ValueError(problem(missing))
        for flag, p in self.given.items():
            if flag in self.sources and self.held(flag):
                log.info("%s %s replaces the part held by %s", flag, p, self.path)

    def embedded(self, flag: str) -> Mapping[str, Any]:
        """A lazy view of the model file's keys under the part's prefix (prefixes kept)."""
        prefix = self.sources[flag].prefix or ""
        return KeyView(self.state, {k: k for k in self.state.keys() if k.startswith(prefix)})

    def scheduler_config(self, released: dict) -> dict:
        """A flow-matching scheduler config: ``released``, updated by the configs stored in the model file and the
        pipeline folder's ``scheduler/scheduler_config.json``; ``prediction_type`` "flow_matching"."""
        config = dict(released)
        stored = self.stored
        if stored is not None and "scheduler" in stored:
            config.update(stored["scheduler"])
        file = self.root / "scheduler" / "scheduler_config.json" if self.root is not None else None
        if file is not None and file.is_file():
            config.update({k: v for k, v in json.loads(file.read_text()).items() if not k.startswith("_")})
        config["prediction_type"] = "flow_matching"
        return config

    # ------------------------------------------------------------------------------------------- loading a part
    def load(self, flag: str, read: FileReader, from_folder: FolderReader) -> nn.Module:
        """The part of ``flag``: its flag's file (``read(path, its weights, its stored configs or the model's,
        flag)``) or folder (the folder itself or its subfolder, ``from_folder``), else the model file's embedded
        part (``read(model path, embedded view, stored configs, "model file")``), else the pipeline folder's
        subfolder."""
        source = self.sources[flag]
        if flag in self.given:
            path = self.given[flag]
            if path.is_dir():
                sub = path / source.subfolder
                folder = sub if (sub / "config.json").is_file() else path
                if not (folder / "config.json").is_file():
                    raise ValueError(f"{flag} {path}: not a diffusers {source.title} folder (no config.json or "
                                     f"{source.subfolder}/config.json)")  # fmt: skip
                return from_folder(folder)
            state, metadata = read_weights(path)
            return read(path, state, stored_configs(metadata) or self.stored, flag)
        if self.folder is None:
            return read(self.path, self.embedded(flag), self.stored, "model file")
        return from_folder(self.root / source.subfolder)
