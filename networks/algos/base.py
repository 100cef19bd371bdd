"""The record every adapter algorithm fills in (see ``networks.algos``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Algorithm:
    """The functions that define one adapter algorithm (see the module docstring)."""

    name: str
    file_keys: Mapping[str, str]
    init_params: Callable[..., dict[str, Tensor]]
    # delta_weight(params, scale, shape, *, base=None, alpha=None): ``base`` is W for ``needs_base`` algorithms,
    # ``alpha`` the module's stored alpha for formats where it is not a LoRA scale (OFT keeps its constraint there).
    delta_weight: Callable[..., Tensor]
    rank: Callable[[Mapping[str, Tensor]], int | None]
    options: Callable[[Mapping[str, Tensor]], dict[str, Any]]
    plus_params: tuple[str, ...] = ()
    # use_scalar is folded into each of these present when writing (one factor of every term of ΔW: LoRA's lora_up,
    # GLoRA's a2 and b2)
    scalar_params: tuple[str, ...] = ()
    # Optional factorised forward (LoRA): x -> rank-r activation -> output, without materialising ΔW.
    # project_down(x, params, conv) with conv = dict(stride, padding, dilation) for a Conv2d base, None for Linear.
    project_down: Callable[..., Tensor] | None = None
    project_up: Callable[..., Tensor] | None = None
    # Optional low-rank form (LoRA without tucker): factors(params, scale) -> (up (out, r), down (r, in·kh·kw)) with
    # ΔW = (up @ down) reshaped to the base shape, or None when the tensors are not a plain product. Resize and
    # merge tools use it to work on the rank-r factors instead of the (out, in) matrix.
    factors: Callable[[Mapping[str, Tensor], float], tuple[Tensor, Tensor] | None] | None = None
    # ΔW depends on the base weight W itself (OFT's R·W − W, (IA)³'s W·s, GLoRA's W·A): ``delta_weight`` is then
    # called with ``base=W`` (the layer's own weight, fp8 storage cast up), and tools that have only the file refuse
    # such modules with a message asking for the base model.
    needs_base: bool = False
    # Optional bias change (LyCORIS full / "diff" stores ``diff_b``): delta_bias(params, scale) -> Tensor | None,
    # added to the base layer's bias in the forward pass and by merge.
    delta_bias: Callable[[Mapping[str, Tensor], float], Tensor | None] | None = None
    # The file has a per-module ``alpha`` (False: LyCORIS full / (IA)³ write none; the scale is then 1).
    has_alpha: bool = True
    # Parameters that are fixed settings stored as tensors, never trained ((IA)³'s ``on_input``): kept on the CPU
    # beside the trainable tensors and passed to the functions with them, so reading their value costs no sync.
    constants: tuple[str, ...] = ()
    # max-norm (--scale_weight_norms) scaling: norm_exponents(params) -> {parameter: p} such that multiplying each
    # by c**p multiplies ΔW by c. None: ΔW is a product of all parameters, each is multiplied by c**(1/k).
    norm_exponents: Callable[[Mapping[str, Tensor]], Mapping[str, float]] | None = None
    # ΔW is not linear in the multiplier (OFT / BOFT move the rotation toward I, LyCORIS' rule): ``delta_weight``
    # then takes ``multiplier=m`` and returns W'(m) − W, and the layer passes its multiplier in instead of scaling.
    multiplier_inside: bool = False
    # ``--scale_weight_norms`` caps the joint Frobenius norm of these parameters instead of ‖ΔW‖ (LyCORIS OFT / BOFT
    # ``apply_max_norm`` caps ‖oft_blocks‖); empty: every parameter is scaled so that ‖ΔW‖ is capped.
    norm_params: tuple[str, ...] = ()
    # The stored ``alpha`` is a constraint, not a LoRA scale (OFT): set from ``constraint`` / ``--network_alpha``.
    constraint_alpha: bool = False
    # Module names in files use this prefix instead of ``lora_unet`` (sd-scripts' networks.oft: ``oft_unet``).
    file_prefix: str | None = None
    # Algorithms that write another algorithm's file layout (DyLoRA and LoRA-FA write plain LoRA files): the name of
    # that algorithm, so a file detected as it loads into this one.
    file_format: str | None = None
    # Optional packing for parameters stored differently in memory and in files (DyLoRA: one tensor per rank block,
    # one lora_down / lora_up in files): to_file(params) -> {suffix: tensor}; from_file({suffix: tensor}, **options)
    # -> params, with ``options`` as returned by ``options(params)``.
    to_file: Callable[[Mapping[str, Tensor]], dict[str, Tensor]] | None = None
    from_file: Callable[..., dict[str, Tensor]] | None = None
    # Parameters stored per rank block as ``<name>_<j>`` (DyLoRA); ``logical_name`` maps them back to ``<name>``.
    block_params: bool = False
    # Parameters kept at their init (LoRA-FA's lora_down): no gradient, no optimizer group.
    frozen_params: tuple[str, ...] = ()
    # How many of the parameters multiply in each term of ΔW (max-norm scales each by ratio^(1/terms)); None: all.
    product_terms: int | None = None

    def logical_name(self, param: str) -> str:
        """The parameter name as in ``file_keys`` / ``plus_params``: ``lora_up_3`` -> ``lora_up`` for block params."""
        return param.rsplit("_", 1)[0] if self.block_params else param

    def param_for_suffix(self, suffix: str) -> str | None:
        """The parameter name stored under a file tensor suffix, or None if the suffix is not this algorithm's."""
        for name, key in self.file_keys.items():
            if key == suffix:
                return name
        return None


def kaiming_uniform(shape: tuple[int, ...], device: Any, dtype: Any) -> Tensor:
    """A fresh tensor with PyTorch's Linear init (Kaiming-uniform, a = √5), the init LoRA's down, LoKr's and GLoRA's
    factors use (as Microsoft's LoRA, sd-scripts and LyCORIS)."""
    t = torch.empty(shape, device=device, dtype=dtype)
    torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    return t
