"""Adapter files applied to a loaded model for inference (the minimal inference scripts' ``--lora_weights``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .inject import network_from_file


def apply_adapter_files(
    files: Sequence[tuple[Path, float]], roots: Any, merge: bool, device: Any, log: logging.Logger
) -> list[Any]:
    """The adapter ``files`` (path, multiplier) on the model of ``roots`` (``family.adapter_roots(parts)``): merged
    into its weights with ``merge`` or when there are several (live adapters cannot be stacked on one module yet;
    merging is exact for every algorithm, but their multipliers are then fixed), else one live adapter on
    ``device`` (an interactive ``--m`` changes its multiplier). Said on the script's ``log``; returns the live
    networks."""
    if len(files) > 1 and not merge:
        merge = True
        log.info("%d LoRA files: merged into the weights (live adapters cannot be stacked yet), so an interactive "
                 "--m cannot change their multipliers", len(files))  # fmt: skip
    live = []
    for path, multiplier in files:
        network = network_from_file(path, roots)
        network.set_multiplier(multiplier)
        if merge:
            network.merge_into_base()
            log.info("merged %s (multiplier %s)", path, multiplier)
        else:
            network.to(device)
            live.append(network)
            log.info("applied %s (multiplier %s)", path, multiplier)
    return live
