"""``networks/convert_hunyuan_image_lora_to_comfy.py``: a HunyuanImage 2.1 LoRA between sd-scripts' names and
ComfyUI's, both directions (``--reverse``: ComfyUI -> sd-scripts), as sd-scripts' script of that name.

Both are kohya names (``lora_unet_...``, ``lora_down`` / ``lora_up`` / ``alpha``); ComfyUI's HunyuanImage model names
some modules as its FLUX-style blocks do: ``img_mlp.fc1 / fc2`` -> ``img_mlp.0 / 2``, ``img_mod.linear`` ->
``img_mod.lin`` (the same for ``txt_``) in double blocks, ``modulation.linear`` -> ``modulation.lin`` in single
blocks (:data:`DOUBLE`, :data:`SINGLE`). Tensors are not changed; the source's metadata is kept, with the ``sshs_*``
hashes of the new tensors.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence

from torch import Tensor

log = logging.getLogger(__name__)

# (sd-scripts, ComfyUI) words of kohya names, as sd-scripts' converter replaces them
DOUBLE = (("img_mlp_fc1", "img_mlp_0"), ("img_mlp_fc2", "img_mlp_2"), ("img_mod_linear", "img_mod_lin"),
          ("txt_mlp_fc1", "txt_mlp_0"), ("txt_mlp_fc2", "txt_mlp_2"), ("txt_mod_linear", "txt_mod_lin"))  # fmt: skip
SINGLE = (("modulation_linear", "modulation_lin"),)


def _rename(name: str, reverse: bool) -> str:
    pairs = DOUBLE if "double_blocks" in name else SINGLE if "single_blocks" in name else ()
    for ours, comfy in pairs:
        name = name.replace(comfy, ours) if reverse else name.replace(ours, comfy)
    return name


def convert(state: Mapping[str, Tensor], reverse: bool = False) -> dict[str, Tensor]:
    """sd-scripts -> ComfyUI names (``reverse``: back); ``ValueError`` naming a key that is no kohya DiT key."""
    out = {}
    for key, value in state.items():
        if not key.startswith("lora_unet_"):
            raise ValueError(f"{key}: not a HunyuanImage LoRA key (lora_unet_*)")
        out[_rename(key, reverse)] = value
    return out


def comfy_dit_key(tencent_key: str) -> str:
    """The name ComfyUI's HunyuanImage model gives a Tencent DiT key (``double_blocks.0.img_mlp.fc1.weight`` ->
    ``double_blocks.0.img_mlp.0.weight``): the same words as :data:`DOUBLE` / :data:`SINGLE`, with dots."""
    pairs = (
        DOUBLE
        if tencent_key.startswith("double_blocks.")
        else SINGLE
        if tencent_key.startswith("single_blocks.")
        else ()
    )
    for ours, comfy in pairs:
        stream, _, rest = ours.partition("_") if not ours.startswith("modulation") else ("", "", ours)
        dotted = (f"{stream}_" if stream else "") + rest.replace("_", ".")
        comfy_rest = comfy[len(stream) + 1 :] if stream else comfy
        comfy_dotted = (f"{stream}_" if stream else "") + comfy_rest.replace("_", ".")
        if f".{dotted}." in tencent_key:
            return tencent_key.replace(f".{dotted}.", f".{comfy_dotted}.")
    return tencent_key


def build_parser(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("src_path", help="source LoRA .safetensors (sd-scripts' names)")
    parser.add_argument("dst_path", help="destination .safetensors (ComfyUI's names)")
    parser.add_argument("--reverse", action="store_true", help="ComfyUI -> sd-scripts names")
    return parser


def run(argv: Sequence[str] | None, doc: str) -> str:
    from library.files.metadata import with_hashes
    from library.files.weights import load_state_dict, save_state_dict

    args = build_parser(doc).parse_args(argv)
    state, metadata = load_state_dict(args.src_path)
    converted = convert(state, args.reverse)
    save_state_dict(converted, args.dst_path, with_hashes(converted, dict(metadata or {})))
    log.info("converted %d keys: %s -> %s", len(converted), args.src_path, args.dst_path)
    return args.dst_path


def main(argv: Sequence[str] | None, doc: str) -> int:
    from library.cli.main_guard import main_guard

    return main_guard(lambda: run(argv, doc))
