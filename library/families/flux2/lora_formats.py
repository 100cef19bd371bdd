"""FLUX.2 adapter files in diffusers' hands: our (musubi-tuner's) kohya files name BFL modules with underscores
(``lora_unet_double_blocks_0_img_attn_qkv``). diffusers' ``Flux2LoraLoaderMixin.load_lora_weights`` converts the
LoRA ones itself (``_convert_kohya_flux2_lora_to_diffusers``); for LoKr it reads the BFL names with dots under
``diffusion_model.`` (ai-toolkit's layout, ``_convert_non_diffusers_flux2_lokr_to_diffusers``), which
:func:`lokr_for_diffusers` writes (the tensors as they are: alpha and the factors keep their meaning; a double
block's ``qkv`` stays one fused module, which diffusers fuses its projections for).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor

from . import keys as K

_BLOCK = re.compile(r"^lora_unet_(double|single)_blocks_(\d+)_")


def bfl_modules(names: list[str]) -> dict[str, str]:
    """kohya name -> BFL module path for every module of the block counts the ``names`` imply."""
    double = 1 + max((int(m.group(2)) for n in names if (m := _BLOCK.match(n)) and m.group(1) == "double"), default=-1)
    single = 1 + max((int(m.group(2)) for n in names if (m := _BLOCK.match(n)) and m.group(1) == "single"), default=-1)
    return {"lora_unet_" + e.bfl.replace(".", "_"): e.bfl for e in K.module_table(double, single, True)}


def lokr_for_diffusers(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A kohya-named LoKr state dict -> ``diffusion_model.<BFL path>.<tensor>`` (module docstring); ``ValueError``
    for a module that is not LoKr or not FLUX.2's."""
    names = sorted({k.split(".", 1)[0] for k in state})
    table = bfl_modules(names)
    out = {}
    for key, value in state.items():
        name, _, suffix = key.partition(".")
        if name not in table:
            raise ValueError(f"{name}: not a FLUX.2 DiT module (expected lora_unet_<BFL module path>)")
        if not (suffix.startswith("lokr_") or suffix == "alpha"):
            raise ValueError(f"{key}: not a LoKr tensor; diffusers reads kohya LoRA files without conversion")
        out[f"diffusion_model.{table[name]}.{suffix}"] = value
    return out
