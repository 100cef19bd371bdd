"""Merging adapters into FLUX.1 / Chroma single files as users have them (the engine of flux_merge_lora.py).

The files are merged as state dicts, under their own keys, as ComfyUI applies a LoRA: a module named
``lora_unet_<BFL module path with dots as underscores>`` changes the BFL weight ``<module path>.weight`` (with or
without ``model.diffusion_model.``), ``lora_te1_<path>`` the CLIP-L file's ``text_model.<path>.weight`` (with or without
``text_model.``), ``lora_te3_<path>`` the T5 file's ``<path>.weight``:

    W <- W + ratio · ΔW          (every algorithm through the training code's ΔW: LoRA (α/r)·up@down, LoHa, LoKr,
                                  full, (IA)³, GLoRA, OFT; DoRA's W' − W on the current W, so files apply in order)
    b <- b + ratio · diff_b      (full modules' bias change)

A fused module (``img_attn.qkv``, ``linear1``) is one BFL weight, so its ΔW is added to it whole: the same ΔW the
adapter gives the diffusers leaves row by row. Only the weights a file changes are converted to the working precision
(float8 files included); the others keep their tensors until the output is cast to the save precision. A diffusers-
named transformer file is merged through the BFL names (``library.families.flux.keys``) and written back under its
own names.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from library.cli.problems import ConfigError, problems_of

from . import files
from .deltas import AdapterFile, module_delta, resolve_index
from .targets import Target
from .tool_common import progress

logger = logging.getLogger(__name__)
PREFIXES = {"lora_unet": "--flux_model", "lora_te1": "--clip_l", "lora_te3": "--t5xxl"}


def module_names(state: Mapping[str, Tensor], prefix: str) -> dict[str, str]:
    """{kohya module name: weight key} of every matrix in a single file, by ComfyUI's rule (``prefix`` +
    ``_`` + module path with dots as underscores). BFL keys are named without ``model.diffusion_model.``; CLIP-L
    keys are named with ``text_model.`` whether or not the file has it (as sd-scripts writes them), and also without
    it (as tools under transformers 5 wrote them)."""
    from library.families.flux.keys import BFL_PREFIX

    out = {}
    for key, tensor in state.items():
        if not key.endswith(".weight") or tensor.dim() != 2:
            continue
        module = key.removesuffix(".weight").removeprefix(BFL_PREFIX)
        if prefix == "lora_te1":
            module = module.removeprefix("cond_stage_model.transformer.").removeprefix("text_encoders.clip_l."
                                                                                      "transformer.")  # fmt: skip
            module = module if module.startswith("text_model.") else f"text_model.{module}"
            out.setdefault(f"{prefix}_{module.removeprefix('text_model.').replace('.', '_')}", key)
        out[f"{prefix}_{module.replace('.', '_')}"] = key
    return out


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
    files_: Sequence[AdapterFile],
    ratios: Sequence[float],
    *,
    working_device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[str]:
    """Merge the ``prefix`` modules of every file (at its ratio, in order) into ``state`` in place; returns the keys
    changed (their tensors now ``dtype``, on the device they were on). ``ValueError`` naming each file and module
    that does not fit the file's weights (another model, another size)."""
    names = module_names(state, prefix)
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


def load_flux_adapters(paths: Sequence[str]) -> list[AdapterFile]:
    """Adapter files for the FLUX tools: kohya / LyCORIS files as :func:`~networks.deltas.load_adapters`, PEFT /
    diffusers / ai-toolkit files converted to kohya names first (``library.families.flux.lora_formats``, exact)."""
    from pathlib import Path

    from library.cli.problems import ConfigError, problems_of
    from library.families.flux.lora_formats import is_peft, peft_to_kohya
    from library.files.weights import load_state_dict

    from .deltas import adapter_from_state_dict

    out, errors = [], []
    for p in paths:
        try:
            state, metadata = load_state_dict(p)
            if is_peft(state):
                logger.info("%s: PEFT / diffusers names, converted to kohya names", p)
                state = peft_to_kohya(state, str(p))
            out.append(adapter_from_state_dict(Path(p), state, metadata))
        except ValueError as e:
            errors += problems_of(e)
    if errors:
        raise ConfigError(errors, "adapter files")
    return out
