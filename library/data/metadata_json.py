"""sd-scripts' fine-tune metadata JSON (``--in_json``): ``{image_key: {"caption": ..., "tags": ..., ...}}``.

The key is the image's file stem (found again next to ``--train_data_dir`` with any image extension) or, with
``--full_path``, its full path. finetune/merge_captions_to_metadata.py and merge_dd_tags_to_metadata.py fill
``caption`` / ``tags`` from text files next to the images; training joins them (caption, separator, tags).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from library.cli.problems import ConfigError
from library.data.sources import list_images


def find_images(folder: str | os.PathLike, recursive: bool = False) -> list[Path]:
    """Training images in ``folder`` (and its sub-folders with ``recursive``), sorted; masks are not images."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder of images")
    folders = [folder, *sorted(p for p in folder.rglob("*") if p.is_dir())] if recursive else [folder]
    return [Path(p) for f in folders for p in list_images(str(f))[0]]


def read_metadata_json(path: str | os.PathLike | None) -> dict:
    """An existing metadata file (``{}`` for None); a clear error when it is not a JSON object."""
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--in_json {path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError([f"--in_json {path}: not valid JSON ({e})"]) from e
    if not isinstance(data, dict):
        raise ConfigError([f"--in_json {path}: expected an object {{image_key: {{caption, tags, ...}}}}"])
    return data


def image_key(image: Path, full_path: bool) -> str:
    return str(image) if full_path else image.stem


def merge_text_files(
    images: list[Path], metadata: dict, extension: str, field: str, full_path: bool
) -> tuple[dict, list[Path]]:
    """Put each image's ``<stem><extension>`` text (stripped; lines kept) into ``metadata[key][field]``. Returns
    the metadata and the images without such a file (left out, as sd-scripts does)."""
    missing = []
    for image in images:
        text_file = image.with_suffix(extension)
        if not text_file.is_file():
            missing.append(image)
            continue
        entry = metadata.setdefault(image_key(image, full_path), {})
        entry[field] = text_file.read_text(encoding="utf-8").strip()
    return metadata, missing


def write_metadata_json(metadata: dict, path: str | os.PathLike) -> Path:
    """Write ``metadata`` (indent 2, UTF-8) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(metadata, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
    return path
