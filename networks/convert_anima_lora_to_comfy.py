"""Convert an Anima LoRA between sd-scripts' names and ComfyUI's, as sd-scripts' script of this name.

    python networks/convert_anima_lora_to_comfy.py my_anima_lora.safetensors my_anima_lora_comfy.safetensors
    python networks/convert_anima_lora_to_comfy.py --reverse comfy.safetensors kohya.safetensors

kohya ``lora_unet_blocks_0_self_attn_q_proj.lora_down.weight`` <-> ComfyUI
``diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight`` (Qwen3: ``lora_te_`` <->
``text_encoders.qwen3_06b.transformer.model.``); tensors unchanged (library/families/anima/comfy_lora.py).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.families.anima import comfy_lora

build_parser = functools.partial(comfy_lora.build_parser, __doc__)
run = functools.partial(comfy_lora.run, doc=__doc__)
main = functools.partial(comfy_lora.main, doc=__doc__)

if __name__ == "__main__":
    sys.exit(main(None))
