"""What the dataset-preparation scripts share: finding images, loading them in batches, writing caption files.

finetune/make_captions.py (BLIP), finetune/make_captions_by_git.py (GIT), finetune/tag_images_by_wd14_tagger.py
(WD14 ONNX taggers) and tools/detect_face_rotate.py walk a folder of images (``find_images``: the types training
reads, sorted, sub-folders with ``--recursive``), load them with ``--max_data_loader_n_workers`` processes (a torch
DataLoader, as sd-scripts), and write ``<image stem><caption_extension>`` next to each image, atomically (a text
file is written to a hidden ``.partial`` name, then renamed). An image that cannot be decoded is reported by name
and left out; the scripts list every such file at the end.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from library.data.metadata_json import find_images

logger = logging.getLogger("sdtrain")

__all__ = [
    "MissingPackage",
    "caption_file",
    "check_extension",
    "find_images",
    "image_batches",
    "images_or_error",
    "require",
    "write_text_atomic",
]


class MissingPackage(ValueError):
    """An optional package a script needs is not installed (printed as one ``error:`` line, exit status 2)."""


def require(module: str, extra: str, what: str) -> Any:
    """``import module``, or a ``MissingPackage`` that names the pip extra to install (``sdtrain[extra]``)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingPackage(
            f"{what} needs the package `{module.split('.')[0]}` ({e}); install it with: "
            f'pip install "sdtrain[{extra}]" (or, in a clone: pip install -c constraints.txt -e ".[{extra}]")'
        ) from None


def check_extension(extension: str, flag: str = "--caption_extension") -> str:
    """A caption extension such as ``.txt``; one without its leading dot is an error naming the flag."""
    if not extension.startswith(".") or len(extension) < 2 or "/" in extension or os.sep in extension:
        raise ValueError(f"{flag} {extension!r}: expected a file extension with its dot, e.g. .txt or .caption")
    return extension


def caption_file(image: str | os.PathLike, extension: str) -> Path:
    """The caption file of ``image``: its path with the image's suffix replaced (``a/b.png`` -> ``a/b.txt``)."""
    return Path(os.path.splitext(image)[0] + extension)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path``: first a hidden ``.partial`` file beside it, then a rename, so that an
    interrupted run never leaves half a caption."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


class _Loaded(torch.utils.data.Dataset):
    """``(path, load(path) or None, error text or None)`` per image, so that one bad file does not stop a run."""

    def __init__(self, paths: Sequence[Path], load: Callable[[Path], Any]):
        self.paths, self.load = list(paths), load

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Path, Any, str | None]:
        path = self.paths[index]
        try:
            return path, self.load(path), None
        except (OSError, ValueError) as e:
            return path, None, str(e)


def _as_is(item: Any) -> Any:
    return item


def image_batches(
    paths: Sequence[Path],
    load: Callable[[Path], Any],
    batch_size: int,
    workers: int | None = None,
    failed: list[str] | None = None,
    desc: str = "images",
) -> Iterator[list[tuple[Path, Any]]]:
    """Batches of ``(path, load(path))`` in order, ``batch_size`` each (the last one shorter), with a tqdm bar over
    the images. ``workers`` (``--max_data_loader_n_workers``) loads in that many processes (``load`` must then be
    picklable: a module-level function or a ``functools.partial`` of one); None loads here. Images that cannot be
    loaded are logged by name, appended to ``failed`` as ``"path: reason"`` and left out of the batches."""
    if batch_size < 1:
        raise ValueError(f"--batch_size {batch_size}: must be at least 1")
    if workers is not None and workers < 0:
        raise ValueError(f"--max_data_loader_n_workers {workers}: must be 0 or more")
    dataset = _Loaded(paths, load)
    if workers:
        items: Any = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            shuffle=False,
            num_workers=workers,
            collate_fn=_as_is,
            generator=torch.Generator(),  # its own: the workers' seeds must not draw from the global RNG
        )
    else:
        items = (dataset[i] for i in range(len(dataset)))
    batch: list[tuple[Path, Any]] = []
    for path, value, error in tqdm(items, total=len(dataset), desc=desc, unit="img", smoothing=0.0):
        if error is not None:
            logger.error("%s: cannot load image (%s); left out", path, error)
            if failed is not None:
                failed.append(f"{path}: {error}")
            continue
        batch.append((path, value))
        if len(batch) >= batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def images_or_error(folder: str | os.PathLike, recursive: bool) -> list[Path]:
    """``find_images`` with a clear error for a folder that holds no image (names the folder and ``--recursive``)."""
    images = find_images(folder, recursive)
    if not images:
        hint = "" if recursive else "; add --recursive to search its sub-folders"
        raise ValueError(f"{folder}: no images (.png .jpg .jpeg .webp .bmp) found{hint}")
    return images


def default_device() -> torch.device:
    """The device the captioners run on: the first CUDA GPU when there is one, else the CPU (as sd-scripts)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_transformers_captioner(model_class: Any, source: str, flag: str, model_type: str, how_to_get: str):
    """``(model, processor)`` of a transformers image-to-text model (``model_class``, e.g.
    ``BlipForConditionalGeneration``) from ``source``: a local folder saved with ``save_pretrained`` (config.json,
    the weights and the processor / tokenizer files) or a Hugging Face model id, which transformers downloads into
    its cache (``HF_HUB_OFFLINE=1`` forbids that). A single weights file or a URL, a folder without config.json, a
    model of another type or an id that cannot be loaded are errors naming ``flag`` and saying what to get
    (``how_to_get``). The processor uses PIL (transformers falls back to it without torchvision)."""
    from transformers import AutoConfig, AutoProcessor

    path = Path(source)
    if "://" in source or path.suffix in (".pth", ".pt", ".ckpt", ".bin", ".safetensors"):
        raise ValueError(f"{flag} {source}: a single weights file or URL cannot be loaded; {how_to_get}")
    if path.exists() and not (path / "config.json").is_file():
        raise ValueError(f"{flag} {source}: no config.json in this folder; {how_to_get}")
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {source}: cannot load the model ({e}); {how_to_get}") from None
    if config.model_type != model_type:
        raise ValueError(f"{flag} {source}: a {config.model_type!r} model, expected {model_type!r}; {how_to_get}")
    try:
        processor = AutoProcessor.from_pretrained(source)
        model = model_class.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {source}: cannot load the model or its processor ({e}); {how_to_get}") from None
    return model.eval(), processor
