"""``networks/convert_z_image_lora_to_comfy.py``: a Z-Image LoRA between musubi-tuner's kohya names and the names
ComfyUI's Z-Image (``Lumina2``) key map reads, both directions (``--reverse``: ComfyUI -> kohya).

ComfyUI maps ``diffusion_model.<diffusers module path>`` onto its model (``comfy.utils.z_image_to_diffusers``:
``attention.to_q / to_k / to_v`` are row slices of its fused ``qkv``, ``to_out.0`` its ``out``), but registers
``lora_unet_`` names only for its own module paths, so ``lora_unet_layers_0_attention_to_q`` would be skipped there:
this is why musubi-tuner ships a converter of this name. The kohya module name's path is rebuilt by joining its
underscore-separated words into the identifiers Z-Image's module paths have (:data:`IDENTIFIERS`), longest first.
Tensors are not changed (``lora_down`` -> ``lora_A``, ``lora_up`` -> ``lora_B``; alpha and LyCORIS tensors kept), so
each projection keeps its own rank and alpha (musubi-tuner's script instead fuses q / k / v into one block-diagonal
``qkv`` LoRA of three times the rank: the same weights). The source's metadata is kept, with new ``sshs_*`` hashes.
diffusers' ``ZImagePipeline.load_lora_weights`` reads both files.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence

from torch import Tensor

log = logging.getLogger(__name__)

DIT_PREFIX = "diffusion_model."
IDENTIFIERS = tuple(sorted((
    "noise_refiner", "context_refiner", "feed_forward", "adaLN_modulation", "to_q", "to_k", "to_v", "to_out",
    "all_x_embedder", "all_final_layer", "cap_embedder", "t_embedder",
), key=lambda s: -s.count("_")))  # fmt: skip


def module_path(kohya_module: str) -> str:
    """``layers_0_attention_to_out_0`` -> ``layers.0.attention.to_out.0`` (module docstring)."""
    words = kohya_module.split("_")
    parts, i = [], 0
    while i < len(words):
        for ident in IDENTIFIERS:
            n = ident.count("_") + 1
            if "_".join(words[i : i + n]) == ident:
                parts.append(ident)
                i += n
                break
        else:
            parts.append(words[i])
            i += 1
    return ".".join(parts)


def to_comfy(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """kohya -> ComfyUI names; ``ValueError`` naming a key that is not ``lora_unet_``."""
    out = {}
    for key, value in state.items():
        module, _, weight = key.partition(".")
        if not module.startswith("lora_unet_"):
            raise ValueError(f"{key}: not a Z-Image kohya LoRA key (lora_unet_*)")
        weight = weight.replace("lora_up", "lora_B").replace("lora_down", "lora_A")
        out[f"{DIT_PREFIX}{module_path(module[len('lora_unet_') :])}.{weight}"] = value
    return out


def from_comfy(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """ComfyUI -> kohya names (``--reverse``); ``ValueError`` naming a key not under ``diffusion_model.``."""
    out = {}
    for key, value in state.items():
        if not key.startswith(DIT_PREFIX):
            raise ValueError(f"{key}: not a Z-Image ComfyUI LoRA key ({DIT_PREFIX}*)")
        rest = key[len(DIT_PREFIX) :]
        if ".lora_" in rest:
            module, weight = rest.rsplit(".lora_", 1)
            weight = "lora_" + weight
        else:
            module, weight = rest.rsplit(".", 1)
        weight = weight.replace("lora_B", "lora_up").replace("lora_A", "lora_down")
        out[f"lora_unet_{module.replace('.', '_')}.{weight}"] = value
    return out


def build_parser(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("src_path", help="source LoRA .safetensors")
    parser.add_argument("dst_path", help="destination .safetensors")
    parser.add_argument("--reverse", action="store_true", help="ComfyUI -> musubi-tuner (kohya) names")
    return parser


def run(argv: Sequence[str] | None, doc: str) -> str:
    from library.files.metadata import with_hashes
    from library.files.weights import load_state_dict, save_state_dict

    args = build_parser(doc).parse_args(argv)
    state, metadata = load_state_dict(args.src_path)
    converted = from_comfy(state) if args.reverse else to_comfy(state)
    save_state_dict(converted, args.dst_path, with_hashes(converted, dict(metadata or {})))
    log.info("converted %d keys: %s -> %s", len(converted), args.src_path, args.dst_path)
    return args.dst_path


def main(argv: Sequence[str] | None, doc: str) -> int:
    from library.cli.main_guard import main_guard

    return main_guard(lambda: run(argv, doc))
