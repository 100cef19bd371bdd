"""The metadata formats of saved files (``ss_*``, ModelSpec, ``sshs_*`` hashes), with no run knowledge.

Metadata written into saved files: sd-scripts' ``ss_*`` keys, ModelSpec 1.0.1 and the A1111 hashes.

Readers: A1111's Lora extension uses ``ss_output_name`` (alias), ``sshs_model_hash`` (the LoRA hash),
``ss_base_model_version`` (SD version filter) and ``ss_tag_frequency``; civitai and ComfyUI save nodes use
``modelspec.*``. All values are strings (safetensors metadata is str -> str).
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import mimetypes
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

MODELSPEC_VERSION = "1.0.1"
# Kept even with --no_metadata (sd-scripts' minimum set).
MINIMAL_SS_KEYS = (
    "ss_v2",
    "ss_base_model_version",
    "ss_network_module",
    "ss_network_dim",
    "ss_network_alpha",
    "ss_network_args",
)


def to_str_values(values: Mapping[str, Any]) -> dict[str, str]:
    """Stringify metadata values the way sd-scripts does: JSON for dicts/lists, ``str`` otherwise; None dropped."""
    out = {}
    for k, v in values.items():
        if v is None:
            continue
        out[k] = json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list, tuple)) else str(v)
    return out


def sshs_hashes(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> tuple[str, str]:
    """``(sshs_model_hash, sshs_legacy_hash)`` as sd-scripts and the A1111 additional-networks extension compute them.

    The file is re-serialised in memory with only the ``ss_*`` metadata, so editing other metadata later does not
    change the hash. model hash = sha256 of the bytes after the safetensors header; legacy hash = first 8 hex
    digits of sha256 of the 64 KiB at offset 1 MiB.
    """
    from safetensors.torch import save

    ss_only = {k: v for k, v in metadata.items() if k.startswith("ss_")}
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=ss_only or None)
    header_len = int.from_bytes(data[:8], "little")
    model_hash = hashlib.sha256(data[8 + header_len :]).hexdigest()
    legacy_hash = hashlib.sha256(data[0x100000 : 0x100000 + 0x10000]).hexdigest()[:8]
    return model_hash, legacy_hash


def with_hashes(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` plus ``sshs_model_hash`` / ``sshs_legacy_hash`` for the tensors about to be saved."""
    model_hash, legacy_hash = sshs_hashes(tensors, metadata)
    return {**metadata, "sshs_model_hash": model_hash, "sshs_legacy_hash": legacy_hash}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a whole file (A1111's "new" model hash, ``ss_new_sd_model_hash``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_legacy_hash(path: str | os.PathLike) -> str:
    """A1111's old 8-hex model hash: sha256 of the 64 KiB at offset 1 MiB (``ss_sd_model_hash``)."""
    with open(path, "rb") as f:
        f.seek(0x100000)
        return hashlib.sha256(f.read(0x10000)).hexdigest()[:8]


def model_source_metadata(path: str | os.PathLike, prefix: str = "ss_sd_model") -> dict[str, str]:
    """``ss_sd_model_name`` and, for a single file, its old and new hashes (``ss_vae_*`` with prefix ``ss_vae``)."""
    path = Path(path)
    out = {f"{prefix}_name": path.name}
    if path.is_file():
        new_prefix = prefix.replace("ss_", "ss_new_", 1)
        out[f"{prefix}_hash"] = file_legacy_hash(path)
        out[f"{new_prefix}_hash"] = file_sha256(path)
    return out


def thumbnail_data_url(value: str) -> str:
    """``--metadata_thumbnail``: a data: URL as given, or an image file turned into one."""
    if value.startswith("data:"):
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--metadata_thumbnail: {value} is neither a data: URL nor an existing image file")
    mime = mimetypes.guess_type(path.name)[0] or "image/png"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


SPEC_PREDICTION_TYPES = {"epsilon": "epsilon", "v": "v", "v_prediction": "v"}  # ours/diffusers' -> ModelSpec's


def modelspec(
    *,
    architecture: str,
    implementation: str,
    title: str,
    resolution: tuple[int, int] | int,
    prediction_type: str | None = "epsilon",
    timestep_range: tuple[int, int] | None = None,
    encoder_layer: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """ModelSpec 1.0.1 keys (``modelspec.*``), as sd-scripts' sai_model_spec writes them.

    ``architecture`` e.g. ``stable-diffusion-xl-v1-base/lora``; ``prediction_type`` "epsilon" or "v" (a diffusers
    "v_prediction" is written as "v"); any other (a flow model's velocity, None) writes no ``modelspec.prediction_type``:
    the spec knows only those two, and sd-scripts writes none for FLUX; ``resolution`` (width, height) or one size; ``extra``: author, description,
    license, tags, usage_hint, thumbnail, merged_from, trigger_phrase, preprocessor, is_negative_embedding (None
    values are skipped).
    """
    w, h = (resolution, resolution) if isinstance(resolution, int) else resolution
    spec: dict[str, Any] = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": architecture,
        "modelspec.implementation": implementation,
        "modelspec.title": title,
        "modelspec.resolution": f"{w}x{h}",
        "modelspec.date": _dt.datetime.now().replace(microsecond=0).isoformat(),
        "modelspec.prediction_type": SPEC_PREDICTION_TYPES.get(prediction_type or ""),
        "modelspec.implementation_version": f"sdtrain/{_version()}",
    }
    if spec["modelspec.prediction_type"] is None:
        del spec["modelspec.prediction_type"]
    if timestep_range is not None:
        spec["modelspec.timestep_range"] = f"{timestep_range[0]},{timestep_range[1]}"
    if encoder_layer is not None:
        spec["modelspec.encoder_layer"] = str(encoder_layer)
    for key, value in (extra or {}).items():
        if value is not None:
            spec[f"modelspec.{key}"] = value
    return to_str_values(spec)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sdtrain")
    except Exception:
        return "unknown"


def minimal(metadata: Mapping[str, str]) -> dict[str, str]:
    """What ``--no_metadata`` keeps: the minimal ss_* keys and every modelspec key."""
    return {k: v for k, v in metadata.items() if k in MINIMAL_SS_KEYS or k.startswith("modelspec.")}
