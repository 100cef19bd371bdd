"""SD3 / SD3.5 LoRA files in kohya (sd-scripts) and PEFT (diffusers) names, both ways, exactly.

kohya files name one module per **SAI** module (``lora_unet_joint_blocks_0_x_block_attn_qkv``; a fused ``qkv``
holds one ``up`` over the stacked rows of diffusers' ``to_q | to_k | to_v``) with a scale ``alpha / r``; PEFT files
name one module per **diffusers** Linear (``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``: A = down,
B = up) with no alpha (scale 1). diffusers' ``StableDiffusion3Pipeline.load_lora_weights`` reads only PEFT names (a
kohya SD3 file loads nothing: diffusers logs a warning and the pipeline runs unchanged). The module pairs are the
table of ``library.families.sd3.keys`` (the one the loader and the adapter targets use).

kohya -> PEFT, per module (s = alpha / r, split as s = s_A · s_B with s_B a power of two, as
library/families/lora_formats.py does for every family):

    A = s_A · down                    (r, in) (x_embedder: (r, in, 2, 2)), the same for every leaf of a fused qkv
    B_leaf = s_B · up[rows of leaf]   (rows, r); q, k, v: three equal parts; the swapped modulations
                                      (``final_layer.adaLN_modulation.1`` -> ``norm_out.linear``, the last block's
                                      ``context_block.adaLN_modulation.1`` -> ``norm1_context.linear``, told apart
                                      from the other blocks' by their 2·D rows): halves swapped (SAI: shift, scale)

    so that B_leaf @ A = (alpha / r) · (up @ down)[rows of leaf]: the ΔW of every leaf is kept.

PEFT -> kohya, per SAI module with k leaves present (leaf j: A_j, B_j; an ``alpha`` next to them is folded into B_j):
``down = [A_1; ...; A_k]``, ``up`` block-diagonal at each leaf's rows (zero rows for absent leaves), ``alpha = Σ r_j``;
when all three leaves share one A (what kohya -> PEFT writes) the compact ``down = A``, ``up = [B_q; B_k; B_v]`` at
rank r, so kohya -> PEFT -> kohya gives the original rank and ΔW back.

Text encoders: CLIP-L ``lora_te1_text_model_encoder_layers_0_self_attn_q_proj`` <-> ``text_encoder.text_model.
encoder.layers.0.self_attn.q_proj`` and CLIP-G ``lora_te2_`` <-> ``text_encoder_2.``, where diffusers' SD3 loader
reads them. T5-XXL modules (``lora_te3_``, ``train_t5xxl``) have no diffusers name (the SD3 loader reads no
``text_encoder_3`` LoRA): they are left out with a warning naming how many. Only plain LoRA modules have a PEFT form:
LoHa, LoKr, DoRA and the rest are refused with the module named.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from library.cli.problems import ConfigError

from ..lora_formats import (
    LoraConversion,
    group_by_module,
    is_peft,
    kohya_factors,
    kohya_module,
    leaf_factors,
    peft_modules,
    stack_leaves,
    swap_halves,
)
from . import keys as K

__all__ = ["CONVERSION", "ModuleMap", "is_peft", "kohya_name", "kohya_to_peft", "peft_to_kohya"]

logger = logging.getLogger(__name__)

PEFT_PREFIXES = {"transformer": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}
TE_PEFT = {"lora_te1": "text_encoder", "lora_te2": "text_encoder_2"}
# networks/convert_sd3_lora.py (sd-scripts' name): sd-scripts (kohya) <-> diffusers (PEFT)
CONVERSION = LoraConversion(
    title="SD3 / SD3.5",
    script="networks/convert_sd3_lora.py",
    formats={"diffusers": "diffusers", "peft": "diffusers", "ai-toolkit": "diffusers", "sd-scripts": "sd-scripts",
             "kohya": "sd-scripts"},
    peft_format="diffusers",
    default_src="sd-scripts",
    default_dst="diffusers",
    module=__name__,
)  # fmt: skip
_CLIP = re.compile(r"(lora_te[12])_text_model_encoder_layers_(\d+)_(self_attn_(?:q|k|v|out)_proj|mlp_fc[12])$")
# the modulations whose kind ("one" with 6·D rows, "swap" with 2·D rows) depends on whether the block is the last
_CONTEXT_MOD = re.compile(r"joint_blocks\.\d+\.context_block\.adaLN_modulation\.1$")


def kohya_name(sai_module: str) -> str:
    """``joint_blocks.0.x_block.attn.qkv`` -> ``lora_unet_joint_blocks_0_x_block_attn_qkv`` (ComfyUI's rule)."""
    return "lora_unet_" + sai_module.replace(".", "_")


@dataclass(frozen=True)
class ModuleMap:
    """The kohya <-> diffusers module pairs of an SD3 / SD3.5 transformer with up to ``num_layers`` joint blocks,
    every block with a second attention (a LoRA's names do not say which blocks have one; extra names are harmless)
    and every block's context side complete (the last block's context modulation is told by its shape)."""

    by_kohya: dict[str, K.Entry]
    by_diffusers: dict[str, tuple[K.Entry, int]]

    @classmethod
    def build(cls, num_layers: int) -> ModuleMap:
        table = K.module_table(num_layers + 1, tuple(range(num_layers + 1)), False)
        by_kohya, by_diffusers = {}, {}
        for e in table:
            if e.sai and e.params[0][0] == "weight":
                by_kohya[kohya_name(e.sai)] = e
                for i, m in enumerate(e.diffusers):
                    by_diffusers[m] = (e, i)
        return cls(by_kohya, by_diffusers)

    @classmethod
    def for_names(cls, names, diffusers: bool) -> ModuleMap:
        pattern = r"transformer_blocks\.(\d+)\." if diffusers else r"joint_blocks_(\d+)_"
        found = [int(m.group(1)) for n in names if (m := re.search(pattern, n))]
        return cls.build(max(found) + 1 if found else 0)


def _swapped(entry: K.Entry, rows: int, width: int) -> bool:
    """Whether a module's rows are stored with the halves swapped: ``final_layer``'s modulation always, a context
    modulation when it is the last block's (2·D rows, ``AdaLayerNormContinuous``; the others have 6·D)."""
    if _CONTEXT_MOD.search(entry.sai):
        return rows == 2 * width
    return entry.kind == "swap"


# ------------------------------------------------------------------------------------------------ kohya -> PEFT
def kohya_to_peft(state_dict: Mapping[str, Tensor], source: str = "the file") -> dict[str, Tensor]:
    """A kohya SD3 / SD3.5 LoRA (lora_unet_ SAI names, lora_te1_ / lora_te2_ CLIP) -> PEFT / diffusers keys with the
    scale folded in (see the module docstring); T5 modules left out with a warning. ``ConfigError`` naming every
    module that has no PEFT form."""
    modules = group_by_module(state_dict)
    fmap = ModuleMap.for_names(list(modules), diffusers=False)
    out: dict[str, Tensor] = {}
    problems: list[str] = []
    t5 = []
    for name, t in modules.items():
        if name.startswith("lora_te3_"):
            t5.append(name)
            continue
        if (factors := kohya_factors(name, t, source, problems)) is None:
            continue
        a, b, down = factors
        if name.startswith("lora_unet_"):
            entry = fmap.by_kohya.get(name)
            if entry is None:
                problems.append(f"{source}: {name} is not an SD3 / SD3.5 transformer module (SAI names expected, e.g. "
                                "lora_unet_joint_blocks_0_x_block_attn_qkv)")  # fmt: skip
                continue
            if down.dim() != 2 and entry.sai != "x_embedder.proj":
                problems.append(f"{source}: {name} is a conv LoRA ({tuple(down.shape)}) on a Linear")
                continue
            if _swapped(entry, b.shape[0], down.shape[1]):
                b = swap_halves(b)
            parts = b.chunk(3) if entry.kind == "rows" else (b,)
            for leaf, piece in zip(entry.diffusers, parts):
                out[f"transformer.{leaf}.lora_A.weight"] = a.clone()
                out[f"transformer.{leaf}.lora_B.weight"] = piece.contiguous()
        elif m := _CLIP.match(name.replace("_encoder_layers_", "_text_model_encoder_layers_", 1)
                              if "_text_model_" not in name else name):  # fmt: skip
            part = m.group(3).replace("self_attn_", "self_attn.").replace("mlp_", "mlp.")
            path = f"{TE_PEFT[m.group(1)]}.text_model.encoder.layers.{m.group(2)}.{part}"
            out[f"{path}.lora_A.weight"], out[f"{path}.lora_B.weight"] = a, b.contiguous()
        else:
            problems.append(f"{source}: {name} is not an SD3 LoRA module (lora_unet_ / lora_te1_ / lora_te2_ / "
                            "lora_te3_ names)")  # fmt: skip
    if problems:
        raise ConfigError(problems, "SD3 LoRA conversion", limit=6)
    if t5:
        logger.warning("%s: %d T5-XXL module(s) (lora_te3_, e.g. %s) left out: diffusers' StableDiffusion3Pipeline "
                       "loads no T5 LoRA, so PEFT files have no name for them", source, len(t5), t5[0])  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------ PEFT -> kohya
def peft_to_kohya(state_dict: Mapping[str, Tensor], source: str = "the file") -> dict[str, Tensor]:
    """A PEFT / diffusers SD3 LoRA -> kohya names on SAI modules (see the module docstring). ``ConfigError`` naming
    every key that is not an SD3 transformer / CLIP LoRA tensor."""
    problems: list[str] = []
    modules = peft_modules(state_dict, source, problems, PEFT_PREFIXES)
    fmap = ModuleMap.for_names([p for h, p in modules if h == "transformer"], diffusers=True)
    leaves_of: dict[str, dict[int, tuple[Tensor, Tensor]]] = {}
    entries: dict[str, K.Entry] = {}
    out: dict[str, Tensor] = {}
    for (head, path), t in modules.items():
        if "A" not in t or "B" not in t:
            continue
        a, b = leaf_factors(t)
        if head != "transformer":
            name = f"{PEFT_PREFIXES[head]}_{path}".replace(".", "_")
            if not _CLIP.match(name):
                problems.append(f"{source}: {head}.{path} is not a CLIP attention / MLP Linear")
                continue
            out.update(kohya_module(name, a, b))
            continue
        found = fmap.by_diffusers.get(path)
        if found is None:
            problems.append(f"{source}: transformer.{path} is not an SD3 transformer Linear (diffusers names expected, "
                            "e.g. transformer.transformer_blocks.0.attn.to_q)")  # fmt: skip
            continue
        entry, leaf = found
        entries[entry.sai] = entry
        leaves_of.setdefault(entry.sai, {})[leaf] = (a, b)
    if problems:
        raise ConfigError(problems, "SD3 LoRA conversion", limit=6)
    for sai, leaves in leaves_of.items():
        entry = entries[sai]
        if entry.kind == "rows":
            down, up = _stack(leaves)
        else:
            down, up = leaves[0]
            if _swapped(entry, up.shape[0], down.shape[1]):
                up = swap_halves(up)
        name = kohya_name(sai)
        out.update(kohya_module(name, down, up))
    return out


def _stack(leaves: Mapping[int, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """(down, up) of one fused qkv from its leaves' (A, B): compact when all three share A, else block-diagonal."""
    rows = next(iter(leaves.values()))[1].shape[0]  # q, k and v have the same rows
    return stack_leaves(leaves, [rows] * 3)
