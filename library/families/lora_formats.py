"""LoRA files in kohya (sd-scripts) and PEFT (diffusers, ai-toolkit) names: the pieces every family's converter
shares (each family's ``lora_formats.py`` holds its module pairs and layout rules), and what a family states about
its converter (:class:`LoraConversion`).

kohya files name one module per module of the family's file layout with a scale ``alpha / r``; PEFT files name one
module per diffusers Linear (``*.lora_A.weight`` = down, ``*.lora_B.weight`` = up) with no alpha (scale 1). The
helpers here fold the scale into the factors, exactly (:func:`kohya_factors`), read the PEFT tensors per module
(:func:`peft_modules`, :func:`leaf_factors`) and stack the leaves of a fused module back into one kohya module
(:func:`stack_leaves`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

PEFT_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_PEFT_TENSORS = ((".lora_A.weight", "A"), (".lora_B.weight", "B"), (".alpha", "alpha"))


@dataclass(frozen=True)
class LoraConversion:
    """A family's LoRA converter between kohya and PEFT names (``networks/convert_<family>_lora.py``, sd-scripts'
    script names): ``formats`` maps each name ``--src`` / ``--dst`` accept to its format (``peft_format`` or
    "sd-scripts"), ``module`` names the family's formats module (``is_peft``, ``kohya_to_peft``,
    ``peft_to_kohya``), ``title`` and ``script`` say in messages whose files it converts and how to run it."""

    title: str
    script: str
    formats: Mapping[str, str]
    peft_format: str
    default_src: str
    default_dst: str
    module: str

    def to_kohya(self) -> str:
        """The command line that makes a PEFT file kohya ("networks/convert_flux_lora.py --src ai-toolkit --dst
        sd-scripts")."""
        return f"{self.script} --src {self.peft_format} --dst sd-scripts"


def group_by_module(state_dict: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """``{"lora_unet_x.lora_down.weight": t}`` -> ``{"lora_unet_x": {"lora_down.weight": t}}``.

    Keys without a dot (A1111's top-level extras) and ``bundle_emb.*`` (bundled embeddings) are not modules and are
    left out.
    """
    groups: dict[str, dict[str, Tensor]] = {}
    for key, tensor in state_dict.items():
        name, sep, suffix = key.partition(".")
        if not sep or name == "bundle_emb":
            continue
        groups.setdefault(name, {})[suffix] = tensor
    return groups


def is_peft(state_dict: Mapping[str, Tensor]) -> bool:
    """Whether a state dict holds PEFT / diffusers LoRA keys (``*.lora_A.weight``)."""
    return any(k.endswith(PEFT_SUFFIXES) for k in state_dict)


def swap_halves(t: Tensor) -> Tensor:
    """The (shift, scale) rows of a modulation in the file's layout <-> diffusers' (scale, shift); its own inverse."""
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _split_scale(scale: float) -> tuple[float, float]:
    """scale = s_A · s_B with s_B = 2^e, e = ⌊log2(scale) / 2⌋ (multiplying by a power of two is exact)."""
    if scale <= 0 or not math.isfinite(scale):
        return scale, 1.0
    s_b = 2.0 ** math.floor(math.log2(scale) / 2)
    return scale / s_b, s_b


def kohya_factors(name: str, t: Mapping[str, Tensor], source: str, problems: list[str]) -> tuple[Tensor, ...] | None:
    """(A, B, down) of one plain kohya LoRA module, alpha / r folded in: A = s_A · down, B = s_B · up with
    s_A · s_B = alpha / r (``_split_scale``); None, with the problem added, for any other algorithm's tensors."""
    if set(t) - {"lora_down.weight", "lora_up.weight", "alpha"} or "lora_down.weight" not in t:
        kinds = ", ".join(sorted(set(t) - {"alpha"}))
        problems.append(f"{source}: {name} ({kinds}) is not a plain LoRA module; PEFT files hold LoRA only: make "
                        "it a LoRA first (svd_merge_lora.py --models FILE --new_rank R)")  # fmt: skip
        return None
    down, up = t["lora_down.weight"].float(), t["lora_up.weight"].float()
    rank = down.shape[0]
    alpha = float(t["alpha"]) if "alpha" in t else float(rank)
    s_a, s_b = _split_scale(alpha / rank)
    return (down * s_a).contiguous(), up * s_b, down


def kohya_module(name: str, down: Tensor, up: Tensor) -> dict[str, Tensor]:
    """One kohya module's tensors, alpha = the rank (scale 1: the factors carry the strength)."""
    return {f"{name}.lora_down.weight": down.contiguous(), f"{name}.lora_up.weight": up.contiguous(),
            f"{name}.alpha": torch.tensor(float(down.shape[0]))}  # fmt: skip


def peft_modules(
    state_dict: Mapping[str, Tensor], source: str, problems: list[str], prefixes: Mapping[str, str], strip: str = ""
) -> dict[tuple[str, str], dict[str, Tensor]]:
    """{(prefix, module path): {"A": .., "B": .., "alpha": ..}} of a PEFT state dict; a key whose first part is not
    one of ``prefixes`` is the transformer's (``strip`` taken off its path)."""
    modules: dict[tuple[str, str], dict[str, Tensor]] = {}
    for key, tensor in state_dict.items():
        found = next(((key.removesuffix(suffix), what) for suffix, what in _PEFT_TENSORS if key.endswith(suffix)), None)
        if found is None:
            problems.append(f"{source}: {key} is not a PEFT LoRA tensor (expected *.lora_A.weight / *.lora_B.weight; "
                            "DoRA's lora_magnitude_vector and other PEFT methods are not converted)")  # fmt: skip
            continue
        path, what = found
        head, _, rest = path.partition(".")
        if head not in prefixes:  # ai-toolkit and diffusers write transformer.; some files have no prefix
            head, rest = "transformer", path.removeprefix(strip) if strip else path
        modules.setdefault((head, rest), {})[what] = tensor
    for (head, path), t in modules.items():
        if "A" not in t or "B" not in t:
            problems.append(f"{source}: {head}.{path} lacks lora_{'A' if 'A' not in t else 'B'}.weight")
    return modules


def leaf_factors(t: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(A, B) of one PEFT leaf, a stored alpha folded into B (B · alpha / r)."""
    a, b = t["A"].float(), t["B"].float()
    if "alpha" in t:
        b = b * (float(t["alpha"]) / a.shape[0])
    return a, b


def stack_leaves(leaves: Mapping[int, tuple[Tensor, Tensor]], rows: list[int]) -> tuple[Tensor, Tensor]:
    """(down, up) of one fused module from its leaves' (A, B), leaf j owning ``rows[j]`` output rows: when every leaf
    is given and all share A, (A, cat(B)) (the original rank back); else down = cat(A_j) and up block-diagonal."""
    n = len(rows)
    first_a = next(iter(leaves.values()))[0]
    if len(leaves) == n and all(torch.equal(a, first_a) for a, _ in leaves.values()):
        return first_a, torch.cat([leaves[j][1] for j in range(n)])
    down = torch.cat([leaves[j][0] for j in sorted(leaves)])
    up = torch.zeros(sum(rows), down.shape[0], dtype=down.dtype)
    col = 0
    for j in sorted(leaves):
        a, b = leaves[j]
        start = sum(rows[:j])
        up[start : start + b.shape[0], col : col + a.shape[0]] = b
        col += a.shape[0]
    return down, up
