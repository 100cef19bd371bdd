"""Stable Diffusion 1.x and 2.x (512 epsilon and 768-v): one class, two objects, ``SD1`` and ``SD2``.

What differs between them is data: the text encoder (CLIP-L in HF layout vs OpenCLIP-H stored with stacked
in_proj), the pad token, the shipped configs and the names used in metadata. SD2's text encoder is the diffusers one:
OpenCLIP-H without its last block (23 layers), so its last hidden state *is* SD2's penultimate-layer conditioning and
``clip_skip`` counts back from there, exactly as in sd-scripts (which warns that clip_skip with --v2 is unusual).

v-prediction of an SD2 single file without a marker or metadata is guessed as ComfyUI does
(``supported_models.SD20.model_type``): the released 768-v model's ``output_blocks.11.1.transformer_blocks.0.norm1
.bias`` has a standard deviation above 0.09, the 512 base model's is below. sd-scripts never detects it (the user
passes --v_parameterization); the flag always wins here too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from library.families.protocol import TinyModel
from library.objectives.ddpm import DDPMObjective, ddpm_objective, ddpm_problems
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from ..autoencoders.kl import decode_latents, encode_latents
from ..base import BlockList, Cond, FamilySpec, PartDtypes, Parts, Root, TargetClasses, TextEncoderSpec, module_device
from ..convert import hf_module_path
from ..options import NoOptions
from ..saving import with_kind
from ..tokenizers import PAD_CLIP_L, PAD_OPEN_CLIP
from . import text
from .blocks import DIFFUSERS_BLOCKS
from .convert import UNET_PREFIX
from .full_training import SDFullTraining
from .loading import load_model, reference_parts, sd_family_of_folder, sd_family_of_keys
from .saving import IMPL_SGM, make_pipeline, save_family_model
from .tiny import SDTiny

log = logging.getLogger(__name__)


def guess_sd2_prediction(sd: Mapping[str, Tensor]) -> str | None:
    """Guess "v_prediction" / "epsilon" for a 4-channel SD2 UNet from one weight's spread (ComfyUI's test), else None."""
    bias = sd.get(UNET_PREFIX + "output_blocks.11.1.transformer_blocks.0.norm1.bias")
    conv_in = sd.get(UNET_PREFIX + "input_blocks.0.0.weight")
    if bias is None or conv_in is None or conv_in.shape[1] != 4:
        return None
    return "v_prediction" if torch.std(bias.float(), correction=0) > 0.09 else "epsilon"


# sd-scripts' scripts for SD 1.x / 2.x, by training type
SD_SCRIPTS = {"network": "train_network.py", "fine_tune": "fine_tune.py", "dreambooth": "train_db.py",
              "textual_inversion": "train_textual_inversion.py"}  # fmt: skip

SD1_SPEC = FamilySpec(
    name="sd1",
    title="SD1.x",
    text_encoders=(
        TextEncoderSpec(
            "cond_stage_model.transformer.", "clip", False, PAD_CLIP_L, "openai/clip-vit-large-patch14", "emb_params"
        ),
    ),
    configs={"epsilon": "sd15", "v_prediction": "sd15"},
    pipeline_class="StableDiffusionPipeline",
    scripts=SD_SCRIPTS,
    load_hint="the SD 1.x scripts without --v2",
    flag="v1",
    detect=lambda sd, metadata: sd_family_of_keys(sd) == "sd1",
    detect_folder=lambda folder: sd_family_of_folder(folder) == "sd1",
)
SD2_SPEC = FamilySpec(
    name="sd2",
    title="SD2.x",
    text_encoders=(
        TextEncoderSpec(
            "cond_stage_model.model.",
            "open_clip",
            False,
            PAD_OPEN_CLIP,
            "stabilityai/stable-diffusion-2",
            "emb_params",
            final_block_after=23,
        ),
    ),  # fmt: skip
    configs={"epsilon": "sd2-512", "v_prediction": "sd2-768-v"},
    pipeline_class="StableDiffusionPipeline",
    guess_prediction=guess_sd2_prediction,
    scripts=SD_SCRIPTS,
    load_hint="--v2",
    flag="v2",
    detect=lambda sd, metadata: sd_family_of_keys(sd) == "sd2",
    detect_folder=lambda folder: sd_family_of_folder(folder) == "sd2",
)


# The classes sd-scripts' networks.lora and LyCORIS' presets select (diffusers' / transformers' names, which
# sd-scripts' own UNet and CLIP mirror): the same for SD1, SD2 and SDXL.
CLIP_ATTENTION = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2")
UNET_TARGET_CLASSES = TargetClasses(
    transformer=("Transformer2DModel",),
    conv_blocks=("ResnetBlock2D", "Downsample2D", "Upsample2D"),
    attention=("Attention",),
    text_encoder={"*": (*CLIP_ATTENTION, "CLIPMLP")},
    full_names=("conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2"),
    text_encoder_attention={"*": CLIP_ATTENTION},
)


class SDFamily:
    """SD 1.x / 2.x: a UNet conditioned on one text encoder's (B, 77·k, D) hidden states. See ``ModelFamily``."""

    vae_scale = 0.18215
    size_multiple = 64  # image sides are multiples of this (sd-scripts' bucket_reso_steps rule for SD1/2)
    num_text_encoders = 1
    adapter_prefixes = ("lora_unet", "lora_te")
    blocks = DIFFUSERS_BLOCKS
    denoiser_name = "UNet"
    partial_text_cache = None  # every text output comes from an encoder adapters may train
    options = NoOptions  # every flag an SD model reads is a shared one
    full_training = SDFullTraining()
    fp8_skip = ("norm",)  # --fp8_base keeps the UNet's norm layers in the compute dtype (diffusers' rule)
    target_classes = UNET_TARGET_CLASSES
    adapter_rules = MappingProxyType({})  # no module of its own: networks.lora / lycoris.kohya

    def __init__(
        self,
        spec: FamilySpec,
        *,
        version: str,
        architectures: Mapping[str, str],
        resolutions: Mapping[str, int],
        warn_clip_skip: bool,
        ss_v2: bool = False,
        tiny: TinyModel | None = None,
    ) -> None:
        self.spec = spec
        self.tiny = tiny  # the tiny test model (None: none, e.g. a family registered from outside)
        self.name = spec.name
        self._version = version  # ss_base_model_version without the "_v" suffix
        self._architectures = architectures  # prediction type -> modelspec architecture
        self._resolutions = resolutions  # prediction type -> native resolution
        self._warn_clip_skip = warn_clip_skip
        self.ss_v2 = ss_v2  # sd-scripts' ss_v2 metadata (--v2)
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

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
        """Load a diffusers folder or a single file (.safetensors / .ckpt). Modules come back frozen, in eval mode.

        ``dtype``: one dtype, or a :class:`PartDtypes` per part. ``device``: where each weight goes as it is read (the
        host holds one tensor at a time). ``vae``: replacement VAE (``--vae``). ``v_parameterization``: None detects
        from the file, True/False forces. ``tokenizer_cache_dir``: sd-scripts' ``--tokenizer_cache_dir`` (else the bundled offline tokenizer).
        Raises ``FileNotFoundError`` / ``ValueError`` naming the path and what was expected.
        """
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
        """Save the full model: ``*.safetensors`` / ``*.ckpt`` single file, else a diffusers folder (atomic)."""
        return save_family_model(self, parts, path, dtype, metadata, safetensors)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(
        self, parts: Parts, captions: list[str], max_token_length: int | None = None, *, pad: bool = True
    ) -> list[Tensor]:
        """``[ids (B, 77·k)]`` for ``--max_token_length`` None/75 (k=1), 150 (k=2), 225 (k=3), as sd-scripts.
        ``pad=False`` (train_db.py's ``--no_token_padding``): ``[ids (B, 2 + longest caption's tokens)]``."""
        return [text.tokenize(parts.tokenizers[0], captions, max_token_length, pad=pad)]

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond with hidden states (B, 77, D) or (B, 75·k+2, D); ``clip_skip`` n>=2: hidden_states[-n] + final norm.

        Runs with autograd as the caller has it (wrap in ``torch.no_grad()`` unless the text encoder is trained).
        """
        te = parts.text_encoders[0]
        if clip_skip is not None and clip_skip > 1 and self._warn_clip_skip:
            log.warning("--clip_skip %d with SD2: SD2 already uses OpenCLIP's penultimate layer", clip_skip)
            self._warn_clip_skip = False
        ids, batch, n = text.split_chunks(tokens[0])
        hidden = text.clip_skip_states(te, ids.to(module_device(te)), clip_skip)
        return Cond(text.merge_chunks(hidden, batch, n))

    def encode_prompt(
        self,
        parts: Parts,
        captions: list[str],
        clip_skip: int | None = None,
        max_token_length: int | None = None,
        *,
        pad: bool = True,
    ) -> Cond:
        """:meth:`tokenize` then :meth:`encode_tokens`; ``pad=False``: hidden states (B, 2 + longest caption, D)."""
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length, pad=pad), clip_skip)

    # ------------------------------------------------------------------------------------------- denoising
    def predict(
        self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *, time_ids: Tensor | None = None
    ) -> Tensor:
        """UNet output (B, 4, h, w) for noisy latents (B, 4, h, w) at timesteps t (B,): epsilon or v, per the model."""
        if time_ids is not None:
            raise ValueError(f"{self.name} takes no size/crop time_ids (only SDXL does)")
        return denoiser(noisy, t, encoder_hidden_states=cond.hidden_states).sample

    def objective(self, parts: Parts) -> str:
        """The loaded model's prediction type: "epsilon" or "v_prediction" (SD2 768-v, v-pred fine-tunes)."""
        return parts.prediction_type

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: NoOptions) -> list[str]:
        """What the DDPM objective cannot train with (``library.objectives.ddpm.ddpm_problems``)."""
        return ddpm_problems(noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> DDPMObjective:
        """Epsilon or v-prediction (:meth:`objective`) on the model's DDPM schedule."""
        return ddpm_objective(self.spec.title, self.objective(parts), parts.scheduler_config, noise, loss)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        """SD 1.x / 2.x take no size/crop conditioning (see SDXL.size_conditioning)."""
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        """Not possible here (``partial_text_cache`` None): every output comes from a trained encoder."""
        raise ValueError(f"{self.spec.title}: cached text-encoder outputs cannot train text-encoder adapters; add "
                         "--network_train_unet_only or drop --cache_text_encoder_outputs")  # fmt: skip

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, 4, H/8, W/8) sampled latents times 0.18215."""
        return encode_latents(parts.vae, pixels, self.vae_scale, generator)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        """(B, 4, h, w) latents -> (B, 3, 8h, 8w) pixels in [-1, 1]."""
        return decode_latents(parts.vae, latents, self.vae_scale)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """(kohya prefix, module, rename): UNet paths are kept (diffusers names, as sd-scripts' SD1/2 UNet), text
        encoder paths get the ``text_model.`` level; nothing is fused."""
        te = parts.text_encoders[0]
        return [Root("lora_unet", parts.denoiser, _identity), Root("lora_te", te, hf_module_path(te))]

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        """No lists: a UNet has no transformer block lists to swap (sd-scripts' ``--blocks_to_swap`` is FLUX / SD3 only)."""
        return []

    def base_model_version(self, prediction_type: str = "epsilon") -> str:
        """``ss_base_model_version``: sd_v1 / sd_v1_v / sd_v2 / sd_v2_v."""
        return self._version + ("_v" if prediction_type == "v_prediction" else "")

    def modelspec_architecture(self, kind: str = "", prediction_type: str = "epsilon") -> str:
        """``modelspec.architecture``; ``kind`` "" (checkpoint), "lora" or "textual-inversion"."""
        return with_kind(self._architectures[prediction_type], kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        """``modelspec.implementation``: "diffusers" for SD1/2 LoRA, the sgm URL for TI and checkpoints (sd-scripts)."""
        return "diffusers" if kind == "lora" else IMPL_SGM

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        """A diffusers ``StableDiffusionPipeline`` over ``parts`` (the same modules, no copies) with ``scheduler``,
        for sampling: the one place that picks the pipeline class."""
        return make_pipeline(self.spec, parts, scheduler)

    def flow_sampling(self, parts: Parts) -> None:
        """SD 1.x / 2.x is not a flow-matching model: it samples with diffusers' schedulers (``sampling/schedulers.py``)."""
        return None

    def default_resolution(self, prediction_type: str = "epsilon") -> int:
        """Native resolution: 768 for SD2 v-prediction (768-v), else 512."""
        return self._resolutions[prediction_type]

    def reference_parts(self) -> Parts:
        """The released architecture on the meta device (see ``ModelFamily.reference_parts``)."""
        return reference_parts(self.spec)


def _identity(path: str) -> str:
    return path


SD1 = SDFamily(
    SD1_SPEC,
    version="sd_v1",
    architectures={"epsilon": "stable-diffusion-v1", "v_prediction": "stable-diffusion-v1"},
    resolutions={"epsilon": 512, "v_prediction": 512},
    warn_clip_skip=False,
    tiny=SDTiny("sd1"),
)
SD2 = SDFamily(
    SD2_SPEC,
    version="sd_v2",
    architectures={"epsilon": "stable-diffusion-v2-512", "v_prediction": "stable-diffusion-v2-768-v"},
    resolutions={"epsilon": 512, "v_prediction": 768},
    warn_clip_skip=True,
    ss_v2=True,
    tiny=SDTiny("sd2"),
)
