"""Merge LoRA / LyCORIS files into FLUX.1 / Chroma single files, or several FLUX LoRAs into one (sd-scripts' flags).

    # into the model files users have (BFL transformer, CLIP-L, T5-XXL; each written where its *_save_to says)
    python networks/flux_merge_lora.py --flux_model flux1-dev.safetensors --models a.safetensors b.safetensors \
        --ratios 1 0.5 --save_to merged.safetensors [--clip_l clip_l.safetensors --clip_l_save_to clip_l_m.safetensors]
        [--t5xxl t5xxl.safetensors --t5xxl_save_to t5xxl_m.safetensors] [--save_precision bf16]
    # LoRAs into one LoRA: exactly with --concat (rank = sum of ranks), else by SVD at the largest input rank
    python networks/flux_merge_lora.py --models a.safetensors b.safetensors --ratios 1 0.5 --save_to ab.safetensors \
        [--concat]

Into a model, each module changes its file's weight by ComfyUI's rule, W += ratio · ΔW on the key named by the
module (networks/single_files.py): the output has the input's keys, shapes and metadata (float8 inputs are read and
merged in --precision), every floating tensor cast to --save_precision (default: --precision, as sd-scripts; fp8,
fp8_e4m3fn, fp8_e5m2... write float8). Any algorithm merges (LoRA, LoCon, LoHa, LoKr, DoRA on the fused weight,
full). Files with PEFT / diffusers / ai-toolkit names (``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``)
are converted to kohya names first, exactly. --diffusers says the --flux_model file has diffusers names
(``transformer_blocks.0.attn.to_q.weight``): it is merged through the BFL names and written back under its own
(the names are also detected, so the flag only confirms them). Modules for a model file not given (lora_te1 without
--clip_l) are left out with a warning, as sd-scripts does; modules that match nothing in a given file are an error.

LoRA + LoRA: with --concat the merged file's ΔW is exactly Σ ratio·ΔW (ranks concatenated, alpha = rank); without
it the sum is truncated by SVD to the largest rank of the inputs (alpha = rank), the best approximation at the rank
sd-scripts' merge keeps (sd-scripts adds the up and down matrices themselves, which is not the sum of the ΔWs).
--shuffle permutes each module's rank components, as sd-scripts (ΔW unchanged). --mem_eff_load_save is accepted:
safetensors files are read memory-mapped and only the merged weights are converted, which is what it buys in
sd-scripts. --loading_device holds the model tensors, --working_device computes the merge.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.families.flux.lora_tools import MERGE
from networks.single_file_tools import MergeTool

TOOL = MergeTool(__doc__, __name__, MERGE)
# the command line: run(argv) returns the paths written; main(argv) its exit status (2 and one error: line)
build_parser, check, run, main = TOOL.build_parser, TOOL.check, TOOL.run, TOOL.main

if __name__ == "__main__":
    sys.exit(main())
