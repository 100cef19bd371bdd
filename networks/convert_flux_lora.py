"""Convert a FLUX.1 / Chroma LoRA between sd-scripts (kohya, BFL names) and ai-toolkit / diffusers (PEFT) names.

    # ai-toolkit / diffusers -> sd-scripts (the default direction, as sd-scripts' script)
    python networks/convert_flux_lora.py --src ai-toolkit --dst sd-scripts --src_path ait.safetensors \
        --dst_path kohya.safetensors
    # sd-scripts -> ai-toolkit: loads in diffusers' FluxPipeline.load_lora_weights
    python networks/convert_flux_lora.py --src sd-scripts --dst ai-toolkit --src_path kohya.safetensors \
        --dst_path peft.safetensors [--save_precision bf16]

Both directions keep every module's ΔW exactly (networks/flux_formats.py): kohya -> PEFT folds alpha / r into the
factors and splits a fused module's up matrix by the diffusers Linears' rows (the down matrix shared); PEFT -> kohya
stacks the leaves' down matrices, makes the up matrix block-diagonal and sets alpha to the stacked rank (so the
strength is kept; a file whose leaves share one down matrix, as sd-scripts -> ai-toolkit writes, gets its original
rank back). CLIP-L modules convert too; T5 modules and non-LoRA algorithms (LoHa, LoKr, DoRA...) are refused with
the module named. ``peft`` / ``diffusers`` are accepted for ai-toolkit and ``kohya`` for sd-scripts. The metadata of
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

FORMATS = {"ai-toolkit": "ai-toolkit", "peft": "ai-toolkit", "diffusers": "ai-toolkit", "sd-scripts": "sd-scripts",
           "kohya": "sd-scripts"}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default="ai-toolkit", choices=list(FORMATS), help="source format (default ai-toolkit)")
    p.add_argument("--dst", default="sd-scripts", choices=list(FORMATS), help="destination format (default "
                   "sd-scripts)")  # fmt: skip
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
    from networks import flux_formats as ff

    src, dst = check(args)
    state, metadata = load_state_dict(args.src_path)
    peft = ff.is_peft(state)
    if (src == "ai-toolkit") != peft:
        found = "PEFT / ai-toolkit keys (*.lora_A.weight)" if peft else "kohya keys (*.lora_down.weight)"
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
