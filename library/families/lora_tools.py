"""What sd-scripts' per-family LoRA tools need from a family whose users hold its model as single files (sd-scripts'
``flux_merge_lora.py`` / ``flux_extract_lora.py``): which file each adapter prefix merges into and under which flag,
which weight key each kohya module name changes, how the denoiser's file is read (its names in the file's layout,
whatever names it was saved with), and which modules a LoRA is extracted for.

The tools themselves (their flags, checks, merging and extraction) are generic: ``networks/single_file_tools.py`` over
the engines in ``networks/``; a family states these descriptions in its folder and its sd-scripts-named scripts are
thin shims joining the two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from library.families.protocol import ModelFamily

    from .loading import KeyView
    from .lora_formats import LoraConversion

ReadModel = Callable[[str, str, bool, str], tuple[dict[str, Tensor], Callable[[dict], dict], dict[str, str]]]
"""(path, loading device, the file was said to have diffusers names (``--diffusers``), its flag) -> (its state dict
in the layout the module names address, a function giving a merged state dict back under the file's own names, the
file's metadata); ``ValueError`` naming the flag for a file that is not the family's."""


@dataclass(frozen=True)
class ModelFile:
    """One single file adapter modules of one kohya ``prefix`` merge into: its tool flag ``--<flag>`` and the flag of
    its output ``--<save_flag>`` (without the dashes, with their ``--help``), and ``module_names(state)`` ->
    {kohya module name: weight key} of every matrix in such a file (ComfyUI's rule on the file's keys)."""

    prefix: str
    flag: str
    save_flag: str
    help: str
    save_help: str
    module_names: Callable[[Mapping[str, Tensor]], dict[str, str]]


@dataclass(frozen=True)
class MergeIntoFiles:
    """A family's merge tool: ``files`` (the denoiser's first: without any of them the LoRAs are merged into one
    LoRA, written to its ``save_flag``), ``read_denoiser`` (the denoiser's file in any of its layouts), ``title``
    ("FLUX" in "write FLUX model files as .safetensors"), ``network_module`` (kept as a merged LoRA's
    ``ss_network_module`` when an input has it) and ``conversion`` (PEFT inputs are converted to kohya names)."""

    title: str
    files: tuple[ModelFile, ...]
    read_denoiser: ReadModel
    network_module: str
    conversion: LoraConversion


@dataclass(frozen=True)
class ExtractFromFiles:
    """A family's extract tool over two denoiser files: ``read(path, flag, lazy)`` -> the file in the layout ``modules``
    addresses (``lazy``: read one tensor at a time; ``ValueError`` naming the flag for a file that is not the
    family's), ``modules(file)`` -> {kohya name: weight key} of the matrices a LoRA is extracted for,
    ``family_of(keys)`` (the metadata's family), ``modelspec(family, title)`` (its ModelSpec keys),
    ``network_module`` (``ss_network_module``) and the ``--help`` of ``--model_org`` / ``--model_tuned``."""

    org_help: str
    tuned_help: str
    read: Callable[[str, str, bool], KeyView]
    modules: Callable[[KeyView], dict[str, str]]
    family_of: Callable[[Sequence[str]], ModelFamily]
    modelspec: Callable[[ModelFamily, str], dict[str, str]]
    network_module: str
