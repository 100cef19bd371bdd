"""Extract a LoRA from the difference of two FLUX.1 / Chroma transformer files (sd-scripts' flags).

    python networks/flux_extract_lora.py --model_org flux1-dev.safetensors --model_tuned tuned.safetensors \
        --save_to extracted.safetensors --dim 16 [--device cuda] [--save_precision bf16] [--clamp_quantile 0.99]

As sd-scripts' flux_extract_lora.py: the modules are the block matrices (every ``double_blocks.*`` /
``single_blocks.*`` weight but the norms), named by ComfyUI's rule on their BFL keys (``lora_unet_double_blocks_0_
img_attn_qkv``: fused modules are one matrix each, so their LoRA is the SVD of the stacked difference). Per module
ΔW = W_tuned − W_org (float32), truncated by SVD to --dim: up = U·S, down = Vh, alpha = rank, both factors clamped at
their --clamp_quantile quantile (0.99 as sd-scripts; 1 keeps the best rank-r approximation exactly).

Either file may have BFL names (with or without ``model.diffusion_model.``, float8 included) or diffusers names
(converted to BFL). --min_diff (sd-scripts has it commented out) leaves out modules whose largest |ΔW| is at most
the value (default 0: every module, as sd-scripts). --mem_eff_safe_open reads the files one tensor at a time instead
of loading them whole. The metadata says FLUX.1 / Chroma (ss_base_model_version flux1 / chroma, ModelSpec
flux-1-dev/lora ...), read from the original model's weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.families.flux.lora_tools import EXTRACT
from networks.single_file_tools import ExtractTool

TOOL = ExtractTool(__doc__, EXTRACT)
# the command line: run(argv) returns the path written; main(argv) its exit status (2 and one error: line)
build_parser, check, run, main = TOOL.build_parser, TOOL.check, TOOL.run, TOOL.main

if __name__ == "__main__":
    sys.exit(main())
