"""Convert an SD3 / SD3.5 LoRA between sd-scripts (kohya, SAI names) and diffusers (PEFT) names.

diffusers' ``StableDiffusion3Pipeline.load_lora_weights`` loads **nothing** from a kohya SD3 file (sd-scripts'
``networks.lora_sd3`` output, ours): it logs a warning and the pipeline runs without the LoRA. Convert first:

    # sd-scripts -> diffusers (the default direction): loads in StableDiffusion3Pipeline.load_lora_weights
    python networks/convert_sd3_lora.py --src_path kohya.safetensors --dst_path peft.safetensors [--save_precision bf16]
    # diffusers / PEFT -> sd-scripts: loads in ComfyUI, Forge, sd-scripts and our --network_weights
    python networks/convert_sd3_lora.py --src diffusers --dst sd-scripts --src_path peft.safetensors \
        --dst_path kohya.safetensors

Both directions keep every module's ΔW exactly (library/families/sd3/lora_formats.py): kohya -> PEFT folds alpha / r
into the factors and splits a fused qkv's up matrix into q, k, v (the down matrix shared); PEFT -> kohya stacks the
leaves' down matrices, makes the up matrix block-diagonal and sets alpha to the stacked rank (a file whose leaves
share one down matrix, as sd-scripts -> diffusers writes, gets its original rank back). CLIP-L (``lora_te1_`` <->
``text_encoder.``) and CLIP-G (``lora_te2_`` <-> ``text_encoder_2.``) modules convert too; T5-XXL modules
(``lora_te3_``) are left out with a warning (diffusers' SD3 loader reads no T5 LoRA); non-LoRA algorithms (LoHa,
LoKr, DoRA...) are refused with the module named. ``peft`` / ``ai-toolkit`` are accepted for diffusers and ``kohya``
for sd-scripts. The metadata of the source is kept (as sd-scripts); --save_precision casts the tensors (default: as
converted, float32).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.families.sd3.lora_formats import CONVERSION
from networks.convert_lora_cli import LoraConverter

CONVERTER = LoraConverter(__doc__, CONVERSION)
# the command line: run(argv) returns the path written; main(argv) its exit status (2 and one error: line)
build_parser, check, convert, run, main = (CONVERTER.build_parser, CONVERTER.check, CONVERTER.convert, CONVERTER.run,
                                           CONVERTER.main)  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
