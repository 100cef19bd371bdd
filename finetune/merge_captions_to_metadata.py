"""Put caption files into a fine-tune metadata JSON (sd-scripts' finetune/merge_captions_to_metadata.py).

    python finetune/merge_captions_to_metadata.py train_data_dir meta_cap.json [--in_json meta.json] \
        [--caption_extension .caption] [--full_path] [--recursive]

For each image in ``train_data_dir``, the text of ``<stem><caption_extension>`` becomes ``"caption"`` under the
image's key (its stem, or full path with ``--full_path``); other fields of ``--in_json`` are kept. Train with
``fine_tune.py --in_json meta_cap.json --train_data_dir train_data_dir``. Write the caption / tag files with
make_captions.py (BLIP), make_captions_by_git.py (GIT), tag_images_by_wd14_tagger.py (WD14) or any captioner first.
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
from library.data.metadata_json import find_images, merge_text_files, read_metadata_json, write_metadata_json

FIELD, DEFAULT_EXTENSION = "caption", ".caption"
logger = logging.getLogger("sdtrain")


def build_parser(field: str = FIELD, default_extension: str = DEFAULT_EXTENSION) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train_data_dir", type=str, help="folder of the training images")
    parser.add_argument("out_json", type=str, help="metadata file to write")
    parser.add_argument("--in_json", type=str, default=None, help="metadata file to read first (fields are kept)")
    parser.add_argument("--caption_extension", type=str, default=default_extension, help=f"extension of {field} files")
    parser.add_argument("--full_path", action="store_true", help="key the images by full path (several folders)")
    parser.add_argument("--recursive", action="store_true", help="also search the sub-folders")
    parser.add_argument("--debug", action="store_true", help="print each image's key and text")
    return parser


def run(argv: Sequence[str] | None = None, field: str = FIELD, default_extension: str = DEFAULT_EXTENSION) -> dict:
    args = build_parser(field, default_extension).parse_args(argv)
    images = find_images(args.train_data_dir, args.recursive)
    metadata = read_metadata_json(args.in_json)
    metadata, missing = merge_text_files(images, metadata, args.caption_extension, field, args.full_path)
    for image in missing:
        logger.warning("%s: no %s file %s; left out", image, field, image.with_suffix(args.caption_extension).name)
    if args.debug:
        for key, entry in metadata.items():
            print(key, entry.get(field))
    write_metadata_json(metadata, args.out_json)
    print(f"{len(images) - len(missing)} {field}s of {len(images)} images written to {args.out_json}")
    return metadata


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
