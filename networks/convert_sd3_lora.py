"""Convert an SD3 / SD3.5 LoRA between sd-scripts (kohya, SAI names) and diffusers (PEFT) names.

diffusers' ``StableDiffusion3Pipeline.load_lora_weights`` loads **nothing** from a kohya SD3 file (sd-scripts'
``networks.lora_sd3`` output, ours): it logs a warning and the pipeline runs without the LoRA. Convert first:

    # sd-scripts -> diffusers (the default direction): loads in StableDiffusion3Pipeline.load_lora_weights
    python networks/convert_sd3_lora.py --src_path kohya.safetensors --dst_path peft.safetensors [--save_precision bf16]
    # diffusers / PEFT -> sd-scripts: loads in ComfyUI, Forge, sd-scripts and our --network_weights
    python networks/convert_sd3_lora.py --src diffusers --dst sd-scripts --src_path peft.safetensors \
        --dst_path kohya.safetensors

Both directions keep every module's ΔW exactly (networks/sd3_formats.py): kohya -> PEFT folds alpha / r into the
factors and splits a fused qkv's up matrix into q, k, v (the down matrix shared); PEFT -> kohya stacks the leaves'
down matrices, makes the up matrix block-diagonal and sets alpha to the stacked rank (a file whose leaves share one
down matrix, as sd-scripts -> diffusers writes, gets its original rank back). CLIP-L (``lora_te1_`` <->
``text_encoder.``) and CLIP-G (``lora_te2_`` <-> ``text_encoder_2.``) modules convert too; T5-XXL modules
(``lora_te3_``) are left out with a warning (diffusers' SD3 loader reads no T5 LoRA); non-LoRA algorithms (LoHa, LoKr,
DoRA...) are refused with the module named. ``peft`` / ``ai-toolkit`` are accepted for diffusers and ``kohya`` for
sd-scripts. The metadata of
the source is kept (as sd-scripts); --save_precision casts the tensors (default: as converted, float32).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.problems import ConfigError
from networks.tool_common import check_adapter_path, dtype_of, main_guard

FORMATS = {"diffusers": "diffusers", "peft": "diffusers", "ai-toolkit": "diffusers", "sd-scripts": "sd-scripts",
           "kohya": "sd-scripts"}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default="sd-scripts", choices=list(FORMATS), help="source format (default sd-scripts)")
    p.add_argument("--dst", default="diffusers", choices=list(FORMATS), help="destination format (default "
                   "diffusers)")  # fmt: skip
    p.add_argument("--src_path", default=None, help="source LoRA file (.safetensors)")
    p.add_argument("--dst_path", default=None, help="destination file (.safetensors)")
    p.add_argument("--save_precision", choices=[None, "float", "fp16", "bf16"], default=None,
                   help="output precision (default float: the converted factors)")  # fmt: skip
    return p


def check(args: argparse.Namespace) -> tuple[str, str]:
    problems: list[str] = []
    src, dst = FORMATS[args.src], FORMATS[args.dst]
    if src == dst:
        problems.append(f"--src {args.src} and --dst {args.dst} are the same format; nothing to convert")
    if not args.src_path:
        problems.append("--src_path is required: the LoRA file to convert")
    elif not Path(args.src_path).is_file():
        problems.append(f"--src_path {args.src_path}: no such file")
    check_adapter_path("--dst_path", args.dst_path, problems)
    if problems:
        raise ConfigError(problems)
    return src, dst


def convert(args: argparse.Namespace) -> Path:
    from library.weight_files import load_state_dict, save_state_dict
    from networks import sd3_formats as ff

    src, dst = check(args)
    state, metadata = load_state_dict(args.src_path)
    peft = ff.is_peft(state)
    if (src == "diffusers") != peft:
        found = "PEFT / diffusers keys (*.lora_A.weight)" if peft else "kohya keys (*.lora_down.weight)"
        raise ConfigError([f"--src_path {args.src_path} holds {found}, not --src {args.src}; swap --src and --dst"])
    out = ff.peft_to_kohya(state, args.src_path) if peft else ff.kohya_to_peft(state, args.src_path)
    if not out:
        raise ConfigError([f"--src_path {args.src_path}: no LoRA modules to convert"])
    path = save_state_dict(out, args.dst_path, metadata, dtype_of(args.save_precision, None), wrap_ckpt=False)
    print(f"converted {args.src_path} ({src}) -> {path} ({dst}): {len(out)} tensors")
    return path


def run(argv: Sequence[str] | None = None) -> Path:
    """Convert; returns the path written."""
    return convert(build_parser().parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
