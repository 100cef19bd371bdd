"""Loading FLUX.1 dev / schnell and Chroma as users have them, without the hub.

* ``path``: the BFL single-file transformer (``flux1-dev.safetensors``; keys with or without
  ``model.diffusion_model.``; bf16, fp16 or float8_e4m3fn tensors, each cast to the load dtype as it is read), a
  diffusers ``FluxTransformer2DModel`` / ``ChromaTransformer2DModel`` single file, a diffusers transformer folder
  (``config.json`` + weights), or a full diffusers FLUX / Chroma folder (``transformer/``, ``vae/``,
  ``text_encoder/`` CLIP-L and ``text_encoder_2/`` T5 (Chroma: ``text_encoder/`` T5), tokenizers).
* ``clip_l`` / ``t5xxl`` / ``ae`` (sd-scripts' ``--clip_l --t5xxl --ae``): single files with transformers' CLIP names
  (``text_model.`` prefix or not), transformers' T5 names (``shared.weight`` + ``encoder.*``, or ``encoder.*`` only,
  fp8 too), and the AE under BFL / LDM names (``encoder.down.0.block.0...``, no quant convs) or diffusers names. Given
  with a diffusers folder they replace its parts. A part neither the folder nor a flag provides is an error naming
  the flag, raised before anything is read.

Configs: those stored in a file by our writer (``sdtrain.configs``), else the released model's
(``configs/<variant>.json``)
with the block counts read from the keys (as sd-scripts does), else the tiny test model's; the first whose shapes
fit every tensor is used, and a file none fits is a ``ValueError`` naming the file, the part and the first
differing keys.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..autoencoders import flux_ae
from ..base import PartDtypes, Parts, TextEncoderSpec
from ..convert import hf_for_model, strip_prefix
from ..encoders import clip, t5
from ..loading import check_weights_path, finish, instantiate_fitting
from ..part_files import ModelFiles, PartSource
from ..tokenizers import PAD_CLIP_L, load_tokenizers
from . import keys as K
from .configs import clip_l_factory, released, transformer_factory

log = logging.getLogger(__name__)

PIPELINE_CLASSES = ("FluxPipeline", "ChromaPipeline")
TRANSFORMER_CLASSES = ("FluxTransformer2DModel", "ChromaTransformer2DModel")


# ------------------------------------------------------------------------------------------------ reading files
def _keys(state: Mapping[str, Any]) -> list[str]:
    return list(state.keys())


# ------------------------------------------------------------------------------------------------ what a path is
def variant_of_folder(folder: Path) -> str | None:
    """The variant ("flux-dev" | "flux-schnell" | "chroma") of a diffusers FLUX / Chroma pipeline or transformer
    folder, else None."""
    config = _transformer_config_file(folder)
    if config is None:
        return None
    data = json.loads(config.read_text())
    if data.get("_class_name") == "ChromaTransformer2DModel":
        return "chroma"
    return "flux-dev" if data.get("guidance_embeds") else "flux-schnell"


def _transformer_config_file(folder: Path) -> Path | None:
    for candidate in (folder / "transformer" / "config.json", folder / "config.json"):
        if candidate.is_file():
            try:
                if json.loads(candidate.read_text()).get("_class_name") in TRANSFORMER_CLASSES:
                    return candidate
            except json.JSONDecodeError:
                return None
    return None


def variant_of_keys(keys: list[str]) -> str | None:
    """The variant of a single-file state dict's keys: a BFL transformer (prefix or not) or a diffusers one."""
    if K.is_bfl(keys):
        return _variant(K.bfl_layout(keys))
    stripped = [k.removeprefix("transformer.") for k in keys]
    if K.is_diffusers(stripped):
        return _variant(K.diffusers_layout(stripped))
    return None


def _variant(layout: K.Layout) -> str:
    return {"dev": "flux-dev", "schnell": "flux-schnell", "chroma": "chroma"}[K.variant_name(layout)]


# ------------------------------------------------------------------------------------------------ configs that fit
def _with_blocks(config: dict, layout: K.Layout) -> dict:
    config = dict(config, num_layers=layout.num_double, num_single_layers=layout.num_single)
    if layout.variant == K.CHROMA:
        config["approximator_layers"] = layout.approximator_layers
    else:
        config["guidance_embeds"] = layout.guidance
    return config


def transformer_from_shapes(state: Mapping[str, Any], shape: Callable[[str], tuple[int, ...]],
                            candidates: list[dict]) -> dict | None:  # fmt: skip
    """The transformer config read from its (diffusers-named) weights (``loading.Derive``): latent channels, width,
    head width (the q norm's), the text width (``context_embedder``) and FLUX's pooled width; block counts and the
    rest from the first candidate. None when the RoPE axes of the candidate do not add up to the head width (they
    cannot be read from weights)."""
    keys = set(state.keys())
    needed = ("x_embedder.weight", "context_embedder.weight", "transformer_blocks.0.attn.norm_q.weight")
    if not candidates or not all(k in keys for k in needed):
        return None
    width, channels = shape("x_embedder.weight")
    head = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    config = dict(candidates[0])
    if width % head or sum(config.get("axes_dims_rope", ())) != head:
        return None
    config.update(in_channels=channels, attention_head_dim=head, num_attention_heads=width // head,
                  joint_attention_dim=shape("context_embedder.weight")[1])  # fmt: skip
    if "time_text_embed.text_embedder.linear_1.weight" in keys:
        config["pooled_projection_dim"] = shape("time_text_embed.text_embedder.linear_1.weight")[1]
    return config


def transformer_candidates(
    variant: str, layout: K.Layout, stored: Mapping | None, tiny: Mapping | None = None
) -> list[tuple[dict, str]]:
    """Stored config, else the released one, else the family's tiny one (``tiny``: its part configs, see
    :func:`load_flux`; block counts from the weights)."""
    if stored is not None:
        return [(dict(stored["transformer"]), "the configs stored in the file")]
    found = [(_with_blocks(released(variant)["transformer"], layout), f"the released {variant} config")]
    if tiny is not None:
        found.append((_with_blocks(dict(tiny["transformer"]), layout), "the tiny test config"))
    return found


# ------------------------------------------------------------------------------------------------ the transformer
def load_transformer_file(
    path: Path,
    state: Mapping[str, Any],
    stored: Mapping | None,
    variant: str | None,
    dtype: Any,
    device: Any,
    tiny: Mapping | None = None,
) -> tuple[nn.Module, str]:
    """A BFL or diffusers transformer single file (``state``: its lazy reader, ``stored``: the configs stored in it)
    -> (module, variant)."""
    keys = _keys(state)
    found = variant_of_keys(keys)
    if found is None:
        raise ValueError(
            f"{path}: no FLUX.1 / Chroma transformer found (no double_blocks.0.img_attn.qkv.weight and no diffusers "
            "transformer_blocks.0.attn.add_k_proj.weight); pass the BFL transformer file (flux1-dev.safetensors) or "
            "a diffusers FLUX folder"
        )
    if variant is not None and found != variant:
        raise ValueError(f"{path}: this is a {found} model, but {variant} was expected; load it as {found}")
    if K.is_bfl(keys):
        view = K.BflToDiffusers(state)
        missing = view.missing_sources()
        if missing:
            raise ValueError(f"{path}: the BFL transformer lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}"
                             " (a truncated or partial file?)")  # fmt: skip
        unused = [k for k in view.unused_sources() if k.removeprefix(view.prefix).split(".")[0] in K.TOP_MODULES]
        if unused:
            raise ValueError(
                f"{path}: transformer weights this {found} model has no place for: {', '.join(unused[:3])}"
            )
        state, layout = view, view.layout
    else:
        if any(k.startswith("transformer.") for k in keys):
            state = strip_prefix(state, "transformer.")
        layout = K.diffusers_layout(_keys(state))
    candidates = transformer_candidates(found, layout, stored, tiny)
    module = instantiate_fitting(candidates, transformer_factory, state, "transformer", path, dtype, device,
                                 derive=transformer_from_shapes)  # fmt: skip
    return module, found


def load_transformer_folder(folder: Path, dtype: Any, device: Any) -> nn.Module:
    from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

    config = _transformer_config_file(folder)
    sub = config.parent
    cls = ChromaTransformer2DModel if json.loads(config.read_text())["_class_name"].startswith("Chroma") else (
        FluxTransformer2DModel)  # fmt: skip
    return cls.from_pretrained(sub, torch_dtype=dtype).to(device)


# ------------------------------------------------------------------------------------------------ text encoders, AE
def load_clip_l(
    path: Path, state: Mapping[str, Any], dtype: Any, device: Any, stored: Mapping | None = None,
    tiny: Mapping | None = None,
) -> nn.Module:  # fmt: skip
    """``--clip_l``: transformers ``CLIPTextModel`` keys, with or without ``text_model.`` (or under
    ``text_encoders.clip_l.transformer.``)."""
    canonical = clip.canonical_weights(state, ("text_encoders.clip_l.transformer.", "cond_stage_model.transformer."))
    if canonical is None:
        raise ValueError(f"--clip_l {path}: no CLIP text encoder weights (expected transformers CLIPTextModel keys "
                         "such as text_model.encoder.layers.0.self_attn.q_proj.weight)")  # fmt: skip
    canonical = {k: v for k, v in canonical.items() if not k.startswith(("text_projection", "logit_scale"))}
    candidates = _te_candidates(stored, 0, "flux-dev", tiny)
    return instantiate_fitting(candidates, clip_l_factory, canonical, "CLIP-L (--clip_l)", path, dtype, device,
                               hf_for_model, derive=clip.config_from_shapes)  # fmt: skip


def _te_candidates(stored: Mapping | None, index: int, variant: str, tiny: Mapping | None) -> list[tuple[dict, str]]:
    if stored is not None and len(stored.get("text_encoders", [])) > index:
        return [(dict(stored["text_encoders"][index]), "the configs stored in the file")]
    found = [(released(variant)["text_encoders"][index], "the released config")]
    return found + ([(dict(tiny["text_encoders"][index]), "the tiny config")] if tiny is not None else [])


# ------------------------------------------------------------------------------------------------ the whole model
def check_flux_path(path: str | Path, flag: str = "--pretrained_model_name_or_path") -> Path:
    return check_weights_path(
        path, flag, variant_of_folder, "a FLUX.1 / Chroma BFL .safetensors file or a diffusers FLUX folder",
        "not a diffusers FLUX / Chroma folder (no transformer/config.json of a FluxTransformer2DModel or "
        "ChromaTransformer2DModel)",
    )  # fmt: skip


def part_sources(variant: str) -> list[PartSource]:
    """The parts besides the transformer (in the order a missing-part error names them): the AE, CLIP-L (not
    Chroma) and T5-XXL (a pipeline folder's ``text_encoder_2/``; Chroma's ``text_encoder/``)."""
    if variant == "chroma":
        return [PartSource("--ae", "vae", "VAE"), PartSource("--t5xxl", "text_encoder", "T5-XXL")]
    return [PartSource("--ae", "vae", "VAE"), PartSource("--clip_l", "text_encoder", "CLIP-L"),
            PartSource("--t5xxl", "text_encoder_2", "T5-XXL")]  # fmt: skip


def load_flux(
    variant: str,
    path: str | Path,
    *,
    dtype: Any = torch.float32,
    device: Any = "cpu",
    clip_l: str | Path | None = None,
    t5xxl: str | Path | None = None,
    ae: str | Path | None = None,
    tokenizer_cache_dir: str | None = None,
    tiny: Mapping | None = None,
) -> Parts:
    """Load a ``variant`` ("flux-dev" | "flux-schnell" | "chroma") model from ``path`` and the part files (module
    docstring); ``dtype``: one dtype or :class:`PartDtypes`. Parts come back frozen, in eval mode, on ``device``.
    ``tiny``: the family's tiny model's part configs (``{"transformer", "vae", "text_encoders"}``), tried after the
    released ones for files that carry no configs."""
    dtypes = PartDtypes.of(dtype)
    path = check_flux_path(path)
    sources = part_sources(variant)
    files = ModelFiles(path, sources, {"--clip_l": clip_l, "--t5xxl": t5xxl, "--ae": ae}, not_found="no such file")
    found = variant_of_folder(path) if files.folder else None
    if files.folder is not None and found != variant:
        raise ValueError(f"{path}: this is a {found} model, but {variant} was expected; load it as {found}")
    files.require(lambda missing: _missing_parts(variant, path, files, sources, missing))
    if variant == "chroma" and "--clip_l" in files.given:
        log.warning("--clip_l is ignored: Chroma has no CLIP-L text encoder")
    if files.folder is None:
        denoiser, _ = load_transformer_file(path, files.state, files.stored, variant, dtypes.denoiser, device, tiny)
    else:
        denoiser = load_transformer_folder(path, dtypes.denoiser, device)
    read = _Readers(variant, dtypes, device, tiny)
    vae = files.load("--ae", read.ae, read.vae_folder)
    clip_l_encoder = [] if variant == "chroma" else [files.load("--clip_l", read.clip_l, read.text_encoder_folder)]
    encoders = [*clip_l_encoder, files.load("--t5xxl", read.t5, read.text_encoder_folder)]
    tokenizers = _tokenizers(variant, files.root, tokenizer_cache_dir)
    scheduler = files.scheduler_config(released(variant)["scheduler"])
    parts = Parts(denoiser, vae, encoders, tokenizers, scheduler, variant, str(path))
    return finish(parts, device)


@dataclass(frozen=True)
class _Readers:
    """How one load reads each part (``ModelFiles.load``'s readers): its dtypes, device and tiny configs."""

    variant: str
    dtypes: PartDtypes
    device: Any
    tiny: Mapping | None

    def ae(self, path: Path, state: Mapping, stored: Mapping | None, where: str) -> nn.Module:
        candidates = flux_ae.candidates(stored, released("flux-dev")["vae"], self.tiny and self.tiny["vae"])
        return flux_ae.load(path, state, candidates, self.dtypes.vae, self.device, where=where, what="AE (--ae)",
                            this="FLUX's AE")  # fmt: skip

    def clip_l(self, path: Path, state: Mapping, stored: Mapping | None, where: str) -> nn.Module:
        return load_clip_l(path, state, self.dtypes.text_encoders, self.device, stored, self.tiny)

    def t5(self, path: Path, state: Mapping, stored: Mapping | None, where: str) -> nn.Module:
        candidates = _te_candidates(stored, 0 if self.variant == "chroma" else 1, self.variant, self.tiny)
        return t5.load(path, state, candidates, self.dtypes.text_encoders, self.device, where=where,
                       what="T5 (--t5xxl)")  # fmt: skip

    def vae_folder(self, folder: Path) -> nn.Module:
        return _from_folder(folder, self.dtypes.vae, self.device, vae=True)

    def text_encoder_folder(self, folder: Path) -> nn.Module:
        return _from_folder(folder, self.dtypes.text_encoders, self.device)


def _missing_parts(variant: str, path: Path, files: ModelFiles, sources: list[PartSource], missing: list[str]) -> str:
    if files.folder is None:
        where = "a BFL single-file transformer"
    else:
        subs = ", ".join(f"{s.subfolder}/" for s in sources if s.flag in missing)
        where = f"the diffusers folder {path} (it has no {subs})"
    parts_needed = "the T5-XXL encoder and the AE" if variant == "chroma" else "CLIP-L, T5-XXL and the AE"
    return (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required with {where}: FLUX needs "
            f"{parts_needed}; pass the single files as sd-scripts does (e.g. --clip_l clip_l.safetensors --t5xxl "
            "t5xxl_fp16.safetensors --ae ae.safetensors)")  # fmt: skip


def _from_folder(folder: Path, dtype: Any, device: Any, vae: bool = False) -> nn.Module:
    """A diffusers VAE folder (``vae``) or a transformers CLIP-L / T5 folder."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, T5EncoderModel

    from ..loading import _tf_dtype

    if vae:
        return AutoencoderKL.from_pretrained(folder, torch_dtype=dtype).to(device)
    config = json.loads((folder / "config.json").read_text())
    cls = T5EncoderModel if config.get("model_type") == "t5" else CLIPTextModel
    return cls.from_pretrained(folder, **_tf_dtype(dtype)).to(device)


def _tokenizers(variant: str, root: Path | None, cache_dir: str | None) -> list:
    if variant == "chroma":
        return [t5.load_t5_tokenizer(root / "tokenizer" if root else None, cache_dir)]
    clip_spec = TextEncoderSpec("", "clip", False, PAD_CLIP_L, "openai/clip-vit-large-patch14", "clip_l")
    clip_tokenizer = load_tokenizers([clip_spec], root, cache_dir)[0]
    return [clip_tokenizer, t5.load_t5_tokenizer(root / "tokenizer_2" if root else None, cache_dir)]
