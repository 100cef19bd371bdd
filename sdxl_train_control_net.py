"""Train a ControlNet for SDXL (sd-scripts' ``sdxl_train_control_net.py``, same flags).

    accelerate launch sdxl_train_control_net.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors \
        --train_data_dir images --conditioning_data_dir conditioning --resolution 1024 --output_dir out \
        --learning_rate 1e-5 --control_net_lr 1e-4 --max_train_steps 10000 --mixed_precision bf16

train_control_net.py's recipe on SDXL: the ControlNet copies the UNet's encoder half (with its size / text-time
embedding); ``--control_net_lr`` is the learning rate of the ControlNet's own modules (conditioning embedding, zero
convolutions), ``--learning_rate`` that of the copied encoder, as sd-scripts. The file has the key names sd-scripts'
SDXL trainer writes (diffusers' ``ControlNetModel`` names): diffusers' ``ControlNetModel.from_single_file`` (and
``load_state_dict``), ComfyUI and ``gen_img.py --control_net_models`` read it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import train_control_net
from library.cli import deferred_imports
from library.cli.main_guard import main_guard

FAMILIES = ("sdxl",)


def build_parser() -> argparse.ArgumentParser:
    """train_control_net.py's groups for SDXL, with ``--control_net_lr``."""
    return train_control_net.build_parser(FAMILIES, zero_conv_lr=True, doc=__doc__)


def run(argv: Sequence[str] | None = None):
    """Train an SDXL ControlNet (train_control_net.run with this script's flags and sd-scripts' SDXL key names)."""
    return train_control_net.run(argv, FAMILIES, file_keys="diffusers", parser=build_parser())


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
