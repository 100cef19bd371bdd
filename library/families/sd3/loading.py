"""Loading SD3 / SD3.5 as users have it, without the hub.

* ``path``: the SAI single file (``sd3.5_large.safetensors``, ``sd3_medium_incl_clips_t5xxlfp16.safetensors``): the
  transformer under ``model.diffusion_model.`` (or no prefix), with or without the VAE (``first_stage_model.``, LDM
  names) and the text encoders (``text_encoders.clip_l.transformer.``, ``text_encoders.clip_g.transformer.``,
  ``text_encoders.t5xxl.transformer.``, transformers names); bf16, fp16 or float8_e4m3fn tensors, each cast to the
  load dtype as it is read. Also a diffusers ``SD3Transformer2DModel`` single file (``transformer.`` prefix or not),
  a diffusers transformer folder, or a full ``StableDiffusion3Pipeline`` folder (``transformer/``, ``vae/``,
  ``text_encoder/`` CLIP-L, ``text_encoder_2/`` CLIP-G, ``text_encoder_3/`` T5, ``tokenizer*/``, ``scheduler/``).
* ``clip_l`` / ``clip_g`` / ``t5xxl`` / ``vae`` (sd-scripts' ``--clip_l --clip_g --t5xxl --vae``): single files with
  transformers names (CLIP: ``text_model.`` prefix or not, ``text_projection.weight`` optional: identity when absent,
  as sd-scripts and diffusers do for CLIP-L; T5: ``shared.weight`` + ``encoder.*`` or ``encoder.*`` only, fp8 too),
  the VAE under LDM or diffusers names, or diffusers folders. A flag replaces the part the model file or folder holds
  (sd-scripts reads an embedded CLIP-G / T5 even when the flag is given; here the flag wins, with a log line).
  A part neither the model nor a flag provides is an error naming the flag, raised before any weight is read.

The variant (sd3 / sd3.5-medium / sd3.5-large) is read from the weights (``keys.Layout.variant``). The transformer
config is read from the weights too, as sd-scripts' ``sd3_utils.analyze_state_dict_state`` does (width, depth,
patch, ``pos_embed`` size, context and pooled widths, dual-attention blocks, q/k norm); the head width is 64 (every
release), or the q/k norm's width when there is one, or the tiny model's 8 for widths no multiple of 64. Configs our
writer stored in the file (``sdtrain.configs``) come first.
"""

from __future__ import annotations

import json
import logging
import math
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
from ..loading import KeyView, check_weights_path, finish, instantiate, instantiate_fitting
from ..part_files import ModelFiles, PartSource
from ..tokenizers import PAD_CLIP_L, PAD_OPEN_CLIP, load_tokenizers
from . import keys as K
from .configs import clip_factory, released, transformer_factory

log = logging.getLogger(__name__)

TRANSFORMER_CLASS = "SD3Transformer2DModel"
TE_PREFIXES = ("text_encoders.clip_l.transformer.", "text_encoders.clip_g.transformer.",
               "text_encoders.t5xxl.transformer.")  # fmt: skip
TE_FLAGS = ("--clip_l", "--clip_g", "--t5xxl")
TE_FOLDERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
TE_TITLES = ("CLIP-L", "CLIP-G", "T5-XXL")
CLIP_L_SPEC = TextEncoderSpec("text_encoders.clip_l.transformer.", "clip", True, PAD_CLIP_L,
                              "openai/clip-vit-large-patch14", "clip_l")  # fmt: skip
CLIP_G_SPEC = TextEncoderSpec("text_encoders.clip_g.transformer.", "clip", True, PAD_OPEN_CLIP,
                              "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k", "clip_g")  # fmt: skip
T5_SPEC = TextEncoderSpec("text_encoders.t5xxl.transformer.", "t5", False, "<pad>", "google/t5-v1_1-xxl", "t5xxl")
VAE_PREFIX = "first_stage_model."


def _shape(state: Mapping[str, Any], key: str) -> tuple[int, ...]:
    return tuple(state.shape(key)) if callable(getattr(state, "shape", None)) else tuple(state[key].shape)


# ------------------------------------------------------------------------------------------------ what a path is
def variant_of_keys(keys: list[str]) -> str | None:
    """The variant of a single file's keys: an SAI transformer (prefix or not) or a diffusers one, else None."""
    if K.is_sai(keys):
        return K.sai_layout(keys).variant
    stripped = [k.removeprefix("transformer.") for k in keys]
    if K.is_diffusers(stripped):
        return K.diffusers_layout(stripped).variant
    return None


def _transformer_config_file(folder: Path) -> Path | None:
    for candidate in (folder / "transformer" / "config.json", folder / "config.json"):
        if candidate.is_file():
            try:
                if json.loads(candidate.read_text()).get("_class_name") == TRANSFORMER_CLASS:
                    return candidate
            except json.JSONDecodeError:
                return None
    return None


def variant_of_folder(folder: Path) -> str | None:
    """The variant of a diffusers SD3 pipeline or transformer folder (from its transformer config), else None."""
    config = _transformer_config_file(Path(folder))
    if config is None:
        return None
    data = json.loads(config.read_text())
    layout = K.Layout(int(data.get("num_layers", 0)), tuple(data.get("dual_attention_layers") or ()),
                      bool(data.get("qk_norm")))  # fmt: skip
    return layout.variant


# ------------------------------------------------------------------------------------------------ the transformer
def transformer_config(state: Mapping[str, Any], layout: K.Layout, tiny: Mapping | None = None) -> dict:
    """The ``SD3Transformer2DModel`` config of a diffusers-named transformer state dict (a dict or a lazy view) with
    ``layout``, read from its shapes (module docstring); widths no multiple of 64 take the head width and sample
    size of ``tiny`` (the family's tiny transformer config; None: the released 64 and 128)."""
    width, in_channels, patch, _ = _shape(state, "pos_embed.proj.weight")
    released_width = width % 64 == 0 or tiny is None
    head = _shape(state, "transformer_blocks.0.attn.norm_q.weight")[0] if layout.qk_norm else (
        64 if released_width else tiny["attention_head_dim"])  # fmt: skip
    return dict(
        sample_size=128 if released_width else tiny["sample_size"],
        patch_size=patch,
        in_channels=in_channels,
        num_layers=layout.num_layers,
        attention_head_dim=head,
        num_attention_heads=width // head,
        joint_attention_dim=_shape(state, "context_embedder.weight")[1],
        caption_projection_dim=_shape(state, "context_embedder.weight")[0],
        pooled_projection_dim=_shape(state, "time_text_embed.text_embedder.linear_1.weight")[1],
        out_channels=_shape(state, "proj_out.weight")[0] // (patch * patch),
        pos_embed_max_size=math.isqrt(_shape(state, "pos_embed.pos_embed")[1]),
        dual_attention_layers=tuple(layout.dual_attention_layers),
        qk_norm="rms_norm" if layout.qk_norm else None,
    )


def load_transformer_file(path: Path, state: Mapping[str, Any], stored: Mapping | None, variant: str | None,
                          dtype: Any, device: Any, tiny: Mapping | None = None) -> tuple[nn.Module, str]:  # fmt: skip
    """The transformer of an SAI or diffusers single file (``state``: its lazy reader, ``stored``: the configs stored
    in it) -> (module, variant)."""
    keys = list(state.keys())
    found = variant_of_keys(keys)
    if found is None:
        raise ValueError(
            f"{path}: no SD3 transformer found (no joint_blocks.0.x_block.attn.qkv.weight and no diffusers "
            "transformer_blocks.0.attn.add_k_proj.weight + pos_embed.proj.weight); pass the SAI single file "
            "(sd3.5_large.safetensors, sd3_medium.safetensors) or a diffusers SD3 folder"
        )
    if variant is not None and found != variant:
        raise ValueError(f"{path}: this is an {found} model, but {variant} was expected; load it as {found}")
    if K.is_sai(keys):
        transformer_keys = [k for k in keys if k.removeprefix(K.SAI_PREFIX).split(".")[0] in K.TOP_MODULES]
        view = K.SaiToDiffusers(KeyView(state, {k: k for k in transformer_keys}))
        missing = view.missing_sources()
        if missing:
            raise ValueError(f"{path}: the SAI transformer lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}"
                             " (a truncated or partial file?)")  # fmt: skip
        unused = view.unused_sources()
        if unused:
            raise ValueError(f"{path}: transformer weights this {found} model has no place for: "
                             f"{', '.join(unused[:3])}")  # fmt: skip
        named: Mapping[str, Any] = view
        layout = view.layout
    else:
        named = strip_prefix(state, "transformer.") if any(k.startswith("transformer.") for k in keys) else state
        layout = K.diffusers_layout(list(named.keys()))
    if stored and "transformer" in stored:
        config = dict(stored["transformer"])
    else:
        config = transformer_config(named, layout, tiny and tiny["transformer"])
    source = "the configs stored in the file" if stored else "the shapes of its weights"
    return instantiate(transformer_factory(config), named, "transformer", path, source, dtype, device=device), found


# ------------------------------------------------------------------------------------------------ text encoders, VAE
def _te_candidates(stored: Mapping | None, index: int, tiny: Mapping | None) -> list[tuple[dict, str]]:
    if stored is not None and len(stored.get("text_encoders", [])) > index:
        return [(dict(stored["text_encoders"][index]), "the configs stored in the file")]
    found = [(released(K.SD3)["text_encoders"][index], "the released config")]
    return found + ([(dict(tiny["text_encoders"][index]), "the tiny config")] if tiny is not None else [])


def load_clip(index: int, path: Path, state: Mapping[str, Any], dtype: Any, device: Any, stored: Mapping | None,
              what: str, tiny: Mapping | None = None) -> nn.Module:  # fmt: skip
    """CLIP-L (``index`` 0) or CLIP-G (1) as ``CLIPTextModelWithProjection`` from transformers names (``text_model.``
    prefix or not); a missing ``text_projection.weight`` is the identity (SAI's CLIP-L has none)."""
    canonical = clip.canonical_weights(state, (TE_PREFIXES[index], "cond_stage_model.transformer."))
    if canonical is None:
        raise ValueError(f"{what} {path}: no {TE_TITLES[index]} weights (expected transformers CLIP keys such as "
                         "text_model.encoder.layers.0.self_attn.q_proj.weight)")  # fmt: skip
    canonical = {k: v for k, v in canonical.items() if not k.startswith("logit_scale")}
    if "text_projection.weight" not in canonical:
        width = canonical["text_model.final_layer_norm.weight"].shape[0]
        canonical["text_projection.weight"] = torch.eye(width)
    candidates = _te_candidates(stored, index, tiny)
    return instantiate_fitting(candidates, clip_factory, canonical, f"{TE_TITLES[index]} ({what})", path, dtype, device,
                               hf_for_model, derive=clip.config_from_shapes)  # fmt: skip


def _from_folder(folder: Path, index: int | None, dtype: Any, device: Any) -> nn.Module:
    """A diffusers VAE folder (``index`` None) or a transformers CLIP-L / CLIP-G / T5 folder (``index`` 0, 1, 2)."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    from ..loading import _tf_dtype

    if index is None:
        return AutoencoderKL.from_pretrained(folder, torch_dtype=dtype).to(device)
    cls = T5EncoderModel if index == 2 else CLIPTextModelWithProjection
    return cls.from_pretrained(folder, **_tf_dtype(dtype)).to(device)


# ------------------------------------------------------------------------------------------------ the whole model
def check_sd3_path(path: str | Path, flag: str = "--pretrained_model_name_or_path") -> Path:
    return check_weights_path(
        path, flag, variant_of_folder,
        "an SD3 / SD3.5 SAI .safetensors file or a diffusers StableDiffusion3Pipeline folder",
        "not a diffusers SD3 folder (no transformer/config.json of an SD3Transformer2DModel)",
    )  # fmt: skip


PART_SOURCES = (
    PartSource("--clip_l", "text_encoder", "CLIP-L", TE_PREFIXES[0]),
    PartSource("--clip_g", "text_encoder_2", "CLIP-G", TE_PREFIXES[1]),
    PartSource("--t5xxl", "text_encoder_3", "T5-XXL", TE_PREFIXES[2]),
    PartSource("--vae", "vae", "VAE", VAE_PREFIX),
)


def load_sd3(
    variant: str,
    path: str | Path,
    *,
    dtype: Any = torch.float32,
    device: Any = "cpu",
    clip_l: str | Path | None = None,
    clip_g: str | Path | None = None,
    t5xxl: str | Path | None = None,
    vae: str | Path | None = None,
    tokenizer_cache_dir: str | None = None,
    tiny: Mapping | None = None,
) -> Parts:
    """Load a ``variant`` ("sd3" | "sd3.5-medium" | "sd3.5-large") model from ``path`` and the part files (module
    docstring); ``dtype``: one dtype or :class:`PartDtypes`. Parts come back frozen, in eval mode, on ``device``;
    ``text_encoders`` = [CLIP-L, CLIP-G, T5-XXL]. ``tiny``: the family's tiny model's part configs
    (``{"transformer", "vae", "text_encoders"}``), tried after the released ones for files that carry no configs."""
    dtypes = PartDtypes.of(dtype)
    path = check_sd3_path(path)
    given = dict(zip((*TE_FLAGS, "--vae"), (clip_l, clip_g, t5xxl, vae)))
    files = ModelFiles(path, PART_SOURCES, given)
    if files.folder is not None:
        found = variant_of_folder(path)
        if found != variant:
            raise ValueError(f"{path}: this is an {found} model, but {variant} was expected; load it as {found}")
    files.require(lambda missing: _missing_parts(path, files, missing))
    if files.folder is None:
        denoiser, _ = load_transformer_file(path, files.state, files.stored, variant, dtypes.denoiser, device, tiny)
    else:
        denoiser = _load_transformer_folder(path, dtypes.denoiser, device)
    read = _Readers(dtypes, device, tiny)
    encoders = [files.load(flag, read.text_encoder(i), read.folder(i)) for i, flag in enumerate(TE_FLAGS)]
    vae_module = files.load("--vae", read.vae, read.folder(None))
    tokenizers = _tokenizers(files.root, tokenizer_cache_dir)
    scheduler = files.scheduler_config(released(variant)["scheduler"])
    parts = Parts(denoiser, vae_module, encoders, tokenizers, scheduler, variant, str(path))
    return finish(parts, device)


@dataclass(frozen=True)
class _Readers:
    """How one load reads each part (``ModelFiles.load``'s readers): its dtypes, device and tiny configs."""

    dtypes: PartDtypes
    device: Any
    tiny: Mapping | None

    def text_encoder(self, index: int) -> Callable[[Path, Mapping, Mapping | None, str], nn.Module]:
        """CLIP-L (0), CLIP-G (1) or T5-XXL (2) from a file or the model file's part (``where``: flag or "model
        file")."""

        def read(path: Path, state: Mapping, stored: Mapping | None, where: str) -> nn.Module:
            dtype = self.dtypes.text_encoders
            if index == 2:
                candidates = _te_candidates(stored, 2, self.tiny)
                return t5.load(path, state, candidates, dtype, self.device, where=where, what=f"T5-XXL ({where})")
            return load_clip(index, path, state, dtype, self.device, stored, where, self.tiny)

        return read

    def vae(self, path: Path, state: Mapping, stored: Mapping | None, where: str) -> nn.Module:
        candidates = flux_ae.candidates(stored, released(K.SD3)["vae"], self.tiny and self.tiny["vae"], kind="VAE")
        return flux_ae.load(path, state, candidates, self.dtypes.vae, self.device, where=where, what=f"VAE ({where})",
                            this="SD3's 16-channel VAE", kind="VAE", ldm="LDM")  # fmt: skip

    def folder(self, index: int | None) -> Callable[[Path], nn.Module]:
        """A component folder: the VAE (``index`` None) or text encoder ``index``."""
        dtype = self.dtypes.vae if index is None else self.dtypes.text_encoders
        return lambda folder: _from_folder(folder, index, dtype, self.device)


def _missing_parts(path: Path, files: ModelFiles, missing: list[str]) -> str:
    where = f"the diffusers folder {path}" if files.folder is not None else f"the single file {path}"
    return (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required: {where} does not hold "
            f"{'this part' if len(missing) == 1 else 'these parts'} (SD3 needs CLIP-L, CLIP-G, T5-XXL and the VAE); "
            "pass the single files as sd-scripts does (e.g. --clip_l clip_l.safetensors --clip_g clip_g.safetensors "
            "--t5xxl t5xxl_fp16.safetensors), or a model file that includes them")  # fmt: skip


def _load_transformer_folder(folder: Path, dtype: Any, device: Any) -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(_transformer_config_file(folder).parent, torch_dtype=dtype).to(device)


def _tokenizers(root: Path | None, cache_dir: str | None) -> list:
    """CLIP-L (pads with ``<|endoftext|>``), CLIP-G (pads with "!", id 0, as sd-scripts forces) and T5: the
    folder's own, else ``--tokenizer_cache_dir``'s, else the bundled vocabularies."""
    clips = load_tokenizers([CLIP_L_SPEC, CLIP_G_SPEC], root, cache_dir)
    return [*clips, t5.load_t5_tokenizer(root / "tokenizer_3" if root else None, cache_dir)]
