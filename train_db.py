"""DreamBooth for SD 1.x / 2.x: fine-tune the whole model on instance images, with class (regularisation) images
weighted by ``--prior_loss_weight`` (prior preservation). fine_tune.py's recipe with train_db.py's flags: the text
encoder trains by default until ``--stop_text_encoder_training`` (-1: never), at ``--learning_rate_te``.

accelerate launch train_db.py --pretrained_model_name_or_path model.safetensors --train_data_dir instance \
    --reg_data_dir class --prior_loss_weight 1.0 --output_dir out ...
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("sd1", "sd2")
FLAG_SETS = ("dreambooth",)  # --stop_text_encoder_training, --no_token_padding (+ the family's --learning_rate_te)


def build_parser() -> argparse.ArgumentParser:
    """fine_tune.py's groups with train_db.py's flag sets."""
    return fine_tune.build_parser(FAMILIES, FLAG_SETS, __doc__)


run = functools.partial(fine_tune.run, family_names=FAMILIES, parser=build_parser, training="dreambooth")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
