"""SD3 medium, SD3.5 medium and SD3.5 large: one class, three objects (``SD3_MEDIUM``, ``SD35_MEDIUM``,
``SD35_LARGE``; registry names "sd3", "sd3.5-medium", "sd3.5-large").

What differs between them is data, read from the weights: depth and width, SD3.5's RMS q/k norms, SD3.5-medium's
second attention in its first 13 blocks (``x_block.attn2``) and larger positional table. All three are rectified
flows in sd-scripts' SD3 formulation (``objective.SD3FlowObjective``: σ = t / 1000, the output
preconditioned to an x0 estimate ``x_σ − σ·o``), over the 16-channel VAE's ``(z − 0.0609) · 1.5305`` latents
(not packed: the transformer patches them itself), conditioned on CLIP-L ‖ CLIP-G ‖ T5-XXL (``text.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from ..autoencoders import flux_ae
from ..base import (
    FLOW_MATCHING,
    BlockList,
    Cond,
    FamilySpec,
    FlowSampling,
    PartDtypes,
    Parts,
    Root,
    TargetClasses,
)
from ..convert import hf_module_path
from ..saving import with_kind
from . import keys as K
from . import lora, pos_embed, text
from .blocks import SD3_BLOCKS
from .configs import SCALE, SHIFT, clip_factory, released, t5_factory, transformer_factory
from .full_training import SD3FullTraining
from .loading import CLIP_G_SPEC, CLIP_L_SPEC, T5_SPEC, load_sd3, variant_of_folder, variant_of_keys
from .objective import SD3FlowObjective, objective_problems, sd3_flow_objective
from .options import SD3Options
from .saving import pipeline_of, save_diffusers_folder, save_sai_file, sd3_modelspec
from .tiny import SD3Tiny

log = logging.getLogger(__name__)

IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"  # sd-scripts' sai_model_spec.py
IMPL_DIFFUSERS = "diffusers"
GROUP = "SD3"  # the group sd3_train_network.py trains, in messages that list families by group
SCRIPTS = {"network": "sd3_train_network.py", "fine_tune": "sd3_train.py", "dreambooth": "sd3_train.py"}

# sd-scripts' networks/lora_sd3.py: every Linear of the joint blocks (its SingleDiTBlock = our x / context sides),
# CLIP-L's and CLIP-G's attention and MLP modules; T5 only with its network_arg train_t5xxl (so the presets leave T5
# out). The ``full`` presets add the modules outside the blocks (sd-scripts' emb_dims: context, t, x, y embedders and
# the final layer's modulation and Linear).
CLIP_ATTENTION = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2")
SD3_TARGETS = TargetClasses(
    transformer=("JointTransformerBlock",),
    attention=("Attention",),
    text_encoder={"lora_te1": (*CLIP_ATTENTION, "CLIPMLP"), "lora_te2": (*CLIP_ATTENTION, "CLIPMLP"), "lora_te3": ()},
    full_names=("pos_embed", "context_embedder", "time_text_embed", "norm_out", "proj_out"),
    text_encoder_attention={"lora_te1": CLIP_ATTENTION, "lora_te2": CLIP_ATTENTION, "lora_te3": ()},
)


def _spec(name: str, title: str) -> FamilySpec:
    return FamilySpec(
        name=name,
        title=title,
        text_encoders=(CLIP_L_SPEC, CLIP_G_SPEC, T5_SPEC),
        configs={FLOW_MATCHING: name},
        pipeline_class="StableDiffusion3Pipeline",
        training_script="sd3_train_network.py",
        scripts=SCRIPTS,
        load_hint="sd3_train_network.py (with --clip_l --clip_g --t5xxl for an SAI file without text encoders)",
        detect=lambda sd, metadata: variant_of_keys(list(sd.keys())) == name,
        detect_folder=lambda folder: variant_of_folder(Path(folder)) == name,
        group=GROUP,
        block_swap=True,
    )


def options_of(parts: Parts) -> SD3Options:
    """The options the model was loaded with (defaults for parts built another way, e.g. a tiny model)."""
    return parts.options if isinstance(parts.options, SD3Options) else SD3Options()


def text_dropout_of(parts: Parts) -> text.TextDropout:
    """The loaded model's per-encoder dropout (rates from its options; widths from its CLIP-L / CLIP-G)."""
    options = options_of(parts)
    clip_l, clip_g = parts.text_encoders[0], parts.text_encoders[1]
    return text.TextDropout(
        clip_l_rate=float(options.clip_l_dropout_rate),
        clip_g_rate=float(options.clip_g_dropout_rate),
        t5_rate=float(options.t5_dropout_rate),
        l_width=int(clip_l.config.hidden_size),
        g_width=int(clip_g.config.hidden_size),
        l_pooled=int(clip_l.config.projection_dim),
    )


class SD3Family:
    """SD3 medium / SD3.5 medium / SD3.5 large (see the module docstring and ``ModelFamily``)."""

    vae_scale = SCALE
    vae_shift = SHIFT
    size_multiple = 16  # 8× VAE downscale, then 2×2 patches
    ss_v2 = False
    num_text_encoders = 3
    blocks = SD3_BLOCKS
    denoiser_name = "transformer"
    adapter_prefixes = ("lora_unet", "lora_te1", "lora_te2", "lora_te3")
    # --cache_text_encoder_outputs with CLIP adapters: T5 cached, CLIP-L and CLIP-G recomputed (sd-scripts'
    # get_models_for_text_encoding: text_encoders[0:2] + [None])
    partial_text_cache = (0, 1)
    fp8_skip = ()  # --fp8_base: every Linear in float8, the adaLN modulations too (as sd-scripts' mmdit.to(fp8))
    target_classes = SD3_TARGETS
    options = SD3Options
    full_training = SD3FullTraining()
    adapter_rules = MappingProxyType({lora.MODULE: lora})  # networks.lora_sd3

    def __init__(self, spec: FamilySpec, *, model_type: str) -> None:
        self.spec = spec
        self.name = spec.name
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)
        self._model_type = model_type  # sd-scripts' mmdit.model_type: "medium" | "5-medium" | "5-large"
        self._warned: set[str] = set()
        self.tiny = SD3Tiny(self)

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # ------------------------------------------------------------------------------------------- files
    def load(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype | PartDtypes = torch.float32,
        vae: str | Path | None = None,
        device: Any = "cpu",
        tokenizer_cache_dir: str | None = None,
        v_parameterization: bool | None = None,
        options: SD3Options | None = None,
    ) -> Parts:
        """Load an SAI single file (with or without its VAE and text encoders; + ``options.clip_l``, ``clip_g``,
        ``t5xxl`` and ``vae``: sd-scripts' flags) or a diffusers folder (see ``sd3/loading.py``). Raises
        ``ValueError`` naming the missing flag / the wrong file.

        The options (default :class:`SD3Options`: sd-scripts' defaults) become ``parts.options``: the T5 length
        (256) and the masks (prompts), the dropout rates (training steps only, see :meth:`predict`), and
        ``pos_emb_random_crop_rate`` (0) / ``enable_scaled_pos_embed`` (tables for the default resolution 1024, or
        ``pos_embed_resolutions``; :meth:`set_pos_embed` changes them once the dataset's resolutions are known),
        installed on the transformer (``sd3/pos_embed.py``)."""
        options = options or SD3Options()
        if v_parameterization:
            raise ValueError(f"--v_parameterization does not apply to {self.spec.title}: it is a flow-matching model")
        length = options.t5xxl_max_token_length
        if length is not None and length < 1:
            raise ValueError(f"--t5xxl_max_token_length {length}: must be a positive token count")
        rates = {"--clip_l_dropout_rate": options.clip_l_dropout_rate, "--clip_g_dropout_rate":
                 options.clip_g_dropout_rate, "--t5_dropout_rate": options.t5_dropout_rate}  # fmt: skip
        for flag, rate in rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{flag} {rate}: must be a probability in [0, 1]")
        if not 0.0 <= options.pos_emb_random_crop_rate <= 1.0:
            raise ValueError(f"--pos_emb_random_crop_rate {options.pos_emb_random_crop_rate}: must be a probability "
                             "in [0, 1]")  # fmt: skip
        parts = load_sd3(self.name, path, dtype=dtype, device=device, clip_l=options.clip_l, clip_g=options.clip_g,
                         t5xxl=options.t5xxl, vae=vae, tokenizer_cache_dir=tokenizer_cache_dir,
                         tiny=self.tiny.part_configs())  # fmt: skip
        parts.options = dataclasses.replace(options, t5xxl_max_token_length=length or text.T5_DEFAULT_LENGTH)
        resolutions = options.pos_embed_resolutions
        if resolutions is None and options.enable_scaled_pos_embed:
            resolutions = [self.default_resolution()]
        self.set_pos_embed(parts, float(options.pos_emb_random_crop_rate), resolutions)
        return parts

    def set_pos_embed(self, parts: Parts, random_crop_rate: float = 0.0, resolutions: Iterable | None = None) -> None:
        """sd-scripts' ``--pos_emb_random_crop_rate`` and ``--enable_scaled_pos_embed`` on the loaded transformer
        (``resolutions``: the training resolutions, (w, h) or int, as sd-scripts takes them from the datasets; None:
        the released table)."""
        resolutions = None if resolutions is None else list(resolutions)
        pos_embed.install(parts.denoiser, random_crop_rate, resolutions)
        parts.options = options_of(parts).with_pos_embed(random_crop_rate, resolutions)

    def save(
        self,
        parts: Parts,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        metadata: Mapping[str, str] | None = None,
        safetensors: bool = True,
        text_encoders: bool = True,
    ) -> Path:
        """``*.safetensors``: the SAI single file (transformer, VAE and, unless ``text_encoders`` is False, the text
        encoders; see ``sd3/saving.py``); any other path: a diffusers ``StableDiffusion3Pipeline`` folder."""
        path = Path(path)
        if path.suffix.lower() == ".safetensors":
            spec_meta = sd3_modelspec(self.modelspec_architecture(), self.modelspec_implementation(), path.stem,
                                      self.default_resolution())  # fmt: skip
            return save_sai_file(parts, path, dtype, metadata or {}, spec_meta, text_encoders)
        if path.suffix.lower() in (".ckpt", ".pt", ".pth"):
            raise ValueError(f"{path}: SD3 models are saved as .safetensors (SAI) or a diffusers folder, not pickles")
        return save_diffusers_folder(parts, path, dtype, safetensors, self.pipeline(parts, None))

    def reference_parts(self) -> Parts:
        """The released transformer, CLIP-L, CLIP-G and T5-XXL on the meta device, buffers too (the transformer's
        ``pos_embed`` table would otherwise be computed: 384² × 1536 values for SD3.5-medium); ``vae`` is None."""
        from accelerate import init_empty_weights

        configs = released(self.name)
        factories = (clip_factory, clip_factory, t5_factory)
        with init_empty_weights(include_buffers=True):
            denoiser = transformer_factory(configs["transformer"])()
            encoders = [f(c)() for f, c in zip(factories, configs["text_encoders"])]
        return Parts(denoiser, None, encoders, [], configs["scheduler"], self.name)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(
        self,
        parts: Parts,
        captions: list[str],
        max_token_length: int | None = None,
        *,
        t5xxl_max_token_length: int | None = None,
    ) -> list[Tensor]:
        """``[CLIP-L ids, CLIP-G ids (B, 77), T5 ids (B, T), CLIP-L mask, CLIP-G mask, T5 mask]`` (sd-scripts'
        ``Sd3TokenizeStrategy`` order); T = ``t5xxl_max_token_length`` or the loaded model's (256).
        ``max_token_length`` (CLIP's ``--max_token_length``) is ignored with a warning, as sd-scripts does."""
        if max_token_length not in (None, 75):
            self._warn_once("mtl", "--max_token_length %s is ignored for SD3 (CLIP reads 77 tokens; the T5 length is "
                            "--t5xxl_max_token_length)", max_token_length)  # fmt: skip
        length = t5xxl_max_token_length or options_of(parts).t5xxl_max_token_length or text.T5_DEFAULT_LENGTH
        l_ids, l_mask = text.tokenize_clip(parts.tokenizers[0], captions)
        g_ids, g_mask = text.tokenize_clip(parts.tokenizers[1], captions)
        t5_ids, t5_mask = text.tokenize_t5(parts.tokenizers[2], captions, length)
        return [l_ids, g_ids, t5_ids, l_mask, g_mask, t5_mask]

    def encode_tokens(
        self,
        parts: Parts,
        tokens: list[Tensor],
        clip_skip: int | None = None,
        *,
        apply_lg_attn_mask: bool | None = None,
        apply_t5_attn_mask: bool | None = None,
    ) -> Cond:
        """Cond(context (B, 77 + T, 4096), pooled (B, 2048), mask None) from :meth:`tokenize`'s ids (``text.py``).
        The masks go to the encoders when ``apply_lg_attn_mask`` / ``apply_t5_attn_mask`` (or the loaded model's
        settings) say so. ``clip_skip`` is ignored with a warning (sd-scripts ignores it for SD3)."""
        if clip_skip is not None:
            self._warn_once("clip_skip", "--clip_skip %s is ignored for SD3 (as in sd-scripts)", clip_skip)
        options = options_of(parts)
        lg = options.apply_lg_attn_mask if apply_lg_attn_mask is None else apply_lg_attn_mask
        t5 = options.apply_t5_attn_mask if apply_t5_attn_mask is None else apply_t5_attn_mask
        l_ids, g_ids, t5_ids, l_mask, g_mask, t5_mask = tokens
        l_out, l_pooled = text.clip_outputs(parts.text_encoders[0], l_ids, l_mask if lg else None)
        g_out, g_pooled = text.clip_outputs(parts.text_encoders[1], g_ids, g_mask if lg else None)
        t5_out = text.t5_hidden(parts.text_encoders[2], t5_ids, t5_mask if t5 else None)
        return text.join(l_out, g_out, t5_out, l_pooled, g_pooled)

    def encode_prompt(
        self,
        parts: Parts,
        captions: list[str],
        clip_skip: int | None = None,
        max_token_length: int | None = None,
        *,
        t5xxl_max_token_length: int | None = None,
        apply_lg_attn_mask: bool | None = None,
        apply_t5_attn_mask: bool | None = None,
    ) -> Cond:
        """:meth:`tokenize` then :meth:`encode_tokens`."""
        tokens = self.tokenize(parts, captions, max_token_length, t5xxl_max_token_length=t5xxl_max_token_length)
        return self.encode_tokens(parts, tokens, clip_skip, apply_lg_attn_mask=apply_lg_attn_mask,
                                  apply_t5_attn_mask=apply_t5_attn_mask)  # fmt: skip

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        """SD3 takes no size/crop conditioning."""
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        """sd-scripts' partial text cache (``--cache_text_encoder_outputs`` with CLIP adapters): T5's tokens from
        ``cached``, CLIP-L's and CLIP-G's features (the first 77 tokens) and pooled outputs recomputed from
        ``captions`` with autograd (the adapters train through them)."""
        lg = options_of(parts).apply_lg_attn_mask
        l_ids, l_mask = text.tokenize_clip(parts.tokenizers[0], captions)
        g_ids, g_mask = text.tokenize_clip(parts.tokenizers[1], captions)
        l_out, l_pooled = text.clip_outputs(parts.text_encoders[0], l_ids, l_mask if lg else None)
        g_out, g_pooled = text.clip_outputs(parts.text_encoders[1], g_ids, g_mask if lg else None)
        t5_part = cached.hidden_states[:, text.CLIP_LENGTH :]
        joined = text.join(l_out, g_out, t5_part, l_pooled, g_pooled)
        return Cond(joined.hidden_states, joined.pooled, cached.mask)

    # ------------------------------------------------------------------------------------------- denoising
    def predict(
        self,
        denoiser: nn.Module,
        noisy: Tensor,
        t: Tensor,
        cond: Cond,
        *,
        time_ids: Tensor | None = None,
        text_dropout: text.TextDropout | None = None,
    ) -> Tensor:
        """The transformer's output (B, 16, h, w) for noisy latents (B, 16, h, w) at t = σ·1000 (B,): diffusers'
        ``SD3Transformer2DModel(hidden_states, encoder_hidden_states=context, pooled_projections=pooled,
        timestep=t)``, as ``StableDiffusion3Pipeline`` calls it (and sd-scripts' MMDiT ``(x, t, y, context)``).

        ``text_dropout``: sd-scripts' per-encoder dropout (:func:`text.drop_encoders`), applied only when gradients
        are enabled (a training step; never validation or sampling, which run without them). Every training step
        gets it from :meth:`training_objective`."""
        if time_ids is not None:
            raise ValueError(f"{self.spec.title} takes no size/crop time_ids (only SDXL does)")
        if cond.pooled is None:
            raise ValueError("SD3 needs the pooled CLIP-L ‖ CLIP-G embedding (cond.pooled) to predict")
        if text_dropout is not None and torch.is_grad_enabled():
            cond = text.drop_encoders(cond, text_dropout)
        b = noisy.shape[0]
        timestep = t.to(noisy.device, torch.float32).expand(b).to(noisy.dtype)
        return denoiser(hidden_states=noisy, encoder_hidden_states=cond.hidden_states,
                        pooled_projections=cond.pooled, timestep=timestep, return_dict=False)[0]  # fmt: skip

    def objective(self, parts: Parts) -> str:
        """Always "flow_matching"."""
        return FLOW_MATCHING

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: SD3Options) -> list[str]:
        """What SD3's flow matching cannot train with (``objective.objective_problems``)."""
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> SD3FlowObjective:
        """sd-scripts' SD3 flow matching (``objective.sd3_flow_objective``: ``--weighting_scheme``,
        ``--logit_mean/std``, ``--mode_scale``, ``--training_shift`` from ``parts.options.flow``, the x0 target),
        whose every step gives :meth:`predict` the loaded model's text-encoder dropout
        (``--clip_l/clip_g/t5_dropout_rate``); ValueError when the model was loaded without the objective's flags."""
        flow = options_of(parts).flow
        if flow is None:
            raise ValueError(f"{self.spec.title} trains by flow matching, but the model was loaded without the "
                             "objective's flags (SD3Options.from_args(args, training=True))")  # fmt: skip
        objective = sd3_flow_objective(self.spec.title, flow, noise, loss)
        dropout = text_dropout_of(parts)
        if not dropout.active:
            return objective
        return dataclasses.replace(objective, predict_options={**objective.predict_options, "text_dropout": dropout})

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        """``--blocks_to_swap``: the joint blocks, one per unit (sd-scripts' MMDiT ``joint_blocks``)."""
        return [BlockList(denoiser.transformer_blocks, 1)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, 16, H/8, W/8): ``(z - 0.0609) · 1.5305``."""
        return flux_ae.encode(parts.vae, pixels, self.vae_scale, self.vae_shift, generator)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        """(B, 16, h, w) latents -> (B, 3, 8h, 8w) pixels in [-1, 1]: ``decode(z / 1.5305 + 0.0609)``."""
        return flux_ae.decode(parts.vae, latents, self.vae_scale, self.vae_shift)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the transformer under SAI module names (``joint_blocks.0.x_block.attn.proj``...), its fused
        modules (the ``qkv`` projections and the swapped modulations) as :class:`Fused`; ``lora_te1`` / ``lora_te2``:
        CLIP-L / CLIP-G with the ``text_model.`` level; ``lora_te3``: T5 under transformers' paths, as sd-scripts'
        ``networks/lora_sd3.py``."""
        denoiser = parts.denoiser
        layout = K.diffusers_layout(name for name, _ in denoiser.named_parameters())
        config = denoiser.config
        width = config.num_attention_heads * config.attention_head_dim
        roots = [Root("lora_unet", denoiser, K.module_renames(layout).__getitem__, K.fused_modules(layout, width))]
        for prefix, clip in zip(("lora_te1", "lora_te2"), parts.text_encoders[:2]):
            roots.append(Root(prefix, clip, hf_module_path(clip)))
        roots.append(Root("lora_te3", parts.text_encoders[2], _identity))
        return roots

    def base_model_version(self, prediction_type: str = FLOW_MATCHING) -> str:
        """``ss_base_model_version``: sd-scripts writes the MMDiT's model type, "medium" (SD3), "5-medium" or
        "5-large" (``sd3_train_network.load_target_model`` returns it as the model version)."""
        return self._model_type

    def modelspec_architecture(self, kind: str = "", prediction_type: str = FLOW_MATCHING) -> str:
        """``stable-diffusion-3-medium`` / ``stable-diffusion-3-5-medium`` / ``stable-diffusion-3-5-large``
        (+ "/lora"), as sd-scripts' sai_model_spec.py (``"stable-diffusion-3-" + model_type``)."""
        return with_kind(f"stable-diffusion-3-{self._model_type}", kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        """Checkpoints: Stability AI's generative-models URL; adapters: "diffusers" (what sd-scripts' SD3 LoRA
        metadata says: ``get_sai_model_spec(..., lora=True)`` without sdxl)."""
        return IMPL_DIFFUSERS if kind else IMPL_STABILITY_AI

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        """``StableDiffusion3Pipeline`` over ``parts`` (see :func:`pipeline_of`)."""
        return pipeline_of(parts, scheduler)

    def flow_sampling(self, parts: Parts) -> FlowSampling:
        """No embedded guidance, no resolution-dependent shift but the scheduler's static ``shift`` (3.0:
        ``parts.scheduler_config["shift"]``), 16 latent channels (the transformer's input channels), noise drawn
        unpacked, and sd-scripts' SD3 sample defaults: 30 steps, CFG scale 7.5 (``sd3_train_utils``)."""
        return FlowSampling(embedded_guidance=False, shift=False,
                            latent_channels=int(parts.denoiser.config.in_channels),
                            static_shift=float(parts.scheduler_config.get("shift", 3.0)), packed_noise=False,
                            default_steps=30, default_scale=7.5)  # fmt: skip

    def default_resolution(self, prediction_type: str = FLOW_MATCHING) -> int:
        """Native resolution: 1024."""
        return 1024


def _identity(path: str) -> str:
    return path


SD3_MEDIUM = SD3Family(_spec(K.SD3, "SD3-medium"), model_type="medium")
SD35_MEDIUM = SD3Family(_spec(K.SD35_MEDIUM, "SD3.5-medium"), model_type="5-medium")
SD35_LARGE = SD3Family(_spec(K.SD35_LARGE, "SD3.5-large"), model_type="5-large")
