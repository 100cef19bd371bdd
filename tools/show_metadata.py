"""Print a model or adapter file's metadata as sorted, indented JSON (sd-scripts' tools/show_metadata.py).

    python tools/show_metadata.py --model lora.safetensors [--parse_json]

safetensors files: the ``__metadata__`` header (read without loading the tensors); .ckpt files: the plain values
stored next to the state dict. ``--parse_json`` expands values that hold JSON (ss_tag_frequency, ss_datasets...).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.files.weights import PICKLE_SUFFIXES, load_state_dict, read_metadata


def read(path: str | Path) -> dict[str, str]:
    """The file's metadata; ``FileNotFoundError`` / ``ValueError`` naming the file when it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--model {path}: no such file")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return load_state_dict(path)[1]
    if path.suffix.lower() != ".safetensors":
        raise ValueError(f"--model {path}: expected a .safetensors file (or a .ckpt checkpoint)")
    try:
        return read_metadata(path)
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"--model {path}: not a valid safetensors file ({e})") from e


def expand(metadata: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in metadata.items():
        try:
            parsed = json.loads(v)
            out[k] = parsed if isinstance(parsed, (dict, list)) else v
        except (json.JSONDecodeError, TypeError):
            out[k] = v
    return out


def run(argv: Sequence[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a .safetensors file (or .ckpt)")
    parser.add_argument("--parse_json", action="store_true", help="show JSON-valued entries as JSON")
    args = parser.parse_args(argv)
    metadata = read(args.model)
    if not metadata:
        print(f"{args.model}: no metadata found", file=sys.stderr)
        return False
    print(json.dumps(expand(metadata) if args.parse_json else metadata, indent=4, sort_keys=True, ensure_ascii=False))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
