"""FLUX.1 dev / schnell and Chroma: one class, three objects (``FLUX_DEV``, ``FLUX_SCHNELL``, ``CHROMA``).

What differs between them is data: dev embeds a guidance scale (``guidance_in``), schnell does not; Chroma has no
CLIP-L and takes its modulation from an approximator (``distilled_guidance_layer``) instead of per-block
``*_mod.lin`` Linears, and always masks T5's padding. All three are rectified flows trained on the velocity
``noise - x0`` at σ = t / 1000 (the objective "flow_matching"), over the 16-channel AE's ``(z - shift) · scale``
latents packed 2×2.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

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
    TextEncoderSpec,
)
from ..convert import hf_module_path
from ..saving import with_kind
from ..tokenizers import PAD_CLIP_L
from . import keys as K
from . import latents as L
from . import lora, text
from .blocks import FLUX_BLOCKS
from .configs import clip_l_factory, released, scheduler_kwargs, t5_factory, transformer_factory
from .full_training import FluxFullTraining
from .loading import load_flux, variant_of_folder, variant_of_keys
from .objective import FlowMatchingObjective, flow_matching_objective, objective_problems
from .options import FluxOptions
from .saving import flux_modelspec, save_bfl_file, save_diffusers_folder
from .tiny import FluxTiny

log = logging.getLogger(__name__)

IMPL_FLUX = "https://github.com/black-forest-labs/flux"  # sd-scripts' sai_model_spec.py
IMPL_CHROMA = "https://huggingface.co/lodestones/Chroma"
GROUP = "FLUX"  # the group flux_train_network.py trains, in messages that list families by group
SCRIPTS = {"network": "flux_train_network.py", "fine_tune": "flux_train.py", "dreambooth": "flux_train.py"}
CLIP_L_SPEC = TextEncoderSpec("text_encoders.clip_l.transformer.", "clip", False, PAD_CLIP_L,
                              "openai/clip-vit-large-patch14", "clip_l")  # fmt: skip
T5_SPEC = TextEncoderSpec("text_encoders.t5xxl.transformer.", "t5", False, "<pad>", text.T5_TOKENIZER_ID, "t5xxl")
DEFAULT_GUIDANCE = FluxOptions.guidance_scale  # sd-scripts' --guidance_scale default (3.5)

# sd-scripts' networks/lora_flux.py: every Linear of the double / single blocks, and CLIP-L's attention and MLP
# modules; T5 only with its network_arg train_t5xxl (lora.py: T5's classes under lora_te3), so the presets leave T5 out.
# The ``full`` presets add the Linears outside the blocks (sd-scripts' in_dims modules and the final projection).
CLIP_ATTENTION = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2")
FLUX_TARGETS = TargetClasses(
    transformer=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    attention=("FluxAttention",),
    text_encoder={"lora_te1": (*CLIP_ATTENTION, "CLIPMLP"), "lora_te3": ()},
    full_names=("x_embedder", "context_embedder", "time_text_embed", "proj_out"),
    text_encoder_attention={"lora_te1": CLIP_ATTENTION, "lora_te3": ()},
)
CHROMA_TARGETS = TargetClasses(
    transformer=("ChromaTransformerBlock", "ChromaSingleTransformerBlock"),
    attention=("FluxAttention",),
    text_encoder={"lora_te3": ()},
    full_names=("x_embedder", "context_embedder", "distilled_guidance_layer", "proj_out"),
    text_encoder_attention={"lora_te3": ()},
)


def _spec(name: str, title: str, pipeline: str, encoders: tuple[TextEncoderSpec, ...]) -> FamilySpec:
    return FamilySpec(
        name=name,
        title=title,
        text_encoders=encoders,
        configs={FLOW_MATCHING: name},
        pipeline_class=pipeline,
        training_script="flux_train_network.py",
        scripts=SCRIPTS,
        load_hint="flux_train_network.py (with --clip_l --t5xxl --ae for a BFL file)",
        detect=lambda sd, metadata: variant_of_keys(list(sd.keys())) == name,
        detect_folder=lambda folder: variant_of_folder(Path(folder)) == name,
        group=GROUP,
        block_swap=True,
        tool_flag="flux",  # sd-scripts' tools/cache_text_encoder_outputs.py --flux
    )


class FluxFamily:
    """FLUX.1 dev / schnell or Chroma (see the module docstring and ``ModelFamily``)."""

    vae_scale = 0.3611
    vae_shift = 0.1159
    size_multiple = 16  # 8× AE downscale, then 2×2 patches
    ss_v2 = False
    blocks = FLUX_BLOCKS
    denoiser_name = "transformer"
    fp8_skip = ()  # --fp8_base: every Linear in float8, the adaLN modulations too (as sd-scripts' model.to(fp8))
    options = FluxOptions
    full_training = FluxFullTraining()
    adapter_rules = MappingProxyType({lora.MODULE: lora})  # networks.lora_flux

    def __init__(self, spec: FamilySpec, *, version: str, architecture: str, implementation: str, t5_length: int,
                 targets: TargetClasses) -> None:  # fmt: skip
        self.spec = spec
        self.name = spec.name
        self.chroma = spec.name == "chroma"
        self.num_text_encoders = len(spec.text_encoders)
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)
        self.adapter_prefixes = ("lora_unet", "lora_te3") if self.chroma else ("lora_unet", "lora_te1", "lora_te3")
        self.target_classes = targets
        # --cache_text_encoder_outputs with CLIP-L adapters: T5 cached, CLIP-L (index 0) recomputed (sd-scripts)
        self.partial_text_cache: tuple[int, ...] = () if self.chroma else (0,)
        self._version = version
        self._architecture = architecture
        self._implementation = implementation
        self.t5_max_length = t5_length  # sd-scripts' --t5xxl_max_token_length default
        self._warned: set[str] = set()
        self.tiny = FluxTiny(self)

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
        v_parameterization: bool | None = None,
        tokenizer_cache_dir: str | None = None,
        device: Any = "cpu",
        options: FluxOptions | None = None,
    ) -> Parts:
        """Load a BFL single file (+ ``options.clip_l``, ``t5xxl``, ``ae``: sd-scripts' ``--clip_l --t5xxl --ae``) or a
        diffusers folder (see ``flux/loading.py``). ``vae``: the same as ``ae`` (``--vae``). The options (default
        :class:`FluxOptions`) become ``parts.options`` with the variant's T5 length (512 dev / Chroma, 256 schnell)
        and Chroma's mask filled in; their ``guidance_scale`` is the embedded guidance every training step gives
        FLUX.1-dev (read by :meth:`training_objective`). Raises ``ValueError`` naming the missing flag / the wrong
        file."""
        options = options or FluxOptions()
        ae = options.ae
        if v_parameterization:
            raise ValueError(f"--v_parameterization does not apply to {self.spec.title}: it is a flow-matching model")
        if vae is not None and ae is not None and Path(vae) != Path(ae):
            raise ValueError("--vae and --ae name different files; FLUX has one AE: pass --ae only")
        length = options.t5xxl_max_token_length
        if length is not None and length < 1:
            raise ValueError(f"--t5xxl_max_token_length {length}: must be a positive token count")
        parts = load_flux(self.name, path, dtype=dtype, device=device, clip_l=options.clip_l, t5xxl=options.t5xxl,
                          ae=ae or vae, tokenizer_cache_dir=tokenizer_cache_dir, tiny=self.tiny.part_configs())  # fmt: skip
        parts.options = dataclasses.replace(options, t5xxl_max_token_length=length or self.t5_max_length,
                                            apply_t5_attn_mask=self.chroma or options.apply_t5_attn_mask)  # fmt: skip
        return parts

    def save(
        self,
        parts: Parts,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        metadata: Mapping[str, str] | None = None,
        safetensors: bool = True,
    ) -> Path:
        """``*.safetensors``: the transformer as a BFL single file (what sd-scripts' flux_train.py writes; the AE and
        text encoders stay the user's files); any other path: a diffusers folder of every part."""
        path = Path(path)
        if path.suffix.lower() == ".safetensors":
            spec_meta = flux_modelspec(self._architecture, self._implementation, path.stem, self.default_resolution())
            return save_bfl_file(parts, path, dtype, metadata or {}, spec_meta)
        if path.suffix.lower() in (".ckpt", ".pt", ".pth"):
            raise ValueError(f"{path}: FLUX models are saved as .safetensors (BFL) or a diffusers folder, not pickles")
        return save_diffusers_folder(parts, path, dtype, safetensors, self.pipeline(parts, None))

    def reference_parts(self) -> Parts:
        """The released transformer, CLIP-L (not Chroma) and T5-XXL on the meta device; ``vae`` is None."""
        from accelerate import init_empty_weights

        configs = released(self.name)
        factories = ([] if self.chroma else [clip_l_factory]) + [t5_factory]
        with init_empty_weights():
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
        """``[CLIP-L ids (B, 77), T5 ids (B, L), T5 mask (B, L)]`` (Chroma: no CLIP-L ids); L =
        ``t5xxl_max_token_length`` or the loaded model's setting. ``max_token_length`` (CLIP's
        ``--max_token_length``) is ignored with a warning, as sd-scripts does for FLUX."""
        if max_token_length not in (None, 75):
            self._warn_once("mtl", "--max_token_length %s is ignored for FLUX (CLIP-L reads 77 tokens; the T5 length "
                            "is --t5xxl_max_token_length)", max_token_length)  # fmt: skip
        length = t5xxl_max_token_length or _options(parts).t5xxl_max_token_length or self.t5_max_length
        t5_ids, mask = text.tokenize_t5(parts.tokenizers[-1], captions, length)
        clip = [] if self.chroma else [text.tokenize_clip_l(parts.tokenizers[0], captions)]
        return [*clip, t5_ids, mask]

    def encode_tokens(
        self,
        parts: Parts,
        tokens: list[Tensor],
        clip_skip: int | None = None,
        *,
        apply_t5_attn_mask: bool | None = None,
    ) -> Cond:
        """Cond(T5 last hidden state (B, L, 4096), CLIP-L pooler_output (B, 768) (Chroma: None), T5 mask (B, L) when
        the mask is applied (``apply_t5_attn_mask`` or the loaded model's setting; Chroma: always), else None).
        ``clip_skip`` is ignored with a warning (sd-scripts ignores it for FLUX)."""
        if clip_skip is not None:
            self._warn_once("clip_skip", "--clip_skip %s is ignored for FLUX (as in sd-scripts)", clip_skip)
        if apply_t5_attn_mask is None:
            apply_t5_attn_mask = _options(parts).apply_t5_attn_mask
        apply = self.chroma or bool(apply_t5_attn_mask)
        *clip_ids, t5_ids, mask = tokens
        pooled = None if self.chroma else text.clip_l_pooled(parts.text_encoders[0], clip_ids[0])
        hidden = text.t5_hidden(parts.text_encoders[-1], t5_ids, mask if apply else None)
        mask = mask.to(hidden.device) if apply else None
        return Cond(hidden, None if pooled is None else pooled.to(hidden.dtype), mask)

    def encode_prompt(
        self,
        parts: Parts,
        captions: list[str],
        clip_skip: int | None = None,
        max_token_length: int | None = None,
        *,
        t5xxl_max_token_length: int | None = None,
        apply_t5_attn_mask: bool | None = None,
    ) -> Cond:
        """:meth:`tokenize` then :meth:`encode_tokens`."""
        tokens = self.tokenize(parts, captions, max_token_length, t5xxl_max_token_length=t5xxl_max_token_length)
        return self.encode_tokens(parts, tokens, clip_skip, apply_t5_attn_mask=apply_t5_attn_mask)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        """FLUX takes no size/crop conditioning."""
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        """sd-scripts' partial text cache (``--cache_text_encoder_outputs`` with CLIP-L adapters): T5's hidden states
        and mask from ``cached``, CLIP-L's pooled output (B, 768) recomputed from ``captions`` with autograd (the
        adapters train through it). Chroma has no CLIP-L: ``cached`` as it is (T5 adapters are never trained over a
        cache: ``train_t5xxl`` refuses it, as sd-scripts)."""
        if self.chroma:
            return cached
        ids = text.tokenize_clip_l(parts.tokenizers[0], captions)
        pooled = text.clip_l_pooled(parts.text_encoders[0], ids)
        return Cond(cached.hidden_states, pooled.to(cached.hidden_states.dtype), cached.mask)

    # ------------------------------------------------------------------------------------------- denoising
    def predict(
        self,
        denoiser: nn.Module,
        noisy: Tensor,
        t: Tensor,
        cond: Cond,
        *,
        guidance: float | Tensor | None = None,
        time_ids: Tensor | None = None,
    ) -> Tensor:
        """The velocity (B, 16, h, w) for noisy latents (B, 16, h, w) at t = σ·1000 (B,).

        The latents are packed 2×2 into (B, h/2·w/2, 64) tokens with position ids (0, row, column), text ids zero,
        the transformer gets timestep t / 1000, ``cond.pooled`` (FLUX.1), ``guidance`` (dev only: a float or (B,)
        tensor, default sd-scripts' 3.5; schnell has no guidance input and ignores it, as sd-scripts), and, when
        ``cond.mask`` is set, a key mask over [text, image] (padding not attended; Chroma attends one padding token,
        as sd-scripts and ChromaPipeline, and the text is cut to the batch's longest + that token, as sd-scripts'
        Chroma: the mask only where lengths differ); the output is unpacked."""
        if time_ids is not None:
            raise ValueError(f"{self.spec.title} takes no size/crop time_ids (only SDXL does)")
        b, _, h, w = noisy.shape
        tokens = L.pack(noisy)
        hidden, chroma_mask = cond.hidden_states, None
        if self.chroma and cond.mask is not None:  # the padding no token attends: not computed (sd-scripts too)
            hidden, chroma_mask = text.trim_padding(hidden, cond.mask, extra_padding=1)
        img_ids = L.image_ids(h, w, noisy.device, noisy.dtype)
        txt_ids = torch.zeros(hidden.shape[1], 3, device=noisy.device, dtype=noisy.dtype)
        timestep = (t.to(noisy.device, torch.float32) / 1000).expand(b).to(noisy.dtype)
        kwargs: dict[str, Any] = dict(hidden_states=tokens, encoder_hidden_states=hidden, timestep=timestep,
                                      img_ids=img_ids, txt_ids=txt_ids, return_dict=False)  # fmt: skip
        if self.chroma:
            if guidance is not None and float(torch.as_tensor(guidance).abs().max()) != 0:
                self._warn_once("chroma_g", "Chroma (diffusers' ChromaTransformer2DModel) takes no guidance input: "
                                "guidance %s is ignored; sd-scripts' docs use --guidance_scale 0 for Chroma",
                                guidance)  # fmt: skip
            if chroma_mask is not None:  # texts of different lengths in the batch
                kwargs["attention_mask"] = text.transformer_mask(chroma_mask, tokens.shape[1], extra_padding=1)
        else:
            if cond.pooled is None:
                raise ValueError("FLUX.1 needs the CLIP-L pooled embedding (cond.pooled) to predict")
            kwargs["pooled_projections"] = cond.pooled
            if getattr(_config_of(denoiser), "guidance_embeds", False):
                g = DEFAULT_GUIDANCE if guidance is None else guidance
                kwargs["guidance"] = torch.as_tensor(g, dtype=torch.float32, device=noisy.device).expand(b)
            if cond.mask is not None:
                mask = text.transformer_mask(cond.mask, tokens.shape[1])
                kwargs["joint_attention_kwargs"] = {"attention_mask": mask[:, None, None, :]}
        out = denoiser(**kwargs)[0]
        return L.unpack(out, h, w)

    def objective(self, parts: Parts) -> str:
        """Always "flow_matching" (the velocity noise - x0)."""
        return FLOW_MATCHING

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: FluxOptions) -> list[str]:
        """What FLUX.1's flow matching cannot train with (``objective.objective_problems``)."""
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> FlowMatchingObjective:
        """sd-scripts' FLUX.1 flow matching (``objective.FlowMatchingObjective``: ``--timestep_sampling``,
        ``--model_prediction_type``, ``--weighting_scheme``... from ``parts.options.flow``, the script's objective
        flags); ValueError when the model was loaded without them (not by a training script).

        Every step's ``predict`` gets ``guidance`` = ``--guidance_scale`` (``parts.options.guidance_scale``, default
        3.5), as sd-scripts' ``get_noise_pred_and_target`` builds ``guidance_vec`` for every model type: FLUX.1-dev
        embeds it; schnell has no guidance input (:meth:`predict` leaves it out); Chroma's diffusers model has none
        either (:meth:`predict` warns once when it is not 0: sd-scripts' docs give Chroma ``--guidance_scale 0``)."""
        options = _options(parts)
        if options.flow is None:
            raise ValueError(f"{self.spec.title} trains by flow matching, but the model was loaded without the "
                             "objective's flags (FluxOptions.from_args(args, training=True))")  # fmt: skip
        return flow_matching_objective(self.spec.title, options.flow, noise, loss,
                                       predict_options={"guidance": float(options.guidance_scale)})  # fmt: skip

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        """``--blocks_to_swap`` lists: the double blocks (1 per unit) and the single blocks (2 per unit), as
        sd-scripts splits N between them."""
        return [BlockList(denoiser.transformer_blocks, 1), BlockList(denoiser.single_transformer_blocks, 2)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, 16, H/8, W/8): ``(z - 0.1159) · 0.3611``."""
        return L.encode(parts.vae, pixels, self.vae_scale, self.vae_shift, generator)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        """(B, 16, h, w) latents -> (B, 3, 8h, 8w) pixels in [-1, 1]: ``decode(z / 0.3611 + 0.1159)``."""
        return L.decode(parts.vae, latents, self.vae_scale, self.vae_shift)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the transformer under BFL module names (``double_blocks.0.img_attn.proj``...), its fused
        modules (``img_attn.qkv``, ``txt_attn.qkv``, ``linear1``, ``final_layer.adaLN_modulation.1``) as
        :class:`Fused`; ``lora_te1``: CLIP-L with the ``text_model.`` level (FLUX.1 only); ``lora_te3``: T5 under
        transformers' paths (``encoder.block.0.layer.0.SelfAttention.q``), as sd-scripts' ``networks/lora_flux.py``."""
        denoiser = parts.denoiser
        layout = K.diffusers_layout(name for name, _ in denoiser.named_parameters())
        renames = K.module_renames(layout)
        config = denoiser.config
        width = config.num_attention_heads * config.attention_head_dim
        roots = [Root("lora_unet", denoiser, renames.__getitem__, K.fused_modules(layout, width))]
        if not self.chroma:
            clip = parts.text_encoders[0]
            roots.append(Root("lora_te1", clip, hf_module_path(clip)))
        roots.append(Root("lora_te3", parts.text_encoders[-1], _identity))
        return roots

    def base_model_version(self, prediction_type: str = FLOW_MATCHING) -> str:
        """``ss_base_model_version``: "flux1" (dev and schnell) or "chroma", as sd-scripts."""
        return self._version

    def modelspec_architecture(self, kind: str = "", prediction_type: str = FLOW_MATCHING) -> str:
        """``flux-1-dev`` / ``flux-1-schnell`` / ``chroma`` (+ "/lora"), as sd-scripts' sai_model_spec.py."""
        return with_kind(self._architecture, kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        """BFL's flux repository URL (Chroma: lodestones/Chroma), for checkpoints and adapters alike."""
        return self._implementation

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        """``FluxPipeline`` / ``ChromaPipeline`` over ``parts`` (the same modules) with ``scheduler`` (None: a
        ``FlowMatchEulerDiscreteScheduler`` of the model's config).

        ChromaPipeline (diffusers 0.42) encoding a prompt itself makes its 0/1 text mask a float tensor, which SDPA
        adds as a bias instead of masking: those Chroma outputs differ from sd-scripts' (tiny model: max |Δ| 0.58
        after one step). Given a bool ``prompt_attention_mask`` it masks as :meth:`predict` (and sd-scripts) does;
        library/sampling calls :meth:`predict`."""
        from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler, FluxPipeline

        if scheduler is None:
            scheduler = FlowMatchEulerDiscreteScheduler(**scheduler_kwargs(parts.scheduler_config))
        if self.chroma:
            return ChromaPipeline(scheduler=scheduler, vae=parts.vae, text_encoder=parts.text_encoders[0],
                                  tokenizer=parts.tokenizers[0] if parts.tokenizers else None,
                                  transformer=parts.denoiser)  # fmt: skip
        tokenizers = parts.tokenizers or [None, None]
        return FluxPipeline(scheduler=scheduler, vae=parts.vae, text_encoder=parts.text_encoders[0],
                            tokenizer=tokenizers[0], text_encoder_2=parts.text_encoders[1], tokenizer_2=tokenizers[1],
                            transformer=parts.denoiser)  # fmt: skip

    def flow_sampling(self, parts: Parts) -> FlowSampling:
        """How the loaded model samples: embedded guidance for dev (``guidance_embeds``), the resolution-dependent
        schedule shift when its scheduler config uses dynamic shifting (dev, Chroma; not schnell), base / max shift
        from that config, 16 latent channels (the transformer's packed input width / 4)."""
        config = parts.scheduler_config
        return FlowSampling(
            embedded_guidance=bool(getattr(parts.denoiser.config, "guidance_embeds", False)),
            shift=bool(config.get("use_dynamic_shifting", False)),
            base_shift=float(config.get("base_shift", 0.5)),
            max_shift=float(config.get("max_shift", 1.15)),
            latent_channels=int(parts.denoiser.config.in_channels) // 4,
        )

    def default_resolution(self, prediction_type: str = FLOW_MATCHING) -> int:
        """Native resolution: 1024."""
        return 1024


def _identity(path: str) -> str:
    return path


FLUX_DEV = FluxFamily(
    _spec("flux-dev", "FLUX.1-dev", "FluxPipeline", (CLIP_L_SPEC, T5_SPEC)),
    version="flux1",
    architecture="flux-1-dev",
    implementation=IMPL_FLUX,
    t5_length=512,
    targets=FLUX_TARGETS,
)
FLUX_SCHNELL = FluxFamily(_spec("flux-schnell", "FLUX.1-schnell", "FluxPipeline", (CLIP_L_SPEC, T5_SPEC)),
                          version="flux1", architecture="flux-1-schnell", implementation=IMPL_FLUX, t5_length=256,
                          targets=FLUX_TARGETS)  # fmt: skip
CHROMA = FluxFamily(_spec("chroma", "Chroma", "ChromaPipeline", (T5_SPEC,)), version="chroma", architecture="chroma",
                    implementation=IMPL_CHROMA, t5_length=512, targets=CHROMA_TARGETS)  # fmt: skip


def _options(parts: Parts) -> FluxOptions:
    """The options the model was loaded with (defaults for parts built another way, e.g. a tiny model)."""
    return parts.options if isinstance(parts.options, FluxOptions) else FluxOptions()


def _config_of(model: nn.Module) -> Any:
    """The config of the transformer ``model`` is or wraps (a DDP / FSDP wrapper holds it as ``module``)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model.config
