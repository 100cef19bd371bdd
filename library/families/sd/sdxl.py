"""Stable Diffusion XL (base 1.0 and its fine-tunes, incl. v-prediction / zero-terminal-SNR ones): ``SDXL``.

Conditioning, as sd-scripts (``strategy_sdxl.py``) and diffusers' ``StableDiffusionXLPipeline.encode_prompt``:
CLIP-L's and OpenCLIP-bigG's penultimate hidden states (no final LayerNorm) concatenated on the feature axis
(768 + 1280 = 2048), the pooled text embedding of bigG (projected, from the first chunk), and six size/crop numbers
per sample (``time_ids``). sd-scripts indexes CLIP-L's ``hidden_states[11]``, which is ``hidden_states[-2]`` of the
12-layer model; ``[-2]`` is used here so models of any depth work. ``clip_skip`` does not apply to SDXL (sd-scripts
warns and ignores it; so does this family).

Kohya SDXL LoRA keys name UNet modules by their original (sgm) paths: ``adapter_roots`` maps diffusers paths
through ``unet_keys.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from library.objectives.ddpm import DDPMObjective, ddpm_objective, ddpm_problems
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from ..autoencoders.kl import decode_latents, encode_latents
from ..base import BlockList, Cond, FamilySpec, PartDtypes, Parts, Root, TextEncoderSpec, module_device
from ..convert import hf_module_path
from ..options import NoOptions
from ..saving import with_kind
from ..tokenizers import PAD_CLIP_L, PAD_OPEN_CLIP
from . import text
from .blocks import SGM_BLOCKS
from .family import UNET_TARGET_CLASSES
from .full_training import SDXLFullTraining
from .loading import load_model, reference_parts, refuse_refiner, sd_family_of_folder, sd_family_of_keys
from .saving import IMPL_SGM, make_pipeline, save_family_model
from .tiny import SDTiny
from .unet_keys import block_map, diffusers_to_ldm

log = logging.getLogger(__name__)

SDXL_SPEC = FamilySpec(
    name="sdxl",
    title="SDXL",
    text_encoders=(
        TextEncoderSpec(
            "conditioner.embedders.0.transformer.", "clip", False, PAD_CLIP_L, "openai/clip-vit-large-patch14", "clip_l"
        ),
        TextEncoderSpec(
            "conditioner.embedders.1.model.",
            "open_clip",
            True,
            PAD_OPEN_CLIP,
            "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k",
            "clip_g",
        ),
    ),  # fmt: skip
    configs={"epsilon": "sdxl-base", "v_prediction": "sdxl-base"},
    pipeline_class="StableDiffusionXLPipeline",
    training_script="sdxl_train_network.py",
    scripts={
        "network": "sdxl_train_network.py",
        "fine_tune": "sdxl_train.py",
        "dreambooth": "sdxl_train.py",
        "textual_inversion": "sdxl_train_textual_inversion.py",
    },  # sdxl_train.py also takes DreamBooth folders
    load_hint="the sdxl_* scripts, e.g. sdxl_train_network.py",
    flag="sdxl",
    detect=lambda sd, metadata: sd_family_of_keys(sd) == "sdxl",
    detect_folder=lambda folder: sd_family_of_folder(folder) == "sdxl",
    refuse=refuse_refiner,
)


class SDXLFamily:
    """SDXL: two text encoders, pooled embedding and size/crop conditioning. See ``ModelFamily``."""

    name = "sdxl"
    spec = SDXL_SPEC
    vae_scale = 0.13025
    size_multiple = 32  # sd-scripts allows bucket steps of 32 for SDXL
    num_text_encoders = 2
    ti_embedding_keys = tuple(te.ti_key for te in SDXL_SPEC.text_encoders)  # ("clip_l", "clip_g")
    ss_v2 = False
    adapter_prefixes = ("lora_unet", "lora_te1", "lora_te2")
    blocks = SGM_BLOCKS
    denoiser_name = "UNet"
    partial_text_cache = None  # every text output comes from an encoder adapters may train
    options = NoOptions  # every flag an SD model reads is a shared one
    full_training = SDXLFullTraining()
    fp8_skip = ("norm",)  # --fp8_base keeps the UNet's norm layers in the compute dtype (diffusers' rule)
    target_classes = UNET_TARGET_CLASSES  # the SD UNet and CLIP classes (``family.UNET_TARGET_CLASSES``)
    adapter_rules = MappingProxyType({})  # no module of its own: networks.lora / lycoris.kohya

    def __init__(self) -> None:
        self._warned_clip_skip = False
        self.tiny = SDTiny("sdxl")

    def __repr__(self) -> str:
        return "<model family sdxl>"

    # ------------------------------------------------------------------------------------------- files
    def load(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype | PartDtypes = torch.float32,
        vae: str | Path | None = None,
        v_parameterization: bool | None = None,
        tokenizer_cache_dir: str | None = None,
        device: Any = "cpu",
        options: NoOptions | None = None,
    ) -> Parts:
        """Load a diffusers folder or a single file; see ``SDFamily.load`` (v-prediction also from ``v_pred``)."""
        return load_model(
            self.spec, path, dtype=dtype, vae=vae, v_parameterization=v_parameterization,
            tokenizer_cache_dir=tokenizer_cache_dir, device=device,
        )  # fmt: skip

    def save(
        self,
        parts: Parts,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        metadata: Mapping[str, str] | None = None,
        safetensors: bool = True,
    ) -> Path:
        """Save the full model: ``*.safetensors`` / ``*.ckpt`` single file (sgm keys), else a diffusers folder."""
        return save_family_model(self, parts, path, dtype, metadata, safetensors)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """``[ids for CLIP-L (B, 77·k), ids for bigG (B, 77·k)]`` (bigG pads with "!")."""
        return [text.tokenize(tok, captions, max_token_length) for tok in parts.tokenizers]

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(hidden (B, 77 or 75·k+2, D1+D2), pooled (B, P2)). ``clip_skip`` is ignored, with a warning."""
        if clip_skip is not None and not self._warned_clip_skip:
            log.warning("--clip_skip %d is ignored for SDXL (it always uses the penultimate layers)", clip_skip)
            self._warned_clip_skip = True
        te1, te2 = parts.text_encoders
        ids1, batch, n = text.split_chunks(tokens[0])
        ids2, _, _ = text.split_chunks(tokens[1])
        out1 = te1(ids1.to(module_device(te1)), output_hidden_states=True, return_dict=True)
        out2 = te2(ids2.to(module_device(te2)), output_hidden_states=True, return_dict=True)
        hidden1 = text.merge_chunks(out1.hidden_states[-2], batch, n)
        hidden2 = text.merge_chunks(out2.hidden_states[-2], batch, n)
        pooled = text.eos_pooled(te2, out2.last_hidden_state, ids2, parts.tokenizers[1].eos_token_id)[::n]
        return Cond(torch.cat([hidden1, hidden2.to(hidden1.dtype)], dim=-1), pooled)

    def encode_prompt(
        self, parts: Parts, captions: list[str], clip_skip: int | None = None, max_token_length: int | None = None
    ) -> Cond:
        """:meth:`tokenize` then :meth:`encode_tokens`."""
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length), clip_skip)

    # ------------------------------------------------------------------------------------------- denoising
    @staticmethod
    def time_ids(
        original_sizes: Sequence[Sequence[int]],
        crop_top_lefts: Sequence[Sequence[int]],
        target_sizes: Sequence[Sequence[int]],
    ) -> Tensor:
        """(B, 6) float32 ``[orig_h, orig_w, crop_top, crop_left, target_h, target_w]`` per sample (sizes as (h, w))."""
        if not len(original_sizes) == len(crop_top_lefts) == len(target_sizes):
            raise ValueError("time_ids: original_sizes, crop_top_lefts and target_sizes must have one entry per sample")
        rows = [[*o, *c, *t] for o, c, t in zip(original_sizes, crop_top_lefts, target_sizes)]
        if any(len(r) != 6 for r in rows):
            raise ValueError("time_ids: every size and crop must be a pair (h, w) / (top, left)")
        return torch.tensor(rows, dtype=torch.float32)

    def predict(
        self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *, time_ids: Tensor | None = None
    ) -> Tensor:
        """UNet output (B, 4, h, w); needs ``cond.pooled`` (B, P) and ``time_ids`` (B, 6) from :meth:`time_ids`."""
        if time_ids is None or cond.pooled is None:
            raise ValueError("SDXL needs the pooled text embedding and time_ids (SDXL.time_ids(...)) to predict")
        added = {"text_embeds": cond.pooled, "time_ids": time_ids.to(noisy.device)}
        return denoiser(noisy, t, encoder_hidden_states=cond.hidden_states, added_cond_kwargs=added).sample

    def objective(self, parts: Parts) -> str:
        """The loaded model's prediction type: "epsilon" (SDXL base) or "v_prediction" (v-pred fine-tunes)."""
        return parts.prediction_type

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: NoOptions) -> list[str]:
        """What the DDPM objective cannot train with (``library.objectives.ddpm.ddpm_problems``)."""
        return ddpm_problems(noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> DDPMObjective:
        """Epsilon or v-prediction (:meth:`objective`) on the model's DDPM schedule."""
        return ddpm_objective(self.spec.title, self.objective(parts), parts.scheduler_config, noise, loss)

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        """Not possible here (``partial_text_cache`` None): every output comes from a trained encoder."""
        raise ValueError(f"{self.spec.title}: cached text-encoder outputs cannot train text-encoder adapters; add "
                         "--network_train_unet_only or drop --cache_text_encoder_outputs")  # fmt: skip

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> Tensor:
        """(B, 6) ``time_ids`` from per-sample (h, w) sizes / (top, left) crops (tensors (B, 2) or lists)."""
        lists = [x.tolist() if isinstance(x, Tensor) else x for x in (original_sizes, crop_top_lefts, target_sizes)]
        return self.time_ids(*([[int(v) for v in pair] for pair in x] for x in lists))

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, 4, H/8, W/8) sampled latents times 0.13025 (fp16 VAE upcast to fp32)."""
        return encode_latents(parts.vae, pixels, self.vae_scale, generator)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        """(B, 4, h, w) latents -> (B, 3, 8h, 8w) pixels in [-1, 1]."""
        return decode_latents(parts.vae, latents, self.vae_scale)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """(kohya prefix, module, rename): UNet paths -> sgm names (``input_blocks.4.1...``; KeyError for modules
        with no sgm name, e.g. ``time_proj``), text encoder paths with the ``text_model.`` level."""
        unet = parts.denoiser
        table = block_map(unet.config)
        te1, te2 = parts.text_encoders
        return [
            Root("lora_unet", unet, lambda path: diffusers_to_ldm(path, unet.config, table)),
            Root("lora_te1", te1, hf_module_path(te1)),
            Root("lora_te2", te2, hf_module_path(te2)),
        ]

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        """No lists: a UNet has no transformer block lists to swap (sd-scripts' ``--blocks_to_swap`` is FLUX / SD3 only)."""
        return []

    def base_model_version(self, prediction_type: str = "epsilon") -> str:
        """``ss_base_model_version``: always ``sdxl_base_v1-0`` (as sd-scripts)."""
        return "sdxl_base_v1-0"

    def modelspec_architecture(self, kind: str = "", prediction_type: str = "epsilon") -> str:
        """``stable-diffusion-xl-v1-base`` (+ "/lora" or "/textual-inversion")."""
        return with_kind("stable-diffusion-xl-v1-base", kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        """``modelspec.implementation``: the sgm URL for every SDXL file (sd-scripts)."""
        return IMPL_SGM

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        """A diffusers ``StableDiffusionXLPipeline`` over ``parts`` (the same modules, no copies) with ``scheduler``,
        for sampling: the one place that picks the pipeline class."""
        return make_pipeline(self.spec, parts, scheduler)

    def flow_sampling(self, parts: Parts) -> None:
        """SDXL is not a flow-matching model: it samples with diffusers' schedulers (``sampling/schedulers.py``)."""
        return None

    def default_resolution(self, prediction_type: str = "epsilon") -> int:
        """Native resolution: 1024."""
        return 1024

    def reference_parts(self) -> Parts:
        """The released architecture on the meta device (see ``ModelFamily.reference_parts``)."""
        return reference_parts(self.spec)


SDXL = SDXLFamily()
