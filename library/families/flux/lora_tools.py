"""FLUX.1 / Chroma single files as sd-scripts' ``flux_merge_lora.py`` and ``flux_extract_lora.py`` take them
(:data:`MERGE`, :data:`EXTRACT`; the tools are ``networks/single_file_tools.py``, the scripts thin shims over both).

Merging follows ComfyUI's rule on the files' own keys: a module named ``lora_unet_<BFL module path with dots as
underscores>`` changes the BFL weight ``<module path>.weight`` (with or without ``model.diffusion_model.``), a
``lora_te1_<path>`` module the CLIP-L file's ``text_model.<path>.weight`` (with or without ``text_model.``), a
``lora_te3_<path>`` module the T5 file's ``<path>.weight``. A diffusers-named transformer file is read under its BFL
names (``keys``) and written back under its own. Extraction takes the block matrices (every ``double_blocks.*`` /
``single_blocks.*`` weight but the norms, sd-scripts' selection) of two transformer files with BFL or diffusers
names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path

from torch import Tensor

from library.cli.problems import ConfigError
from library.families.protocol import ModelFamily

from ..loading import KeyView
from ..lora_tools import ExtractFromFiles, MergeIntoFiles, ModelFile
from . import keys as K
from .family import CHROMA, FLUX_DEV, FLUX_SCHNELL
from .lora import MODULE
from .lora_formats import CONVERSION
from .saving import flux_modelspec


def module_names(state: Mapping[str, Tensor], prefix: str) -> dict[str, str]:
    """{kohya module name: weight key} of every matrix in a single file, by ComfyUI's rule (``prefix`` +
    ``_`` + module path with dots as underscores). BFL keys are named without ``model.diffusion_model.``; CLIP-L
    keys are named with ``text_model.`` whether or not the file has it (as sd-scripts writes them), and also without
    it (as tools under transformers 5 wrote them)."""
    out = {}
    for key, tensor in state.items():
        if not key.endswith(".weight") or tensor.dim() != 2:
            continue
        module = key.removesuffix(".weight").removeprefix(K.BFL_PREFIX)
        if prefix == "lora_te1":
            module = module.removeprefix("cond_stage_model.transformer.").removeprefix("text_encoders.clip_l."
                                                                                      "transformer.")  # fmt: skip
            module = module if module.startswith("text_model.") else f"text_model.{module}"
            out.setdefault(f"{prefix}_{module.removeprefix('text_model.').replace('.', '_')}", key)
        out[f"{prefix}_{module.replace('.', '_')}"] = key
    return out


def read_transformer(
    path: str, device: str, diffusers: bool, flag: str
) -> tuple[dict[str, Tensor], Callable[[dict], dict], dict[str, str]]:
    """(BFL state dict, to_output(BFL state) -> state under the file's names, metadata) of a transformer file with
    BFL or diffusers names (``diffusers``: the user said diffusers names, which a BFL file contradicts)."""
    from library.files.weights import load_state_dict

    state, metadata = load_state_dict(path, device=device)
    keys = list(state)
    if K.is_bfl(keys):
        if diffusers:
            raise ConfigError([f"{flag} {path} has BFL names (double_blocks.0.img_attn.qkv.weight), not diffusers "
                               "names; drop --diffusers"])  # fmt: skip
        return state, (lambda s: s), metadata
    prefix = "transformer." if any(k.startswith("transformer.") for k in keys) else ""
    plain = {k.removeprefix(prefix): v for k, v in state.items()}
    if not K.is_diffusers(plain):
        raise ConfigError([f"{flag} {path}: not a FLUX.1 / Chroma transformer (neither BFL keys such as "
                           "double_blocks.0.img_attn.qkv.weight nor diffusers keys such as "
                           "transformer_blocks.0.attn.add_k_proj.weight)"])  # fmt: skip
    try:
        bfl = K.diffusers_to_bfl(plain)
    except KeyError as e:
        raise ConfigError([f"{flag} {path}: {e.args[0]}"]) from None

    def back(merged: dict) -> dict:
        out = {prefix + k: v for k, v in K.bfl_to_diffusers(merged).items()}
        return {k: out[k] for k in keys}

    return bfl, back, metadata


def read_bfl(path: str, flag: str, lazy: bool) -> KeyView:
    """The transformer of ``path`` under BFL names without prefix; diffusers-named files are converted."""
    from library.files.weights import SafetensorsReader, load_state_dict

    lazy = lazy and Path(path).suffix.lower() == ".safetensors"
    source = SafetensorsReader(path) if lazy else load_state_dict(path)[0]
    keys = list(source.keys())
    if K.is_bfl(keys):
        prefix = K.BFL_PREFIX if any(k.startswith(K.BFL_PREFIX) for k in keys) else ""
        return KeyView(source, {k.removeprefix(prefix): k for k in keys})
    plain = {k.removeprefix("transformer."): source[k] for k in keys}
    if not K.is_diffusers(plain):
        raise ConfigError([f"{flag} {path}: not a FLUX.1 / Chroma transformer (no double_blocks.0.img_attn.qkv.weight "
                           "and no diffusers transformer_blocks.0.attn.add_k_proj.weight)"])  # fmt: skip
    try:
        bfl = K.diffusers_to_bfl(plain)
    except KeyError as e:
        raise ConfigError([f"{flag} {path}: {e.args[0]}"]) from None
    return KeyView(bfl, {k: k for k in bfl})


def block_modules(org: KeyView) -> dict[str, str]:
    """{kohya name: BFL key} of the block matrices (sd-scripts' selection: every ``double_blocks.*`` /
    ``single_blocks.*`` 2-D weight but the norms)."""
    keys = [k for k in org if ("single_block" in k or "double_block" in k) and k.endswith(".weight") and "norm" not
            in k and len(org.shape(k)) == 2]  # fmt: skip
    return {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): k for k in keys}


def family_of(keys: Sequence[str]) -> ModelFamily:
    """FLUX.1 dev / schnell or Chroma, from a transformer's BFL keys."""
    variant = K.variant_name(K.bfl_layout(list(keys)))
    return {"dev": FLUX_DEV, "schnell": FLUX_SCHNELL, "chroma": CHROMA}[variant]


def lora_modelspec(family: ModelFamily, title: str) -> dict[str, str]:
    """The ModelSpec keys of a LoRA for ``family`` (FLUX's: no prediction type)."""
    return flux_modelspec(family.modelspec_architecture("lora"), family.modelspec_implementation("lora"), title,
                          family.default_resolution())  # fmt: skip


MERGE = MergeIntoFiles(
    title="FLUX",
    files=(
        ModelFile("lora_unet", "flux_model", "save_to", "FLUX.1 / Chroma transformer file (BFL or diffusers names); "
                  "without it (and --clip_l / --t5xxl) the LoRAs are merged into one LoRA",
                  "output: the merged transformer, or the merged LoRA", partial(module_names, prefix="lora_unet")),
        ModelFile("lora_te1", "clip_l", "clip_l_save_to", "CLIP-L file to merge lora_te1 modules into",
                  "output of the merged --clip_l", partial(module_names, prefix="lora_te1")),
        ModelFile("lora_te3", "t5xxl", "t5xxl_save_to", "T5-XXL file to merge lora_te3 modules into",
                  "output of the merged --t5xxl", partial(module_names, prefix="lora_te3")),
    ),
    read_denoiser=read_transformer,
    network_module=MODULE,
    conversion=CONVERSION,
)  # fmt: skip
EXTRACT = ExtractFromFiles(
    org_help="the original FLUX.1 / Chroma transformer (.safetensors)",
    tuned_help="the tuned transformer: the LoRA is org -> tuned",
    read=read_bfl,
    modules=block_modules,
    family_of=family_of,
    modelspec=lora_modelspec,
    network_module=MODULE,
)
