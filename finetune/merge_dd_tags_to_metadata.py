"""Put tag files into a fine-tune metadata JSON (sd-scripts' finetune/merge_dd_tags_to_metadata.py).

    python finetune/merge_dd_tags_to_metadata.py train_data_dir meta_cap_dd.json [--in_json meta_cap.json] \
        [--caption_extension .txt] [--full_path] [--recursive]

merge_captions_to_metadata.py's recipe for ``"tags"`` (default extension ``.txt``); training appends the tags to
the caption (``caption, tags``). The WD14 tagger is not shipped: make the tag files with any tagger.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from finetune.merge_captions_to_metadata import run as _merge
from library.cli.main_guard import main_guard

run = functools.partial(_merge, field="tags", default_extension=".txt")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
