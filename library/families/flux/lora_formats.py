"""FLUX.1 / Chroma LoRA files in kohya (sd-scripts) and PEFT (diffusers, ai-toolkit) names, both ways, exactly.

kohya files name one module per **BFL** module (``lora_unet_double_blocks_0_img_attn_qkv``; fused modules hold one
``up`` over the stacked rows of several diffusers Linears) with a scale ``alpha / r``; PEFT files name one module per
**diffusers** Linear (``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``: A = down, B = up) with no alpha
(scale 1). The module pairs are the table of ``library.families.flux.keys`` (the one the loader and the adapter
targets use), so the conversion and the model agree by construction.

kohya -> PEFT, per module (s = alpha / r, split as s = s_A · s_B with s_B a power of two, so that both factors keep
their magnitude, as diffusers' kohya converter does):

    A = s_A · down                    (r, in), the same for every leaf of a fused module
    B_leaf = s_B · up[rows of leaf]   (rows, r); final_layer.adaLN_modulation.1's halves swapped (BFL: shift, scale;
                                      diffusers' norm_out.linear: scale, shift)

    so that B_leaf @ A = (alpha / r) · (up @ down)[rows of leaf]: the ΔW of every leaf is kept.

PEFT -> kohya, per BFL module with k leaves present (leaf j: A_j (r_j, in), B_j (rows_j, r_j); an ``alpha`` next to
them, as some PEFT files carry, is folded into B_j):

    down = [A_1; ...; A_k]                     (Σ r_j, in)
    up   = blockdiag(B_1, ..., B_k) placed at each leaf's rows, zero rows for absent leaves   (Σ rows, Σ r_j)
    alpha = Σ r_j (scale 1)

which is exact (up @ down restricted to leaf j's rows is B_j @ A_j). When every leaf is present with the same A
(what kohya -> PEFT writes), the compact form ``down = A``, ``up = [B_1; ...; B_k]`` at rank r is used instead: the
same ΔW at a third (a quarter) of the rank, so kohya -> PEFT -> kohya gives the original rank and ΔW back (alpha
= r then: the scale is in the factors). Absent leaves
of ``linear1``'s MLP rows count 4 × width rows (the MLP ratio of every released FLUX / Chroma model).

CLIP-L modules (``lora_te1_text_model_encoder_layers_0_self_attn_q_proj``, or without ``text_model_`` as tools under
transformers 5 wrote them, <-> ``text_encoder.text_model.encoder.layers.0.self_attn.q_proj``) convert too; T5 modules (``lora_te3_``) are refused: diffusers' ``FluxPipeline`` loads no
T5 LoRA. Only plain LoRA modules have a PEFT form: LoHa, LoKr, DoRA, LoCon-tucker and the rest are refused with the
module named (svd_merge_lora.py turns them into a LoRA first).
"""

from __future__ import annotations

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

__all__ = ["CONVERSION", "ModuleMap", "is_peft", "kohya_name", "kohya_to_peft", "peft_to_kohya", "swap_halves"]

PEFT_PREFIXES = {"transformer": "lora_unet", "text_encoder": "lora_te1"}
MLP_RATIO = 4
# networks/convert_flux_lora.py (sd-scripts' name): ai-toolkit / diffusers (PEFT) <-> sd-scripts (kohya)
CONVERSION = LoraConversion(
    title="FLUX.1 / Chroma",
    script="networks/convert_flux_lora.py",
    formats={"ai-toolkit": "ai-toolkit", "peft": "ai-toolkit", "diffusers": "ai-toolkit", "sd-scripts": "sd-scripts",
             "kohya": "sd-scripts"},
    peft_format="ai-toolkit",
    default_src="ai-toolkit",
    default_dst="sd-scripts",
    module=__name__,
)  # fmt: skip
_CLIP = re.compile(r"lora_te1_text_model_encoder_layers_(\d+)_(self_attn_(?:q|k|v|out)_proj|mlp_fc[12])$")


def kohya_name(bfl_module: str) -> str:
    """``double_blocks.0.img_attn.qkv`` -> ``lora_unet_double_blocks_0_img_attn_qkv`` (ComfyUI's rule)."""
    return "lora_unet_" + bfl_module.replace(".", "_")


@dataclass(frozen=True)
class ModuleMap:
    """The kohya <-> diffusers module pairs of a FLUX.1 / Chroma transformer with up to ``num_double`` /
    ``num_single`` blocks and ``approximator_layers`` Chroma approximator layers (FLUX.1 dev's and Chroma's modules
    together: a LoRA's names do not say which it was trained on)."""

    by_kohya: dict[str, K.Entry]
    by_diffusers: dict[str, tuple[K.Entry, int]]

    @classmethod
    def build(cls, num_double: int, num_single: int, approximator_layers: int = 0) -> ModuleMap:
        entries = K.module_table(K.FLUX, num_double, num_single, True)
        entries += K.module_table(K.CHROMA, num_double, num_single, False, approximator_layers)
        by_kohya, by_diffusers = {}, {}
        for e in entries:
            if e.params[0][0] != "scale":  # norm scales are never adapted
                by_kohya[kohya_name(e.bfl)] = e
                for i, m in enumerate(e.diffusers):
                    by_diffusers[m] = (e, i)
        return cls(by_kohya, by_diffusers)

    @classmethod
    def for_names(cls, names, diffusers: bool) -> ModuleMap:
        """The map that covers module ``names`` (kohya names, or diffusers paths when ``diffusers``)."""

        def count(pattern: str) -> int:
            found = [int(m.group(1)) for n in names if (m := re.search(pattern, n))]
            return max(found) + 1 if found else 0

        sep = r"\." if diffusers else "_"
        double = r"(?<!single_)transformer_blocks\.(\d+)\." if diffusers else r"double_blocks_(\d+)_"
        single = r"single_transformer_blocks\.(\d+)\." if diffusers else r"single_blocks_(\d+)_"
        layers = rf"distilled_guidance_layer{sep}layers{sep}(\d+){sep}"
        return cls.build(count(double), count(single), count(layers))


def _leaf_rows(entry: K.Entry, total: int, width: int) -> list[int]:
    """Rows of each diffusers leaf of a fused (``rows``) entry: 3 equal parts (qkv) or D, D, D, rest (linear1)."""
    if len(entry.diffusers) == 3:
        return [total // 3] * 3
    return [width, width, width, total - 3 * width]


# ------------------------------------------------------------------------------------------------ kohya -> PEFT
def kohya_to_peft(state_dict: Mapping[str, Tensor], source: str = "the file") -> dict[str, Tensor]:
    """A kohya FLUX / Chroma LoRA (lora_unet_ BFL names, lora_te1_ CLIP-L) -> PEFT / diffusers keys with the scale
    folded in (see the module docstring). ``ConfigError`` naming every module that has no PEFT form."""
    modules = group_by_module(state_dict)
    fmap = ModuleMap.for_names(list(modules), diffusers=False)
    out: dict[str, Tensor] = {}
    problems: list[str] = []
    for name, t in modules.items():
        if (factors := kohya_factors(name, t, source, problems)) is None:
            continue
        a, b, down = factors
        if down.dim() != 2:
            problems.append(f"{source}: {name} is a conv LoRA ({tuple(down.shape)}); FLUX has no conv modules")
            continue
        if name.startswith("lora_unet_"):
            entry = fmap.by_kohya.get(name)
            if entry is None:
                problems.append(f"{source}: {name} is not a FLUX.1 / Chroma transformer module (BFL names expected, "
                                "e.g. lora_unet_double_blocks_0_img_attn_qkv)")  # fmt: skip
                continue
            if entry.kind == "swap":
                b = swap_halves(b)
            rows = _leaf_rows(entry, b.shape[0], down.shape[1]) if entry.kind == "rows" else [b.shape[0]]
            for leaf, piece in zip(entry.diffusers, b.split(rows)):
                out[f"transformer.{leaf}.lora_A.weight"] = a.clone()
                out[f"transformer.{leaf}.lora_B.weight"] = piece.contiguous()
        elif m := _CLIP.match(name.replace("lora_te1_encoder_", "lora_te1_text_model_encoder_", 1)):
            part = m.group(2).replace("self_attn_", "self_attn.").replace("mlp_", "mlp.")
            path = f"text_encoder.text_model.encoder.layers.{m.group(1)}.{part}"
            out[f"{path}.lora_A.weight"], out[f"{path}.lora_B.weight"] = a, b.contiguous()
        elif name.startswith("lora_te3_"):
            problems.append(f"{source}: {name} is a T5-XXL module; diffusers' FluxPipeline loads no T5 LoRA, so PEFT "
                            "files have no name for it (leave T5 out of the LoRA: train without train_t5xxl)")  # fmt: skip
        else:
            problems.append(f"{source}: {name} is not a FLUX.1 / Chroma LoRA module (lora_unet_ / lora_te1_ names)")
    if problems:
        raise ConfigError(problems, "FLUX LoRA conversion", limit=6)
    return out


# ------------------------------------------------------------------------------------------------ PEFT -> kohya
def peft_to_kohya(state_dict: Mapping[str, Tensor], source: str = "the file") -> dict[str, Tensor]:
    """A PEFT / diffusers / ai-toolkit FLUX LoRA -> kohya names on BFL modules (see the module docstring).
    ``ConfigError`` naming every key that is not a FLUX transformer / CLIP-L LoRA tensor."""
    problems: list[str] = []
    modules = peft_modules(state_dict, source, problems, PEFT_PREFIXES, strip="diffusion_model.")
    fmap = ModuleMap.for_names([p for h, p in modules if h == "transformer"], diffusers=True)
    fused: dict[str, dict[int, tuple[Tensor, Tensor]]] = {}
    entries: dict[str, K.Entry] = {}
    out: dict[str, Tensor] = {}
    for (head, path), t in modules.items():
        if "A" not in t or "B" not in t:
            continue
        a, b = leaf_factors(t)
        if head == "text_encoder":
            name = "lora_te1_" + (path if path.startswith("text_model.") else f"text_model.{path}").replace(".", "_")
            if not _CLIP.match(name):
                problems.append(f"{source}: text_encoder.{path} is not a CLIP-L attention / MLP Linear")
                continue
            out.update(kohya_module(name, a, b))
            continue
        found = fmap.by_diffusers.get(path)
        if found is None:
            problems.append(f"{source}: transformer.{path} is not a FLUX.1 / Chroma transformer Linear (diffusers "
                            "names expected, e.g. transformer.transformer_blocks.0.attn.to_q)")  # fmt: skip
            continue
        entry, leaf = found
        entries[entry.bfl] = entry
        fused.setdefault(entry.bfl, {})[leaf] = (a, b)
    if problems:
        raise ConfigError(problems, "FLUX LoRA conversion", limit=6)
    for bfl, leaves in fused.items():
        name = kohya_name(bfl)
        down, up = _stack(entries[bfl], leaves)
        out.update(kohya_module(name, down, up))
    return out


def _stack(entry: K.Entry, leaves: Mapping[int, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """(down, up) of one BFL module from its leaves' (A, B): compact when all leaves share A, else block-diagonal."""
    if entry.kind == "one":
        return leaves[0]
    if entry.kind == "swap":
        a, b = leaves[0]
        return a, swap_halves(b)
    width = next(iter(leaves.values()))[0].shape[1]
    n = len(entry.diffusers)
    known = {j: b.shape[0] for j, (_, b) in leaves.items()}
    default = next(iter(known.values())) if n == 3 else width
    return stack_leaves(leaves, [known.get(j, default if (n == 3 or j < 3) else MLP_RATIO * width) for j in range(n)])
