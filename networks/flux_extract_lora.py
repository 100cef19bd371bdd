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

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from networks.tool_common import check_adapter_path, device_problem, dtype_of, save_adapter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save_precision", choices=[None, "float", "fp16", "bf16"], default=None,
                   help="output precision (default float)")  # fmt: skip
    p.add_argument("--model_org", default=None, help="the original FLUX.1 / Chroma transformer (.safetensors)")
    p.add_argument("--model_tuned", default=None, help="the tuned transformer: the LoRA is org -> tuned")
    p.add_argument("--mem_eff_safe_open", action="store_true", help="read the files one tensor at a time")
    p.add_argument("--save_to", default=None, help="output LoRA (.safetensors / .ckpt / .pt / .pth)")
    p.add_argument("--dim", type=int, default=4, help="rank of the LoRA (default 4)")
    p.add_argument("--device", default=None, help="device for the differences and SVDs, e.g. cuda")
    p.add_argument("--clamp_quantile", type=float, default=0.99, help="clamp the factors at this quantile (1: off)")
    p.add_argument("--min_diff", type=float, default=0.0, help="leave out modules whose largest |ΔW| is at most "
                   "this (default 0: every module)")  # fmt: skip
    p.add_argument("--no_metadata", action="store_true", help="only the minimal metadata")
    return p


def check(args: argparse.Namespace) -> None:
    problems: list[str] = []
    for flag in ("model_org", "model_tuned"):
        value = getattr(args, flag)
        if not value:
            problems.append(f"--{flag} is required")
        elif not Path(value).is_file():
            problems.append(f"--{flag} {value}: no such file")
    check_adapter_path("--save_to", args.save_to, problems)
    if args.dim < 1:
        problems.append(f"--dim {args.dim}: must be >= 1")
    if not 0 < args.clamp_quantile <= 1:
        problems.append(f"--clamp_quantile must be in (0, 1], got {args.clamp_quantile}")
    if args.min_diff < 0:
        problems.append(f"--min_diff {args.min_diff}: must be >= 0")
    device_problem(args.device, problems)
    if problems:
        raise ConfigError(problems)


class _Stripped(Mapping):
    """A state dict (or lazy reader) seen without its ``model.diffusion_model.`` prefix."""

    def __init__(self, source: Mapping, prefix: str) -> None:
        self.source, self.prefix = source, prefix

    def __getitem__(self, key: str):
        return self.source[self.prefix + key]

    def shape(self, key: str) -> tuple[int, ...]:
        shape = getattr(self.source, "shape", None)
        return tuple(shape(self.prefix + key) if callable(shape) else self.source[self.prefix + key].shape)

    def __iter__(self):
        return (k.removeprefix(self.prefix) for k in self.source)

    def __len__(self) -> int:
        return len(self.source)


def read_bfl(path: str, flag: str, lazy: bool) -> _Stripped:
    """The transformer of ``path`` under BFL names without prefix; diffusers-named files are converted."""
    from library.families.flux import keys as K
    from library.files.weights import SafetensorsReader, load_state_dict

    lazy = lazy and Path(path).suffix.lower() == ".safetensors"
    source = SafetensorsReader(path) if lazy else load_state_dict(path)[0]
    keys = list(source.keys())
    if K.is_bfl(keys):
        return _Stripped(source, K.BFL_PREFIX if any(k.startswith(K.BFL_PREFIX) for k in keys) else "")
    plain = {k.removeprefix("transformer."): source[k] for k in keys}
    if not K.is_diffusers(plain):
        raise ConfigError([f"{flag} {path}: not a FLUX.1 / Chroma transformer (no double_blocks.0.img_attn.qkv.weight "
                           "and no diffusers transformer_blocks.0.attn.add_k_proj.weight)"])  # fmt: skip
    try:
        return _Stripped(K.diffusers_to_bfl(plain), "")
    except KeyError as e:
        raise ConfigError([f"{flag} {path}: {e.args[0]}"]) from None


def block_modules(org: _Stripped, tuned: _Stripped, args: argparse.Namespace) -> dict[str, str]:
    """{kohya name: BFL key} of the block matrices (sd-scripts' selection); ``ConfigError`` when the two files
    differ in architecture."""
    keys = [k for k in org if ("single_block" in k or "double_block" in k) and k.endswith(".weight") and "norm" not
            in k and len(org.shape(k)) == 2]  # fmt: skip
    tuned_keys = set(tuned)
    missing = [k for k in keys if k not in tuned_keys]
    wrong = [
        f"{k} {org.shape(k)} vs {tuned.shape(k)}" for k in keys if k in tuned_keys and org.shape(k) != tuned.shape(k)
    ]
    if missing or wrong or not keys:
        detail = (f"{len(missing)} missing in --model_tuned, e.g. {', '.join(missing[:3])}" if missing else
                  f"shapes differ: {', '.join(wrong[:3])}" if wrong else "no block weights found")  # fmt: skip
        raise ConfigError([f"--model_org {args.model_org} and --model_tuned {args.model_tuned} are not the same "
                           f"architecture ({detail})"])  # fmt: skip
    return {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): k for k in keys}


def metadata(org: _Stripped, args: argparse.Namespace) -> dict[str, str]:
    """sd-scripts' minimal metadata of an extracted FLUX LoRA, with our family's names, + ModelSpec."""
    from library.families import get_family
    from library.families.flux import keys as K
    from library.families.flux.saving import flux_modelspec

    variant = K.variant_name(K.bfl_layout(list(org)))
    family = get_family("chroma" if variant == "chroma" else f"flux-{variant}")
    meta = {
        "ss_v2": "False",
        "ss_base_model_version": family.base_model_version(),
        "ss_network_module": "networks.lora_flux",
        "ss_network_dim": str(args.dim),
        "ss_network_alpha": str(float(args.dim)),
        "ss_network_args": json.dumps({}),
        "ss_training_comment": f"extracted from {Path(args.model_org).name} -> {Path(args.model_tuned).name}",
    }
    spec = flux_modelspec(family.modelspec_architecture("lora"), family.modelspec_implementation("lora"),
                          Path(args.save_to).stem, family.default_resolution())  # fmt: skip
    return {**meta, **spec}


def run(argv: Sequence[str] | None = None) -> Path:
    """Extract; returns the path written."""
    from networks.extract import ExtractOptions, extract_from_state_dicts
    from networks.merge import output_ranks

    args = build_parser().parse_args(argv)
    check(args)
    org = read_bfl(args.model_org, "--model_org", args.mem_eff_safe_open)
    tuned = read_bfl(args.model_tuned, "--model_tuned", args.mem_eff_safe_open)
    names = block_modules(org, tuned, args)
    opts = ExtractOptions(dim=args.dim, clamp_quantile=args.clamp_quantile, min_diff=args.min_diff,
                          device=args.device)  # fmt: skip
    state = extract_from_state_dicts(names, org, tuned, opts)
    meta = metadata(org, args)
    ranks = sorted({rank for rank, _ in output_ranks(state).values()})  # --dim caps at each module's size
    if len(ranks) == 1:
        meta["ss_network_dim"], meta["ss_network_alpha"] = str(ranks[0]), str(float(ranks[0]))
    elif ranks:
        meta["ss_network_dim"] = meta["ss_network_alpha"] = "Dynamic"  # as merged / resized files say it
    path = save_adapter(state, args.save_to, meta, dtype_of(args.save_precision),
                        no_metadata=args.no_metadata)  # fmt: skip
    print(f"extracted {len(state) // 3} of {len(names)} modules into {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
