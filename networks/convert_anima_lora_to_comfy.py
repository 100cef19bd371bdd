"""Convert an Anima LoRA between sd-scripts' names and ComfyUI's, as sd-scripts' script of this name.

    python networks/convert_anima_lora_to_comfy.py my_anima_lora.safetensors my_anima_lora_comfy.safetensors
    python networks/convert_anima_lora_to_comfy.py --reverse comfy.safetensors kohya.safetensors

kohya ``lora_unet_blocks_0_self_attn_q_proj.lora_down.weight`` <-> ComfyUI
``diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight`` (Qwen3: ``lora_te_`` <->
``text_encoders.qwen3_06b.transformer.model.``); tensors unchanged (library/families/anima/comfy_lora.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.families.anima import comfy_lora


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
