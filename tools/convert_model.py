"""Script: convert an SD1 / SD2 / SDXL model between a diffusers folder and a single file.

Convert a Stable Diffusion model (SD1 / SD2 incl. v-prediction / SDXL) between a diffusers folder and a single
file (.safetensors / .ckpt), optionally changing its precision.

    python tools/convert_model.py model.safetensors out_diffusers_folder [--fp16]
    python tools/convert_model.py diffusers_folder model.safetensors [--save_precision_as bf16]

The direction follows ``model_to_save``: a name ending in .safetensors / .ckpt is a single file, anything else a
diffusers folder. The family (SD1, SD2, SDXL) and the prediction type are read from the input (single files:
``v_pred`` marker, stored configs, ModelSpec or the SD2 weight heuristic; folders: the scheduler config) and written
to the output (single files get ``v_pred`` / ``ztsnr`` markers and ``modelspec.prediction_type``; folders the
scheduler's ``prediction_type``). --v_parameterization forces v-prediction, --v1 / --v2 / --sdxl are checked against
the input. Also available under sd-scripts' name, tools/convert_diffusers20_original_sd.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from library.cli.main_guard import main_guard
from library.cli.parse import add_unsupported, unsupported_problems
from library.cli.problems import ConfigError
from library.families import family_flags, family_title, flagged_family

logger = logging.getLogger(__name__)
SINGLE_FILE = (".safetensors", ".ckpt")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_to_load", help="diffusers folder or single file (.safetensors / .ckpt)")
    p.add_argument("model_to_save", help="single file (.safetensors / .ckpt) or a folder name (diffusers)")
    for flag, name in family_flags().items():  # sd-scripts' --v1 / --v2 / --sdxl
        p.add_argument(f"--{flag}", action="store_true", help=f"checked: the input is {family_title(name)}")
    p.add_argument("--v_parameterization", action="store_true", help="mark the output as v-prediction")
    p.add_argument("--unet_use_linear_projection", action="store_true", help="accepted; the config decides")
    p.add_argument("--fp16", action="store_true", help="save in float16")
    p.add_argument("--bf16", action="store_true", help="save in bfloat16")
    p.add_argument("--float", action="store_true", help="save in float32")
    p.add_argument("--save_precision_as", choices=["no", "fp16", "bf16", "float"], default="no",
                   help="save precision ('no': as loaded, which keeps the input's precision)")  # fmt: skip
    p.add_argument("--epoch", type=int, default=None, help=".ckpt: the epoch stored with the state dict")
    p.add_argument("--global_step", type=int, default=None, help=".ckpt: the global step stored with it")
    p.add_argument("--metadata", default=None, help="single .safetensors: extra metadata as a JSON object")
    p.add_argument("--reference_model", default=None, help="accepted; configs and tokenizers ship with sdtrain")
    p.add_argument("--use_safetensors", action="store_true", help="accepted; diffusers weights are always safetensors")
    add_unsupported(p, "--variant", "diffusers variant file names (*.fp16.safetensors) are not written", default=None)
    return p


def precision(args: argparse.Namespace, problems: list[str]) -> torch.dtype | None:
    chosen = [n for n in ("fp16", "bf16", "float") if getattr(args, n)]
    if args.save_precision_as != "no":
        chosen.append(args.save_precision_as)
    if len(set(chosen)) > 1:
        problems.append(f"choose one save precision, got {', '.join(sorted(set(chosen)))}")
        return None
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}.get(chosen[0]) if chosen else None


def extra_metadata(args: argparse.Namespace, problems: list[str]) -> dict[str, str]:
    meta: dict[str, str] = {}
    if args.metadata:
        try:
            value = json.loads(args.metadata)
            if not isinstance(value, dict):
                raise ValueError("not an object")
            meta.update({str(k): str(v) for k, v in value.items()})
        except ValueError as e:
            problems.append(f'--metadata must be a JSON object such as \'{{"modelspec.author": "me"}}\' ({e})')
    suffix = Path(args.model_to_save).suffix.lower()
    for flag in ("epoch", "global_step"):
        if getattr(args, flag) is not None:
            if suffix != ".ckpt":
                problems.append(f"--{flag} is stored in .ckpt files only")
            meta[flag] = str(getattr(args, flag))
    return meta


_ST_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def stored_dtype(path: Path) -> torch.dtype | None:
    """The floating dtype a model is stored in (its first UNet weight), for .safetensors files and diffusers
    folders; None when it cannot be read cheaply (.ckpt)."""
    from safetensors import safe_open

    prefix = "model.diffusion_model."
    if path.is_dir():
        found = sorted((path / "unet").glob("diffusion_pytorch_model*.safetensors"))
        if not found:
            return None
        path, prefix = found[0], ""
    elif path.suffix.lower() != ".safetensors":
        return None
    with safe_open(str(path), framework="pt") as f:
        key = next((k for k in f.keys() if k.startswith(prefix)), None)
        return _ST_DTYPES.get(f.get_slice(key).get_dtype()) if key is not None else None


def run(argv: Sequence[str] | None = None) -> Path:
    """Convert; returns the path written."""
    from library.families import detect_family

    parser = build_parser()
    args = parser.parse_args(argv)
    problems = unsupported_problems(parser, args)
    dtype = precision(args, problems)
    meta = extra_metadata(args, problems)
    src, dst = Path(args.model_to_load), Path(args.model_to_save)
    if not src.exists():
        problems.append(f"{src}: no such file or folder")
    if dst.suffix.lower() in (".pt", ".pth", ".bin"):
        problems.append(f"{dst}: save as .safetensors, .ckpt or a folder name (diffusers)")
    flags = [f"--{flag}" for flag in family_flags()]
    if sum(bool(getattr(args, flag)) for flag in family_flags()) > 1:
        problems.append(f"{', '.join(flags[:-1])} and {flags[-1]} exclude each other")
    if problems:
        raise ConfigError(problems)
    family = detect_family(src)
    want = flagged_family(args)
    if want and want != family.name:
        raise ConfigError([f"{src} is an {family.name} model, not {want}; remove {' / '.join(flags)} (the family "
                           "is read from the file)"])  # fmt: skip
    load_dtype = dtype or stored_dtype(src) or torch.float32  # no up-cast: the output keeps the input's precision
    parts = family.load(src, dtype=load_dtype, v_parameterization=True if args.v_parameterization else None)
    path = family.save(parts, dst, dtype=dtype, metadata=meta)
    kind = "single file" if dst.suffix.lower() in SINGLE_FILE else "diffusers folder"
    print(f"{src} ({family.name}, {parts.prediction_type}) -> {path} ({kind}, {load_dtype})")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
