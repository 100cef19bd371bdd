"""The loading machinery every family uses: shipped configs, building a module without allocating weights and loading a
state dict into it after checking every key and shape, lazy readers of weight files, and telling which registered
family a file or folder holds (our ``sdtrain.family`` metadata, else each family's ``spec.detect`` /
``spec.detect_folder``).

A mismatch between weights and an architecture is a ``ValueError`` naming the file, the component, the config used
and the first differing keys. Each family's own loader is in its folder (``sd/loading.py``, ``flux/loading.py``...).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from library.files.weights import (
    PICKLE_SUFFIXES,
    SAFETENSORS_SUFFIXES,
    SafetensorsReader,
    load_state_dict,
)

from .base import Parts
from .registry import FAMILIES

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
META_CONFIGS = "sdtrain.configs"
META_FAMILY = "sdtrain.family"
WEIGHT_SUFFIXES = SAFETENSORS_SUFFIXES + PICKLE_SUFFIXES


@cache
def _config_text(stem: str) -> str:
    return (CONFIG_DIR / f"{stem}.json").read_text()


def shipped_configs(stem: str) -> dict:
    """The component configs of a released model (``sd15``, ``sd2-512``, ``sd2-768-v``, ``sdxl-base``), a fresh copy."""
    return json.loads(_config_text(stem))


# ------------------------------------------------------------------------------------------------ detection
def family_of_state_dict(sd: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> str | None:
    """The registered family name ("sd1" | "sd2" | "sdxl" | ...) of a single-file state dict (keys -> tensors, or
    objects with ``.shape``), or None if it is no model of a registered family. Our metadata decides first, then the
    families' own ``spec.detect``, in registration order."""
    if metadata and metadata.get(META_FAMILY) in FAMILIES:
        return metadata[META_FAMILY]
    for name, family in FAMILIES.items():
        if family.spec.detect is not None and family.spec.detect(sd, metadata or {}):
            return name
    return None


def unsupported_model(sd: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> str | None:
    """Why a single file no family detects cannot be loaded, when a family recognises it (``spec.refuse``: "an
    SDXL refiner, which is not supported"), else None."""
    for family in FAMILIES.values():
        reason = family.spec.refuse(sd, metadata or {}) if family.spec.refuse is not None else None
        if reason:
            return reason
    return None


def family_of_folder(folder: Path) -> str | None:
    """The registered family name ("sd1" | "sd2" | "sdxl" | ...) whose ``spec.detect_folder`` takes a diffusers
    folder, or None if ``folder`` is no model of a registered family."""
    for name, family in FAMILIES.items():
        if family.spec.detect_folder is not None and family.spec.detect_folder(folder):
            return name
    return None


def check_model_path(path: str | Path) -> Path:
    """The path as a ``Path`` if it is a weight file or a diffusers folder; else a clear error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no such file or folder (expected a diffusers model folder or a .safetensors / .ckpt checkpoint)"
        )
    if path.is_dir():
        if family_of_folder(path) is None:
            raise ValueError(
                f"{path}: this folder is not a diffusers Stable Diffusion model (no unet/config.json); pass a folder "
                "with model_index.json, unet/, vae/ and text_encoder/ subfolders, or a .safetensors / .ckpt file"
            )
    elif path.suffix.lower() not in WEIGHT_SUFFIXES:
        raise ValueError(f"{path}: unsupported model file type {path.suffix!r}; expected {', '.join(WEIGHT_SUFFIXES)}")
    return path


# ------------------------------------------------------------------------------------------------ building modules
def shape_reader(state: Mapping[str, Any]) -> Callable[[str], tuple[int, ...]]:
    """``key -> shape`` of a state dict, without reading tensors where the mapping can (SafetensorsReader, lazy
    key-converting views)."""
    if callable(getattr(state, "shape", None)):
        return lambda k: tuple(state.shape(k))
    return lambda k: tuple(state[k].shape)


# A part's config read from its weights' shapes (``state``, its shape reader, the candidate configs for what shapes
# cannot tell), or None when the shapes leave something open.
Derive = Callable[[Mapping[str, Any], Callable[[str], tuple[int, ...]], list[dict]], "dict | None"]


def _fit(
    model: nn.Module, state: Mapping[str, Tensor], adapt: Callable | None
) -> tuple[Mapping[str, Tensor], list[str], list[str], list[tuple[str, tuple, tuple]]]:
    """``state`` as ``model`` names it (``adapt``), and what keeps it from loading: missing keys, unexpected keys and
    ``(key, file shape, model shape)`` mismatches. Shapes are read without reading tensors where the mapping can
    (SafetensorsReader, lazy key-converting views)."""
    if adapt is not None:
        state = adapt(state, model)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shape = shape_reader(state)
    wrong = [(k, tuple(shape(k)), tuple(v.shape)) for k, v in expected.items()
             if k in state and tuple(shape(k)) != tuple(v.shape)]  # fmt: skip
    return state, missing, unexpected, wrong


def _assign(model: nn.Module, state: Mapping[str, Tensor], dtype: Any, device: Any) -> nn.Module:
    """Load ``state`` into the weightless ``model``: each tensor cast to ``dtype`` (floating point only) and placed on
    ``device`` before it is assigned, one at a time (no second copy of the model; on the device the host holds one
    tensor at a time; no diffusers ``ModelMixin.to`` warnings)."""
    state = {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device=device)
             for k, v in state.items()}  # fmt: skip
    model.load_state_dict(state, strict=True, assign=True)
    return model


def instantiate(
    factory: Callable[[], nn.Module],
    state: Mapping[str, Tensor],
    what: str,
    path: Path,
    source: str,
    dtype: Any,
    adapt: Callable[[Mapping[str, Tensor], nn.Module], Mapping[str, Tensor]] | None = None,
    device: Any = None,
) -> nn.Module:
    """Build ``factory()`` without allocating weights, check ``state`` fits it, then load ``state`` into it, each
    tensor cast to ``dtype`` (floating point only) and placed on ``device`` (None: where it is) as it is read.

    ``adapt(state, model)`` renames ``state`` for the built model first (HF text encoders: see ``hf_for_model``).
    Raises ``ValueError`` naming ``path``, the component and the config ``source`` when keys or shapes differ.
    """
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = factory()
    state, missing, unexpected, wrong = _fit(model, state, adapt)
    if missing or unexpected or wrong:
        shapes = [f"{k}: file {f} vs model {m}" for k, f, m in wrong]
        details = "; ".join(
            f"{label} {len(items)} (e.g. {', '.join(items[:3])})"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatches", shapes))
            if items
        )
        raise ValueError(
            f"{path}: the {what} weights do not fit the architecture of {source}: {details}. Is this the right "
            "model family and a complete checkpoint?"
        )
    return _assign(model, state, dtype, device)


def instantiate_fitting(
    candidates: list[tuple[dict, str]],
    factory: Callable[[Mapping], Callable[[], nn.Module]],
    state: Mapping[str, Any],
    what: str,
    path: Path,
    dtype: Any,
    device: Any,
    adapt: Callable | None = None,
    derive: Derive | None = None,
) -> nn.Module:
    """The first of ``candidates`` (``(config, where it comes from)``) whose keys and shapes fit ``state``, loaded as
    :func:`instantiate` does (the DiT families' parts, whose files carry no config: stored, released, tiny), then the
    config ``derive`` reads from the weights' shapes (pruned, distilled or resized variants: other depths, widths,
    MLP widths); a ``ValueError`` naming the file, the part and, per candidate, the first differing keys when none
    fits."""
    from accelerate import init_empty_weights

    problems = []
    if derive is not None:
        derived = derive(state, shape_reader(state), [dict(c) for c, _ in candidates])
        if derived is not None and all(derived != c for c, _ in candidates):
            candidates = [*candidates, (derived, "the shapes of its weights")]
    for config, source in candidates:
        with init_empty_weights():
            model = factory(config)()
        named, missing, unexpected, wrong = _fit(model, state, adapt)
        if not (missing or unexpected or wrong):
            log.info("%s: %s built from %s", path, what, source)
            return _assign(model, named, dtype, device)
        shapes = [f"{k}: file {f} vs {m}" for k, f, m in wrong]
        found = [f"{label} {', '.join(items[:2])}" for label, items in
                 (("missing", missing), ("unexpected", unexpected), ("shapes", shapes)) if items]  # fmt: skip
        problems.append(f"{source}: {'; '.join(found)}")
    raise ValueError(f"{path}: the {what} weights fit no known architecture ({' | '.join(problems)}); is this the "
                     "right file for this part?")  # fmt: skip


def check_weights_path(
    path: str | Path, flag: str, variant_of_folder: Callable[[Path], str | None], expected: str, not_folder: str
) -> Path:
    """``path`` of a DiT family's model: an existing .safetensors file or a folder ``variant_of_folder`` recognises;
    else an error naming ``flag`` and the path (``expected``: what it should be; ``not_folder``: why a folder is not
    one)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{flag} {path}: no such file or folder (expected {expected})")
    if path.is_file() and path.suffix.lower() not in WEIGHT_SUFFIXES:
        raise ValueError(f"{flag} {path}: unsupported file type {path.suffix!r}; expected .safetensors")
    if path.is_dir() and variant_of_folder(path) is None:
        raise ValueError(f"{flag} {path}: {not_folder}")
    return path


def read_weights(path: Path) -> tuple[Mapping[str, Any], dict[str, str]]:
    """A lazy reader for .safetensors (nothing read until asked), else the whole (pickle) file, and its metadata."""
    if path.suffix.lower() in SAFETENSORS_SUFFIXES:
        try:
            reader = SafetensorsReader(path)
        except (ValueError, UnicodeDecodeError) as e:  # a truncated or corrupt header
            raise ValueError(f"{path}: not a valid safetensors file ({e})") from e
        return reader, dict(reader.metadata)
    return load_state_dict(path)


class KeyView(Mapping):
    """``source`` (a dict or a lazy ``SafetensorsReader``) under other names (``names``: new -> source key), read
    when asked: a 9.5 GB T5 file is cast tensor by tensor, never held whole."""

    def __init__(self, source: Mapping[str, Any], names: Mapping[str, str]) -> None:
        self.source, self.names = source, dict(names)

    def __getitem__(self, key: str) -> Tensor:
        return self.source[self.names[key]]

    def shape(self, key: str) -> torch.Size:
        source, name = self.source, self.names[key]
        return torch.Size(source.shape(name) if callable(getattr(source, "shape", None)) else source[name].shape)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _tf_dtype(dtype: Any) -> dict:
    """transformers >= 4.56 names the load dtype ``dtype`` (``torch_dtype`` is deprecated in 5)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def finish(parts: Parts, device: Any) -> Parts:
    """Move to ``device``, set eval mode and freeze every module (trainers unfreeze what they train)."""
    for module in (parts.denoiser, parts.vae, *parts.text_encoders):
        module.to(device).eval().requires_grad_(False)
    parts.text_encoder_extras = [
        {k: v.to(device) for k, v in extra.items()} for extra in parts.text_encoder_extras
    ] or [{} for _ in parts.text_encoders]
    return parts
