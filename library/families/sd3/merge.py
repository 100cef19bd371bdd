"""Merge SD3 / SD3.5 parts into one SAI single file (sd-scripts' tools/merge_sd3_safetensors.py, same flags).

    python tools/merge_sd3_safetensors.py --dit sd3.5_large.safetensors --clip_l clip_l.safetensors \
        --clip_g clip_g.safetensors --t5xxl t5xxl_fp16.safetensors --output sd3.5_large_all.safetensors

Each part goes under its SAI prefix: the MMDiT under ``model.diffusion_model.``, the VAE (SAI / ldm names) under
``first_stage_model.``, CLIP-L / CLIP-G / T5-XXL (transformers' names, as ComfyUI's files) under
``text_encoders.{clip_l,clip_g,t5xxl}.transformer.``; a key that already carries its prefix is kept (so an SAI file
with its VAE or encoders can be the ``--dit``). A part given after another replaces the keys they share (``--vae``
replaces the VAE inside ``--dit``), as sd-scripts. The ``--dit`` file's metadata is kept. ``--save_precision``
casts floating tensors (sd-scripts' names: fp32, fp16, bf16, fp8 / fp8_e4m3fn, fp8_e5m2...; default as stored); ``--device`` is where each tensor is cast.

The output is streamed: one input tensor is in memory at a time (sd-scripts' ``mem_eff_save_file``), written to a
temporary file renamed onto ``--output`` when complete. Each part is checked to be what its flag says before
anything is written.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from library.files.weights import SafetensorsReader, atomic_path

logger = logging.getLogger(__name__)

# flag -> (the SAI prefix of its keys, a key every such part has (without its prefix), what the part is)
PARTS = {
    "dit": ("model.diffusion_model.", "x_embedder.proj.weight", "an SD3 MMDiT (SAI names: joint_blocks.N...)"),
    "vae": ("first_stage_model.", "decoder.conv_in.weight", "an SD3 VAE (SAI / ldm names: encoder.down.N...)"),
    "clip_l": ("text_encoders.clip_l.transformer.", "text_model.embeddings.token_embedding.weight",
               "a CLIP-L text encoder (transformers' names: text_model...)"),
    "clip_g": ("text_encoders.clip_g.transformer.", "text_model.embeddings.token_embedding.weight",
               "a CLIP-G text encoder (transformers' names: text_model...)"),
    "t5xxl": ("text_encoders.t5xxl.transformer.", "encoder.block.0.layer.0.SelfAttention.q.weight",
              "a T5-XXL encoder (transformers' names: encoder.block.N...)"),
}  # fmt: skip
SAI_PREFIXES = tuple(prefix for prefix, _, _ in PARTS.values())
# sd-scripts' --save_precision names (library/utils.py str_to_dtype) that safetensors can store
SAVE_PRECISIONS = {
    **{name: torch.bfloat16 for name in ("bf16", "bfloat16")},
    **{name: torch.float16 for name in ("fp16", "float16")},
    **{name: torch.float32 for name in ("fp32", "float32", "float")},
    **{name: torch.float8_e4m3fn for name in ("fp8", "float8", "fp8_e4m3fn", "e4m3fn", "float8_e4m3fn")},
    **{name: torch.float8_e5m2 for name in ("fp8_e5m2", "e5m2", "float8_e5m2")},
}
# safetensors' dtype names (the inverse of SafetensorsReader.DTYPES)
DTYPE_NAMES = {dtype: name for name, dtype in SafetensorsReader.DTYPES.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dit", required=True, help="the MMDiT .safetensors (may hold the VAE and text encoders)")
    parser.add_argument("--vae", help="the VAE .safetensors (may be omitted when the --dit file holds it)")
    parser.add_argument("--clip_l", help="the CLIP-L .safetensors")
    parser.add_argument("--clip_g", help="the CLIP-G .safetensors")
    parser.add_argument("--t5xxl", help="the T5-XXL .safetensors")
    parser.add_argument("--output", default="merged_model.safetensors", help="the SAI single file to write")
    parser.add_argument("--device", default="cpu", help="where each tensor is cast (cpu, cuda, cuda:N)")
    parser.add_argument("--save_precision", type=str, default=None, choices=list(SAVE_PRECISIONS),
                        help="the dtype of floating tensors in the output (default: as stored)")  # fmt: skip
    return parser


def plan_merge(paths: dict[str, str | None]) -> dict[str, tuple[SafetensorsReader, str]]:
    """The output's keys, each with the reader and source key it comes from, in the order written; ``paths``: flag
    (``dit vae clip_l clip_g t5xxl``) -> file or None. Later parts replace the keys they share with earlier ones.

    Raises:
        ValueError: every unreadable file and every part that is not what its flag says, at once.
    """
    problems, readers = [], {}
    for flag, path in paths.items():
        if path is None:
            continue
        if not Path(path).is_file():
            problems.append(f"--{flag} {path}: no such file")
        elif Path(path).suffix.lower() != ".safetensors":
            problems.append(f"--{flag} {path}: expected a .safetensors file")
        else:
            try:
                readers[flag] = SafetensorsReader(path)
            except (OSError, ValueError, UnicodeDecodeError) as e:
                problems.append(f"--{flag} {path}: not a readable safetensors file ({e})")
    plan: dict[str, tuple[SafetensorsReader, str]] = {}
    for flag, reader in readers.items():
        prefix, probe, what = PARTS[flag]
        keys = {(k if k.startswith(SAI_PREFIXES if flag == "dit" else prefix) else prefix + k): k for k in reader}
        if prefix + probe not in keys:
            problems.append(f"--{flag} {paths[flag]}: no key {probe!r} (or {prefix + probe!r}); give {what}")
            continue
        replaced = [k for k in keys if k in plan]
        if replaced:
            logger.info("--%s replaces %d keys of the parts before it", flag, len(replaced))
        plan.update({out: (reader, src) for out, src in keys.items()})
    if problems:
        raise ValueError("; ".join(problems))
    return plan


def write_streamed(plan: dict[str, tuple[SafetensorsReader, str]], output: str | Path, metadata: dict[str, str],
                   dtype: torch.dtype | None = None, device: str = "cpu") -> Path:  # fmt: skip
    """Write the planned tensors as one safetensors file, one source tensor in memory at a time, atomically.
    ``dtype``: floating tensors cast to it (on ``device``). The header (little-endian u64 size, JSON padded with
    spaces to 8 bytes) lists each key's dtype, shape and ``[begin, end)`` byte range after the header."""

    def out_dtype(reader: SafetensorsReader, key: str) -> torch.dtype:
        stored = reader.DTYPES[reader.entries[key]["dtype"]]
        return dtype if dtype is not None and stored.is_floating_point else stored

    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, (reader, src) in plan.items():
        shape, target = list(reader.shape(src)), out_dtype(reader, src)
        size = torch.Size(shape).numel() * target.itemsize
        header[key] = {"dtype": DTYPE_NAMES[target], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with atomic_path(output) as tmp, open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for reader, src in plan.values():
            tensor = reader[src]
            target = out_dtype(reader, src)
            if tensor.dtype != target:
                tensor = tensor.to(device).to(target).cpu()
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return Path(output)


def merge(dit: str, vae: str | None = None, clip_l: str | None = None, clip_g: str | None = None,
          t5xxl: str | None = None, output: str = "merged_model.safetensors", device: str = "cpu",
          save_precision: str | None = None) -> Path:  # fmt: skip
    """sd-scripts' ``merge_safetensors``: the parts under their SAI prefixes in one file at ``output`` (``device``:
    where each tensor is cast; ``save_precision``: one of :data:`SAVE_PRECISIONS`, None: as stored)."""
    plan = plan_merge({"dit": dit, "vae": vae, "clip_l": clip_l, "clip_g": clip_g, "t5xxl": t5xxl})
    metadata = SafetensorsReader(dit).metadata
    logger.info("writing %d keys to %s", len(plan), output)
    return write_streamed(plan, output, metadata, SAVE_PRECISIONS.get(save_precision), device)
