"""Convert a HunyuanImage 2.1 LoRA between sd-scripts' names and ComfyUI's, as sd-scripts' script of this name.

    python networks/convert_hunyuan_image_lora_to_comfy.py my_hunyuan_lora.safetensors my_hunyuan_lora_comfy.safetensors
    python networks/convert_hunyuan_image_lora_to_comfy.py --reverse comfy.safetensors kohya.safetensors

``lora_unet_double_blocks_0_img_mlp_fc1`` <-> ``lora_unet_double_blocks_0_img_mlp_0``, ``..._img_mod_linear`` <->
``..._img_mod_lin`` (txt_ too), ``single_blocks_N_modulation_linear`` <-> ``..._modulation_lin``; tensors unchanged
(library/families/hunyuan_image/comfy_lora.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.families.hunyuan_image import comfy_lora


def build_parser():
    return comfy_lora.build_parser(__doc__)


def run(argv: Sequence[str] | None = None) -> str:
    """Convert; returns the path written."""
    return comfy_lora.run(argv, __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line with its exit status (2 and one error: line for bad input)."""
    return comfy_lora.main(argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(None))
