"""musubi-tuner's zimage_cache_text_encoder_outputs.py, named so that its documented workflow (cache, then train) runs
refuses with a message that says what to do instead (exit status 2): musubi-tuner's separate caching step is not
done yet. zimage_train_network.py / zimage_train.py encode the latents and Qwen3's outputs inside the
run (before training, the encoders then freed), so the step can be skipped; musubi-tuner's cache files are neither
written nor read here.

For a cache on disk that later runs reuse, add ``--cache_latents_to_disk`` /
``--cache_text_encoder_outputs_to_disk`` (and ``--cache_dir``) to the training command line, or run
tools/cache_latents.py / tools/cache_text_encoder_outputs.py with the training command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError

WHY = ("zimage_cache_text_encoder_outputs.py is not supported yet (musubi-tuner's separate caching step); skip it: "
       "zimage_train_network.py / zimage_train.py cache the latents and Qwen3 outputs inside the run "
       "(add --cache_latents_to_disk / --cache_text_encoder_outputs_to_disk to keep them on disk)")  # fmt: skip


def run(argv: Sequence[str] | None = None) -> None:
    """``--help`` prints the docstring; anything else is refused with :data:`WHY`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_known_args(argv)
    raise ConfigError([WHY])


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: exit status 2 and one ``error:`` line."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
