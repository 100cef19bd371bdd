"""Helpers for the tool tests: adapter files with random (trained-looking) tensors on the tiny models, each
module's base weight shape, and ΔW of a file through the independent formulas of ``_networks_helpers``."""

from __future__ import annotations

import copy

import torch
from _networks_helpers import make_config, oracle_delta, oracle_weight, perturb

from library.families import get_family
from library.files.weights import load_state_dict
from networks import inject
from networks.files import group_by_module, module_index


def write_adapter(parts, path, *network_args, dim=8, alpha=4.0, seed=0, module="networks.lora", metadata=None):
    """An adapter of ``network_args`` on (a copy of) ``parts`` with random tensors, saved to ``path``."""
    family = get_family(parts.family)
    ours = copy.deepcopy(parts)
    network = inject(make_config(*network_args, module=module, dim=dim, alpha=alpha), family.adapter_roots(ours))
    perturb(network, seed=seed)
    meta = {"ss_base_model_version": family.base_model_version(parts.prediction_type), "ss_output_name": "t"}
    network.save(path, metadata={**meta, **(metadata or {})})
    return path


def base_weights(parts) -> dict:
    """{kohya name: base weight} of every adaptable module of ``parts`` (canonical names, no aliases)."""
    family = get_family(parts.family)
    return {t.name: t.module.weight.detach() for t in module_index(family.adapter_roots(parts)).values()}


def file_deltas(path, weights: dict) -> dict[str, torch.Tensor]:
    """{module: ΔW in the base weight's shape} of an adapter file, by the oracle formulas (DoRA: W' − W)."""
    state, _ = load_state_dict(path)
    out = {}
    for name, tensors in group_by_module(state).items():
        if "w_norm" in tensors:
            continue
        w = weights[name].float()
        if "dora_scale" in tensors:
            out[name] = oracle_weight(w, tensors, 1.0) - w
        else:
            out[name] = oracle_delta({k: v.float() for k, v in tensors.items()}, tuple(w.shape))
    return out


def ranks(path) -> dict[str, int]:
    state, _ = load_state_dict(path)
    return {k.removesuffix(".lora_down.weight"): v.shape[0] for k, v in state.items() if k.endswith("lora_down.weight")}


def svdvals(delta: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(delta.double().reshape(delta.shape[0], -1))
