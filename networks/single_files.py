"""Merging adapters into a model's single files as users have them, under the files' own keys (the engine of the
per-family merge tools, ``networks/single_file_tools.py``).

A family's :class:`~library.families.lora_tools.ModelFile` names, for each file, the weight key of every kohya module
name (ComfyUI's rule, e.g. ``lora_unet_double_blocks_0_img_attn_qkv`` -> ``double_blocks.0.img_attn.qkv.weight``);
every module of the files' prefix changes that weight:

    W <- W + ratio · ΔW          (every algorithm through the training code's ΔW: LoRA (α/r)·up@down, LoHa, LoKr,
                                  full, (IA)³, GLoRA, OFT; DoRA's W' − W on the current W, so files apply in order)
    b <- b + ratio · diff_b      (full modules' bias change)

A fused module (one kohya module over several diffusers Linears) is one weight in such a file, so its ΔW is added to
it whole: the same ΔW the adapter gives the diffusers leaves row by row. Only the weights a file changes are converted
to the working precision (float8 files included); the others keep their tensors until the output is cast to the save
precision.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from library.cli.problems import ConfigError, problems_of
from library.families.lora_formats import LoraConversion

from . import files
from .deltas import AdapterFile, module_delta, resolve_index
from .targets import Target
from .tool_common import progress

logger = logging.getLogger(__name__)


def _shape_index(state: Mapping[str, Tensor], names: Mapping[str, str]) -> dict[str, Target]:
    """Targets of meta Linears with each weight's shape (what checking a file against the model needs)."""
    index = {}
    for name, key in names.items():
        out_f, in_f = state[key].shape
        index[name] = Target(name, nn.Linear(in_f, out_f, bias=False, device="meta"), 0, key, "linear")
    return index


def merge_into_state(
    state: dict[str, Tensor],
    prefix: str,
    names: Mapping[str, str],
    files_: Sequence[AdapterFile],
    ratios: Sequence[float],
    *,
    working_device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[str]:
    """Merge the ``prefix`` modules of every file (at its ratio, in order) into ``state`` in place (``names``: {kohya
    module name: weight key} of the file, its family's ``ModelFile.module_names``); returns the keys changed (their
    tensors now ``dtype``, on the device they were on). ``ValueError`` naming each file and module that does not fit
    the file's weights (another model, another size)."""
    index = _shape_index(state, names)
    subsets, problems = [], []
    for f, ratio in zip(files_, ratios):
        mine = {n: t for n, t in f.modules.items() if files.prefix_of(n) == prefix}
        if mine:
            sub = AdapterFile(f.path, mine, f.metadata, {n: f.algos[n] for n in mine})
            try:
                resolve_index(sub, index)  # every module exists and fits: problems before anything is changed
            except ValueError as e:
                problems += problems_of(e)
            subsets.append((sub, ratio))
    if problems:
        raise ConfigError(problems, "adapter files", limit=8)
    work: dict[str, nn.Linear] = {}  # weight key -> the weight in the working precision (only those a file changes)
    changed: list[str] = []
    for sub, ratio in subsets:
        bar = progress(len(sub.modules), f"merging {sub.path.name} x{ratio:g}")
        for name in sub.modules:
            key = names[name]
            if key not in work:
                out_f, in_f = state[key].shape
                layer = nn.Linear(in_f, out_f, bias=False, device="meta")
                layer.weight = nn.Parameter(state[key].to(working_device, dtype), requires_grad=False)
                work[key] = layer
                changed.append(key)
            live = {name: Target(name, work[key], 0, key, "linear")}
            with torch.no_grad():
                delta = module_delta(sub, name, live, multiplier=ratio)
                if delta is not None:
                    work[key].weight.add_(delta.weight().to(working_device, dtype))
                _merge_bias(state, key, sub, name, ratio, changed)
            bar.update(1)
        bar.close()
    for key, layer in work.items():
        state[key] = layer.weight.data.to(state[key].device)
    return changed


def _merge_bias(state: dict[str, Tensor], key: str, file: AdapterFile, name: str, ratio: float, changed: list[str]):
    """A full module's bias change (LyCORIS ``diff_b``): b += ratio · diff_b, as the adapter layer's merge does."""
    from .layers import AdapterWeights

    if file.algos[name] != "full" or "diff_b" not in file.modules[name]:
        return
    bias_key = key.removesuffix(".weight") + ".bias"
    if bias_key not in state:
        raise ValueError(f"{file.source}: {name} changes a bias ({name}.diff_b) but the model has no {bias_key}")
    delta = AdapterWeights.from_file(file.modules[name], "full", name).delta_bias()
    state[bias_key] = state[bias_key].float() + ratio * delta.float().to(state[bias_key].device)
    if bias_key not in changed:
        changed.append(bias_key)


def unplaced_modules(files_: Sequence[AdapterFile], given: Sequence[str]) -> dict[str, int]:
    """{prefix: module count} of the files' modules whose model file was not given (``given``: the prefixes)."""
    counts: dict[str, int] = {}
    for f in files_:
        for name in f.modules:
            prefix = files.prefix_of(name)
            if prefix not in given:
                counts[prefix] = counts.get(prefix, 0) + 1
    return counts


def shuffle_ranks(state: dict[str, Tensor], generator: torch.Generator | None = None) -> None:
    """sd-scripts' ``--shuffle``: permute each LoRA module's rank axis (``up[:, p]``, ``down[p]``), in place. ΔW =
    up @ down is unchanged; only the order of the rank components in the file is."""
    for key in [k for k in state if k.endswith(".lora_down.weight")]:
        up_key = key.replace(".lora_down.", ".lora_up.")
        perm = torch.randperm(state[key].shape[0], generator=generator)
        state[key] = state[key][perm].contiguous()
        state[up_key] = state[up_key][:, perm].contiguous()


def load_adapters_converting(paths: Sequence[str], conversion: LoraConversion) -> list[AdapterFile]:
    """Adapter files for a family's tools: kohya / LyCORIS files as :func:`~networks.deltas.load_adapters`, PEFT /
    diffusers / ai-toolkit files converted to kohya names first (the family's ``conversion``, exact)."""
    import importlib
    from pathlib import Path

    from library.files.weights import load_state_dict

    from .deltas import adapter_from_state_dict

    formats = importlib.import_module(conversion.module)
    out, errors = [], []
    for p in paths:
        try:
            state, metadata = load_state_dict(p)
            if formats.is_peft(state):
                logger.info("%s: PEFT / diffusers names, converted to kohya names", p)
                state = formats.peft_to_kohya(state, str(p))
            out.append(adapter_from_state_dict(Path(p), state, metadata))
        except ValueError as e:
            errors += problems_of(e)
    if errors:
        raise ConfigError(errors, "adapter files")
    return out
