"""Model families: everything that differs between the model architectures (SD1, SD2, SDXL, FLUX.1, Chroma, SD3...)
lives here, one folder per family (``sd/``, ``flux/``, ``sd3/``), found by the registry (``registry.py``; installed
plug-ins too), with the parts several families share (``encoders/``, ``autoencoders/``, the loading helpers).

from library.families import get_family, detect_family
family = detect_family("model.safetensors")          # or get_family("sdxl")
parts = family.load("model.safetensors", dtype=torch.bfloat16)
cond = family.encode_prompt(parts, ["a photo of a cat"], max_token_length=225)

The family objects themselves are imported from their folders (``from library.families.sd import SD1``); this
package imports no family folder until the registry is first asked.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from library.families.protocol import ModelFamily

from .base import EPSILON, FLOW_MATCHING, OBJECTIVES, V_PREDICTION, Cond, Parts
from .registry import (
    FAMILIES,
    adapter_families,
    adapter_family_label,
    block_layout,
    block_layout_title,
    default_families,
    family_flags,
    family_title,
    flagged_family,
    get_family,
    register_family,
    ti_keys_of_other_families,
    trained_together,
    unregister_family,
)

__all__ = ["FAMILIES", "Cond", "ModelFamily", "Parts"]
__all__ += ["EPSILON", "V_PREDICTION", "FLOW_MATCHING", "OBJECTIVES"]
__all__ += ["get_family", "detect_family", "select_family", "family_as_flagged", "family_group", "register_family"]
__all__ += ["unregister_family", "trained_together", "family_title", "block_layout", "block_layout_title"]
__all__ += ["adapter_families", "adapter_family_label", "ti_keys_of_other_families", "family_flags"]
__all__ += ["flagged_family", "default_families", "tool_family_flags", "family_flag_problems"]


class _Shape:
    """A stand-in tensor that only knows its shape (for detection without reading weights)."""

    def __init__(self, shape: Any) -> None:
        self.shape = tuple(shape)


def detect_family(source: str | os.PathLike | Mapping[str, Any]) -> ModelFamily:
    """The family of a single-file state dict, a weight file or a diffusers folder (reads only keys and shapes
    of .safetensors files). Raises ``ValueError`` when it is no Stable Diffusion model."""
    from .loading import check_model_path, family_of_folder, family_of_state_dict, unsupported_model

    if isinstance(source, Mapping):
        (sd, metadata), where = (source, {}), "this state dict"
    else:
        path = check_model_path(source)
        if path.is_dir():
            return FAMILIES[family_of_folder(path)]
        (sd, metadata), where = _peek(path), str(path)
    name = family_of_state_dict(sd, metadata)
    if name is None:
        what = unsupported_model(sd, metadata) or "no Stable Diffusion model (no UNet keys)"
        raise ValueError(f"{where}: {what}; expected {_titles(FAMILIES.values(), 'or')} model")
    return FAMILIES[name]


def _titles(families: Iterable[ModelFamily], conjunction: str) -> str:
    """ "an SD1.x, SD2.x or SDXL": the families' titles as a list in a sentence."""
    titles = [f.spec.title for f in families]
    listed = f"{', '.join(titles[:-1])} {conjunction} {titles[-1]}" if len(titles) > 1 else "".join(titles)
    return f"{'an' if listed[:1] in 'AEFHILMNORSX' else 'a'} {listed}"


def _peek(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    from library.files.weights import load_state_dict

    if path.suffix.lower() != ".safetensors":
        return load_state_dict(path)
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: _Shape(f.get_slice(k).get_shape()) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"{path}: not a valid safetensors file ({e})") from e


def select_family(
    path: str | os.PathLike | None,
    allowed: tuple[str, ...],
    *,
    flagged: str | None = None,
    training: str = "network",
) -> ModelFamily:
    """The family a training script works on: the family the file holds when the script trains it, else the one an
    sd-scripts family flag names (``flagged``, see :func:`flagged_family`: SD1/SD2 scripts take SD2 with ``--v2``;
    sd-scripts needs --v2 for an SD2 file), else the script's first. Raises ``ValueError`` naming the file and the
    script to use when the model is of another family (the other family's script of the same ``training`` type:
    "network", "fine_tune", "dreambooth" or "textual_inversion"), or when the flag contradicts the file."""
    detected = None
    if path and Path(path).exists():
        try:
            detected = detect_family(path).name
        except ValueError as e:
            raise ValueError(f"--pretrained_model_name_or_path {e}") from e
    if flagged is not None:
        flag = get_family(flagged).spec.flag
        if flagged not in allowed:
            raise ValueError(f"--{flag} selects {family_title(flagged)}; this script trains {'/'.join(allowed)} models "
                             "only")  # fmt: skip
        if detected in allowed and detected != flagged:
            raise ValueError(f"--{flag} is set but {path} is an {family_title(detected)} model; remove --{flag}")
    name = flagged or (detected if detected in allowed else allowed[0])
    if detected is not None and detected != name:
        spec = get_family(detected).spec
        raise ValueError(f"{path} is an {detected} model but this script trains {name}; use "
                         f"{spec.scripts.get(training, spec.training_script)}")  # fmt: skip
    return get_family(name)


def tool_family_flags() -> dict[str, str]:
    """sd-scripts' family flags a tool takes (without the dashes: ``v2``, ``sdxl``) -> family name: the registry's
    (:func:`family_flags`) less the first family's, which sd-scripts' tools assume when no flag is given."""
    default = next(iter(FAMILIES), None)
    return {flag: name for flag, name in family_flags().items() if name != default}


def family_flag_problems(args: object) -> list[str]:
    """Family flags that contradict each other ("--v2 and --sdxl contradict each other")."""
    given = [f"--{flag}" for flag in tool_family_flags() if getattr(args, flag, False)]
    return [f"{' and '.join(given)} contradict each other"] if len(given) > 1 else []


def family_as_flagged(path: str | os.PathLike, args: object | None = None) -> ModelFamily:
    """The family of the model at ``path`` (read from the file); the family flags set on ``args`` (None: none) for
    sd-scripts compatibility (:func:`tool_family_flags`) must agree with it. ``ValueError`` naming the file, the flag
    and the fix."""
    problems = family_flag_problems(args) if args is not None else []
    if problems:
        raise ValueError(problems[0])
    family = detect_family(path)
    flags = tool_family_flags()
    given = next((flag for flag in flags if getattr(args, flag, False)), None)
    if given is not None and family.name != flags[given]:
        raise ValueError(f"{path} is an {family.name} model but --{given} says {flags[given]}; remove the flag (the "
                         "family is read from the file)")  # fmt: skip
    return family


def family_group(path: str | os.PathLike | None, *, flagged: str | None = None) -> tuple[str, ...]:
    """The families the training script for the model at ``path`` takes (see :func:`trained_together`): the family
    an sd-scripts family flag names (``flagged``, see :func:`flagged_family`) for the tools that
    have one, else read from the file when it exists, else the first family's group."""
    detected = detect_family(path).name if path and Path(path).exists() else None
    return trained_together(flagged or detected or next(iter(FAMILIES)))
