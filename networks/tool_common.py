"""What the tool scripts share: precisions, progress bars, adapter saving, the command-line exit status.

What the post-training tool scripts share: precision names, progress bars, and writing an adapter file
atomically with sd-scripts' ``sshs_*`` hashes computed on exactly the tensors written."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from library.families import family_as_flagged, family_flag_problems, tool_family_flags  # noqa: F401 (the tools')

PRECISIONS: dict[str | None, torch.dtype | None] = {
    None: None,
    "float": torch.float32,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
ADAPTER_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth")


def dtype_of(name: str | None, default: torch.dtype | None = torch.float32) -> torch.dtype | None:
    """``--save_precision`` / ``--precision`` name -> dtype (None -> ``default``)."""
    return PRECISIONS[name] if name is not None else default


def check_adapter_path(flag: str, path: str | None, problems: list[str]) -> None:
    """sd-scripts' rule for adapter outputs: a .safetensors / .ckpt / .pt / .pth file name."""
    if not path:
        problems.append(f"{flag} is required: the file to write (.safetensors, .ckpt, .pt or .pth)")
    elif Path(path).suffix.lower() not in ADAPTER_SUFFIXES:
        problems.append(f"{flag} {path}: must end in .safetensors, .ckpt, .pt or .pth")


def check_inputs(flag: str, paths: list[str] | None, problems: list[str]) -> None:
    for p in paths or []:
        if not Path(p).exists():
            problems.append(f"{flag} {p}: no such file")


def progress(total: int, desc: str, unit: str = "module") -> tqdm:
    """A tqdm bar on stderr (hidden when stderr is not a terminal and the count is small)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)


def cast(state_dict: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """Floating tensors to ``dtype`` (None: unchanged), contiguous, on the CPU."""
    out = {}
    for k, v in state_dict.items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous()
    return out


def save_adapter(
    state_dict: Mapping[str, Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str],
    dtype: torch.dtype | None,
    *,
    no_metadata: bool = False,
) -> Path:
    """Cast, hash (``sshs_model_hash`` / ``sshs_legacy_hash`` over the tensors as written) and write atomically.
    ``no_metadata``: only the minimal ss_* keys and ModelSpec (``library.files.metadata.minimal``)."""
    from library.files import metadata as md
    from library.files.weights import save_state_dict

    tensors = cast(state_dict, dtype)
    meta = md.to_str_values(dict(metadata))
    if no_metadata:
        meta = md.minimal(meta)
    meta = md.with_hashes(tensors, {k: v for k, v in meta.items() if not k.startswith("sshs_")})
    return save_state_dict(tensors, path, metadata=meta, wrap_ckpt=False)  # adapter pickles: a plain dict


def ratios_for(models: list[str] | None, ratios: list[float] | None, problems: list[str]) -> list[float]:
    """``--ratios``: one per ``--models`` entry (all 1.0 when omitted); a count mismatch is a problem."""
    models = models or []
    if not models:
        problems.append("--models is required: the adapter files to merge")
    if ratios is None:
        return [1.0] * len(models)
    if len(ratios) != len(models):
        problems.append(f"--ratios has {len(ratios)} value(s) for {len(models)} --models file(s); give one ratio per "
                        "file, in the same order")  # fmt: skip
    return list(ratios)


def device_problem(device: str | None, problems: list[str]) -> None:
    """``--device``: a torch device name whose kind this machine has."""
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        problems.append(f"--device {device}: not a device name; use cpu, cuda or cuda:N")
        return
    if kind == "cuda" and not torch.cuda.is_available():
        problems.append(f"--device {device}: no CUDA GPU is available here; use --device cpu")


# ------------------------------------------------------------------------------------------------- family flags
def family_titles(names: Iterable[str] | None = None, sep: str = "/") -> str:
    """The registered families ``names`` (all when None) for messages, short ("SD1/SD2/SDXL"), in registry order."""
    from library.families import FAMILIES

    chosen = FAMILIES if names is None else names
    return sep.join(dict.fromkeys(FAMILIES[n].spec.title.removesuffix(".x") for n in chosen))


def add_family_flags(parser: argparse.ArgumentParser, help: str, shown: Iterable[str] | None = None) -> None:
    """The family flags (:func:`tool_family_flags`) as accepted, checked flags; those of families not in ``shown``
    (None: all shown) are accepted but left out of ``--help``."""
    for flag, name in tool_family_flags().items():
        visible = shown is None or name in shown
        parser.add_argument(f"--{flag}", action="store_true", help=help if visible else argparse.SUPPRESS)
