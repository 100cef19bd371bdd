"""Merge LoRA / LyCORIS files into FLUX.1 / Chroma single files, or several FLUX LoRAs into one (sd-scripts' flags).

    # into the model files users have (BFL transformer, CLIP-L, T5-XXL; each written where its *_save_to says)
    python networks/flux_merge_lora.py --flux_model flux1-dev.safetensors --models a.safetensors b.safetensors \
        --ratios 1 0.5 --save_to merged.safetensors [--clip_l clip_l.safetensors --clip_l_save_to clip_l_m.safetensors]
        [--t5xxl t5xxl.safetensors --t5xxl_save_to t5xxl_m.safetensors] [--save_precision bf16]
    # LoRAs into one LoRA: exactly with --concat (rank = sum of ranks), else by SVD at the largest input rank
    python networks/flux_merge_lora.py --models a.safetensors b.safetensors --ratios 1 0.5 --save_to ab.safetensors \
        [--concat]

Into a model, each module changes its file's weight by ComfyUI's rule, W += ratio · ΔW on the key named by the
module (networks/flux_merge.py): the output has the input's keys, shapes and metadata (float8 inputs are read and
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

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from networks.tool_common import check_adapter_path, check_inputs, device_problem, dtype_of, ratios_for, save_adapter

logger = logging.getLogger(__name__)
SAVE_PRECISIONS = {"float": torch.float32, "float32": torch.float32, "fp32": torch.float32, "fp16": torch.float16,
                   "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                   "fp8": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn,
                   "fp8_e4m3fnuz": torch.float8_e4m3fnuz, "fp8_e5m2": torch.float8_e5m2,
                   "fp8_e5m2fnuz": torch.float8_e5m2fnuz}  # fmt: skip
MODEL_FLAGS = (("flux_model", "save_to", "lora_unet"), ("clip_l", "clip_l_save_to", "lora_te1"),
               ("t5xxl", "t5xxl_save_to", "lora_te3"))  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save_precision", default=None, choices=list(SAVE_PRECISIONS),
                   help="output precision (default: --precision)")  # fmt: skip
    p.add_argument("--precision", default="float", choices=["float", "fp16", "bf16"],
                   help="precision of the merge (float recommended)")  # fmt: skip
    p.add_argument("--flux_model", default=None, help="FLUX.1 / Chroma transformer file (BFL or diffusers names); "
                   "without it (and --clip_l / --t5xxl) the LoRAs are merged into one LoRA")  # fmt: skip
    p.add_argument("--clip_l", default=None, help="CLIP-L file to merge lora_te1 modules into")
    p.add_argument("--t5xxl", default=None, help="T5-XXL file to merge lora_te3 modules into")
    p.add_argument("--mem_eff_load_save", action="store_true", help="accepted: files are read memory-mapped and "
                   "only merged weights are converted")  # fmt: skip
    p.add_argument("--loading_device", default="cpu", help="device the model tensors are loaded to")
    p.add_argument("--working_device", default="cpu", help="device the merge is computed on")
    p.add_argument("--save_to", default=None, help="output: the merged transformer, or the merged LoRA")
    p.add_argument("--clip_l_save_to", default=None, help="output of the merged --clip_l")
    p.add_argument("--t5xxl_save_to", default=None, help="output of the merged --t5xxl")
    p.add_argument("--models", nargs="*", default=None, help="LoRA / LyCORIS files (kohya or PEFT names)")
    p.add_argument("--ratios", nargs="*", type=float, default=None, help="one multiplier per file (default 1.0)")
    p.add_argument("--no_metadata", action="store_true", help="LoRA output: only the minimal metadata; model "
                   "output: the input's metadata without merged_from")  # fmt: skip
    p.add_argument("--concat", action="store_true", help="LoRA + LoRA: concatenate ranks (exact)")
    p.add_argument("--shuffle", action="store_true", help="permute each output module's rank components")
    p.add_argument("--diffusers", action="store_true", help="--flux_model has diffusers names (also detected)")
    return p


def check(args: argparse.Namespace) -> list[float]:
    """The ratios; every problem of the command line in one ConfigError."""
    problems: list[str] = []
    ratios = ratios_for(args.models, args.ratios, problems)
    check_inputs("--models", args.models, problems)
    for flag in ("loading_device", "working_device"):
        device_problem(getattr(args, flag), problems)
    into_model = any(getattr(args, m) for m, _, _ in MODEL_FLAGS)
    for model, save_to, _ in MODEL_FLAGS:
        if getattr(args, model):
            check_inputs(f"--{model}", [getattr(args, model)], problems)
            out = getattr(args, save_to)
            if not out:
                problems.append(f"--{model} needs --{save_to}: the file the merged {model} is written to")
            elif Path(out).suffix.lower() != ".safetensors":
                problems.append(f"--{save_to} {out}: write FLUX model files as .safetensors")
        elif getattr(args, save_to) and save_to != "save_to":
            problems.append(f"--{save_to} without --{model}: pass the {model} file to merge into")
    if not into_model:
        check_adapter_path("--save_to", args.save_to, problems)
        if args.diffusers:
            problems.append("--diffusers describes --flux_model's names; it needs --flux_model")
    if problems:
        raise ConfigError(problems)
    return ratios


def _read_transformer(args: argparse.Namespace):
    """(BFL state dict, to_output(BFL state) -> state under the input's names, metadata)."""
    from library.families.flux import keys as K
    from library.files.weights import load_state_dict

    state, metadata = load_state_dict(args.flux_model, device=args.loading_device)
    keys = list(state)
    if K.is_bfl(keys):
        if args.diffusers:
            raise ConfigError([f"--flux_model {args.flux_model} has BFL names (double_blocks.0.img_attn.qkv.weight), "
                               "not diffusers names; drop --diffusers"])  # fmt: skip
        return state, (lambda s: s), metadata
    prefix = "transformer." if any(k.startswith("transformer.") for k in keys) else ""
    plain = {k.removeprefix(prefix): v for k, v in state.items()}
    if not K.is_diffusers(plain):
        raise ConfigError([f"--flux_model {args.flux_model}: not a FLUX.1 / Chroma transformer (neither BFL keys such "
                           "as double_blocks.0.img_attn.qkv.weight nor diffusers keys such as "
                           "transformer_blocks.0.attn.add_k_proj.weight)"])  # fmt: skip
    try:
        bfl = K.diffusers_to_bfl(plain)
    except KeyError as e:
        raise ConfigError([f"--flux_model {args.flux_model}: {e.args[0]}"]) from None

    def back(merged):
        out = {prefix + k: v for k, v in K.bfl_to_diffusers(merged).items()}
        return {k: out[k] for k in keys}

    return bfl, back, metadata


def merge_into_models(args: argparse.Namespace, files, ratios: list[float]) -> list[Path]:
    from library.files.weights import load_state_dict, save_state_dict
    from networks import flux_merge
    from networks.merge import merged_from

    given = [prefix for model, _, prefix in MODEL_FLAGS if getattr(args, model)]
    for prefix, count in flux_merge.unplaced_modules(files, given).items():
        flag = flux_merge.PREFIXES.get(prefix, "a model file")
        logger.warning("%d %s module(s) are not merged: pass %s to merge them", count, prefix, flag)
    written = []
    work = dtype_of(args.precision)
    save_dtype = SAVE_PRECISIONS[args.save_precision] if args.save_precision else work
    for model, save_to, prefix in MODEL_FLAGS:
        path = getattr(args, model)
        if not path:
            continue
        if model == "flux_model":
            state, to_output, metadata = _read_transformer(args)
        else:
            state, metadata = load_state_dict(path, device=args.loading_device)
            to_output = lambda s: s  # noqa: E731
        changed = flux_merge.merge_into_state(state, prefix, files, ratios, working_device=args.working_device,
                                              dtype=work)  # fmt: skip
        logger.info("%s: %d weights changed", path, len(changed))
        meta = dict(metadata)
        if not args.no_metadata:
            meta["modelspec.merged_from"] = merged_from([Path(path).stem] + [f.title for f in files])
            if "modelspec.title" in meta:
                meta["modelspec.title"] = Path(getattr(args, save_to)).stem
        written.append(save_state_dict(to_output(state), getattr(args, save_to), meta, save_dtype))
    return written


def merge_loras(args: argparse.Namespace, files, ratios: list[float]) -> Path:
    from networks import flux_merge, merge

    problems = merge.check_same_family(files)
    if problems:
        raise ConfigError(problems, "adapter files")
    if args.concat:
        state = merge.concat_merge(files, ratios)
        how = "merged by concatenating ranks (exact)"
    else:
        rank = max((f.rank_of(n) or 0) for f in files for n in f.modules if f.algos[n] != "norm")
        state = merge.svd_merge(files, ratios, new_rank=rank, new_conv_rank=None, device=args.working_device)
        how = f"merged by SVD of the summed ΔW at rank {rank}"
    if args.shuffle:
        flux_merge.shuffle_ranks(state)
    meta = merge.lora_metadata(files, ratios, state, how, args.save_to)
    if any(f.metadata.get("ss_network_module") == "networks.lora_flux" for f in files):
        meta["ss_network_module"] = "networks.lora_flux"
    save = SAVE_PRECISIONS[args.save_precision] if args.save_precision else dtype_of(args.precision)
    return save_adapter(state, args.save_to, meta, save, no_metadata=args.no_metadata)


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Merge; returns the paths written."""
    from networks.flux_merge import load_flux_adapters

    args = build_parser().parse_args(argv)
    ratios = check(args)
    files = load_flux_adapters(args.models)
    if args.mem_eff_load_save:
        logger.info("--mem_eff_load_save: files are read memory-mapped; only the merged weights are converted")
    if any(getattr(args, m) for m, _, _ in MODEL_FLAGS):
        paths = merge_into_models(args, files, ratios)
    else:
        paths = [merge_loras(args, files, ratios)]
    print(f"merged {len(files)} file(s) into {', '.join(map(str, paths))}")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
