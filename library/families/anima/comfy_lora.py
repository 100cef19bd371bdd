"""``networks/convert_anima_lora_to_comfy.py``: an Anima LoRA between sd-scripts' kohya names and ComfyUI's
(``diffusion_model.<module>.lora_A / lora_B / alpha``; Qwen3 under ``text_encoders.qwen3_06b.transformer.model.``),
both directions (``--reverse``: ComfyUI -> kohya), as sd-scripts' script.

The module path of a kohya name is rebuilt by joining its underscore-separated words into the identifiers Anima's and
Qwen3's module paths have (:data:`IDENTIFIERS`: ``self_attn``, ``q_proj``, ``llm_adapter``...), longest first;
every other word is a path component. This is sd-scripts' list of replacements written as one rule, and it is exact
for every module of the DiT, the adapter and Qwen3 (tests check each path of the released layout). Tensors are not
changed (``lora_down`` -> ``lora_A``, ``lora_up`` -> ``lora_B``; alpha kept); the source's metadata is kept, with the
``sshs_*`` hashes of the new tensors.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence

from torch import Tensor

log = logging.getLogger(__name__)

DIT_PREFIX = "diffusion_model."
QWEN3_PREFIX = "text_encoders.qwen3_06b.transformer.model."
IDENTIFIERS = tuple(sorted((
    "llm_adapter", "t_embedding_norm", "x_embedder", "t_embedder", "adaln_modulation_self_attn",
    "adaln_modulation_cross_attn", "adaln_modulation_mlp", "adaln_modulation", "final_layer", "linear_1", "linear_2",
    "self_attn", "cross_attn", "q_proj", "k_proj", "v_proj", "o_proj", "output_proj", "q_norm", "k_norm",
    "norm_self_attn", "norm_cross_attn", "norm_mlp", "in_proj", "out_proj", "embed_tokens", "input_layernorm",
    "post_attention_layernorm", "gate_proj", "up_proj", "down_proj",
), key=lambda s: -s.count("_")))  # fmt: skip


def module_path(kohya_module: str) -> str:
    """``blocks_0_self_attn_q_proj`` -> ``blocks.0.self_attn.q_proj`` (module docstring)."""
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
    """kohya -> ComfyUI names; ``ValueError`` naming a key of neither ``lora_unet_`` nor ``lora_te_``."""
    out = {}
    for key, value in state.items():
        module, _, weight = key.partition(".")
        for kohya, comfy in (("lora_unet_", DIT_PREFIX), ("lora_te_", QWEN3_PREFIX)):
            if module.startswith(kohya):
                weight = weight.replace("lora_up", "lora_B").replace("lora_down", "lora_A")
                out[f"{comfy}{module_path(module[len(kohya) :])}.{weight}"] = value
                break
        else:
            raise ValueError(f"{key}: not an Anima kohya LoRA key (lora_unet_* / lora_te_*)")
    return out


def from_comfy(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """ComfyUI -> kohya names (``--reverse``); ``ValueError`` naming a key under neither prefix."""
    out = {}
    for key, value in state.items():
        for comfy, kohya in ((DIT_PREFIX, "lora_unet_"), (QWEN3_PREFIX, "lora_te_")):
            if key.startswith(comfy):
                rest = key[len(comfy) :]
                if ".lora_" in rest:
                    module, weight = rest.rsplit(".lora_", 1)
                    weight = "lora_" + weight
                else:
                    module, weight = rest.rsplit(".", 1)
                weight = weight.replace("lora_B", "lora_up").replace("lora_A", "lora_down")
                out[f"{kohya}{module.replace('.', '_')}.{weight}"] = value
                break
        else:
            raise ValueError(f"{key}: not an Anima ComfyUI LoRA key ({DIT_PREFIX}* / {QWEN3_PREFIX}*)")
    return out


def build_parser(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("src_path", help="source LoRA .safetensors")
    parser.add_argument("dst_path", help="destination .safetensors")
    parser.add_argument("--reverse", action="store_true", help="ComfyUI -> sd-scripts (kohya) names")
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(None, __doc__))
