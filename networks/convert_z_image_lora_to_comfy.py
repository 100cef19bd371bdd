"""Convert a Z-Image LoRA between musubi-tuner's names and ComfyUI's, as musubi-tuner's script of this name.

    python networks/convert_z_image_lora_to_comfy.py my_lora.safetensors my_lora_comfy.safetensors
    python networks/convert_z_image_lora_to_comfy.py --reverse comfy.safetensors kohya.safetensors

kohya ``lora_unet_layers_0_attention_to_q.lora_down.weight`` <-> ComfyUI
``diffusion_model.layers.0.attention.to_q.lora_A.weight``; tensors unchanged (library/families/zimage/comfy_lora.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.families.zimage import comfy_lora


def run(argv: Sequence[str] | None = None) -> str:
    """Convert; returns the path written."""
    return comfy_lora.run(argv, __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line with its exit status (2 and one error: line for bad input)."""
    return comfy_lora.main(argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(None))
