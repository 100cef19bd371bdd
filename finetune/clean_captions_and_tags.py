"""Clean the captions and tags of a fine-tune metadata JSON (sd-scripts' finetune/clean_captions_and_tags.py).

    python finetune/clean_captions_and_tags.py meta_cap_dd.json meta_clean.json [--debug]

Tags: underscores to spaces, DeepDanbooru ratings cut, per-person tags (hair colour, eyes, hairstyle...) dropped
when an image shows several people and they conflict, ``shirt`` dropped next to ``white shirt``; captions: BLIP's
"anime woman" / "a cartoon drawing" wording normalised (rules: library/data/caption_cleaning.py). The old
three-argument form ``train_data_dir in_json out_json`` still works (the folder is not needed).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.data.caption_cleaning import clean_caption, clean_tags
from library.data.metadata_json import read_metadata_json, write_metadata_json

logger = logging.getLogger("sdtrain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("in_json", type=str, help="metadata file to read")
    parser.add_argument("out_json", type=str, help="metadata file to write")
    parser.add_argument("legacy_out_json", type=str, nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", help="print every change")
    return parser


def run(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    in_json, out_json = args.in_json, args.out_json
    if args.legacy_out_json:  # sd-scripts' old form: train_data_dir in_json out_json
        logger.warning("train_data_dir is no longer needed: give only in_json and out_json")
        in_json, out_json = args.out_json, args.legacy_out_json
    metadata = read_metadata_json(in_json)
    for key, entry in metadata.items():
        for field, clean in (("tags", clean_tags), ("caption", clean_caption)):
            if entry.get(field) is None:
                logger.warning("%s: no %s in the metadata", key, field)
                continue
            before, entry[field] = entry[field], clean(entry[field])
            if args.debug and before != entry[field]:
                print(f"{key} {field}\n  FROM: {before}\n  TO:   {entry[field]}")
    write_metadata_json(metadata, out_json)
    print(f"cleaned {len(metadata)} entries into {out_json}")
    return metadata


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
