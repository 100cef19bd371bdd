r"""``--network_module networks.lora_flux_2``: musubi-tuner's FLUX.2 LoRA (``networks/lora_flux_2.py`` over its
``networks/lora.py``) as rules for our adapter machinery (``ModelFamily.adapter_rules``).

Names are musubi-tuner's (BFL module paths, which ComfyUI and diffusers' ``_convert_kohya_flux2_lora_to_diffusers``
read): ``lora_unet_`` + the module's BFL path with dots as underscores (``lora_unet_double_blocks_0_img_attn_qkv``,
``lora_unet_single_blocks_0_linear1``). A double block's ``img_attn.qkv`` / ``txt_attn.qkv`` is one adapter over
diffusers' three Linears (a fused target, ``keys.fused_modules``).

* **Targets.** Every Linear inside the double and single blocks (``DoubleStreamBlock`` / ``SingleStreamBlock`` =
  diffusers' ``Flux2TransformerBlock`` / ``Flux2SingleTransformerBlock``): ``img_attn.qkv``, ``img_attn.proj``,
  ``img_mlp.0``, ``img_mlp.2``, the same for ``txt_``, and ``linear1`` / ``linear2``; no text-encoder adapters.
* **Exclusion.** musubi-tuner's default ``exclude_patterns`` ``.*(img_mod\.lin|txt_mod\.lin|modulation\.lin).*``
  (replaced when ``exclude_patterns`` is given) plus the always-added ``.*(norm).*``, unless ``include_patterns``
  names them; ``re.fullmatch`` on the BFL module path.
* Ranks: ``--network_dim`` / ``--network_alpha``; ``network_reg_dims`` / ``network_reg_lrs`` (regexes over the BFL
  path), LoRA+, ``rank_dropout``, ``module_dropout``, ``verbose``: the common keys.
"""

from __future__ import annotations

from ..adapters import Target
from ..musubi_lora import MusubiLoraRules
from . import keys as K

BLOCK_CLASSES = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")


def musubi_path(target: Target) -> str:
    """musubi-tuner's module path of a target (BFL names; a fused target's path is its BFL name already)."""
    return target.path if target.fused is not None else K.bfl_module(target.path)


RULES = MusubiLoraRules(
    "networks.lora_flux_2",
    "FLUX.2",
    BLOCK_CLASSES,
    r".*(norm).*",
    default_exclude=(r".*(img_mod\.lin|txt_mod\.lin|modulation\.lin).*",),
    musubi_path=musubi_path,
)
MODULE = RULES.MODULE
