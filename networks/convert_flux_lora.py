"""Convert a FLUX.1 / Chroma LoRA between sd-scripts (kohya, BFL names) and ai-toolkit / diffusers (PEFT) names.

    # ai-toolkit / diffusers -> sd-scripts (the default direction, as sd-scripts' script)
    python networks/convert_flux_lora.py --src ai-toolkit --dst sd-scripts --src_path ait.safetensors \
        --dst_path kohya.safetensors
    # sd-scripts -> ai-toolkit: loads in diffusers' FluxPipeline.load_lora_weights
    python networks/convert_flux_lora.py --src sd-scripts --dst ai-toolkit --src_path kohya.safetensors \
        --dst_path peft.safetensors [--save_precision bf16]

Both directions keep every module's ΔW exactly (library/families/flux/lora_formats.py): kohya -> PEFT folds alpha /
r into the factors and splits a fused module's up matrix by the diffusers Linears' rows (the down matrix shared);
PEFT -> kohya stacks the leaves' down matrices, makes the up matrix block-diagonal and sets alpha to the stacked
rank (so the strength is kept; a file whose leaves share one down matrix, as sd-scripts -> ai-toolkit writes, gets
its original rank back). CLIP-L modules convert too; T5 modules and non-LoRA algorithms (LoHa, LoKr, DoRA...) are
refused with the module named. ``peft`` / ``diffusers`` are accepted for ai-toolkit and ``kohya`` for sd-scripts.
The metadata of the source is kept (as sd-scripts); --save_precision casts the tensors (default: as converted,
float32).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.families.flux.lora_formats import CONVERSION
from networks.convert_lora_cli import LoraConverter

CONVERTER = LoraConverter(__doc__, CONVERSION)
# the command line: run(argv) returns the path written; main(argv) its exit status (2 and one error: line)
build_parser, check, convert, run, main = (CONVERTER.build_parser, CONVERTER.check, CONVERTER.convert, CONVERTER.run,
                                           CONVERTER.main)  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
