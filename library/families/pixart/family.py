"""PixArt-α (``PIXART_ALPHA``, "pixart_alpha") and PixArt-Σ (``PIXART_SIGMA``, "pixart_sigma"): PixArt-XL/2 (diffusers
``PixArtTransformer2DModel``) over T5-XXL's last hidden states (attention mask passed, 120 / 300 tokens) and a
4-channel SD-style VAE (the SD VAE × 0.18215 for α, the SDXL VAE × 0.13025 for Σ), trained on the DDPM ε objective
(linear β, 1000 steps; ``model.py``). Trained by ``pixart_train_network.py`` / ``pixart_train.py``.

The transformer predicts 8 channels, ε and the learned variance: training is the ε loss on the first half plus
``--vb_loss_strength`` (default 1, as the PixArt authors' hybrid loss and OneTrainer) × the variational bound on the
second (``vb_loss.py``); at 0 only ε is trained and the variance half keeps its released weights. Sampling reads
the ε half (:meth:`PixArtFamily.predict`), as diffusers' pipelines do. PixArt-α 1024 takes the image's resolution and
aspect ratio (micro-conditions: the trained / generated size, as diffusers' pipeline and OneTrainer); Σ none.

Files (``loading.py``): the official ``.pth`` / ``.safetensors`` with ``--t5xxl --vae``, or a diffusers pipeline folder.
Saving a ``.safetensors`` writes the transformer under the official names with ``pos_embed`` and
``y_embedder.y_embedding`` (what ComfyUI's PixArt loader reads and detects α / Σ from); any other path a diffusers
folder (what diffusers' pipelines and the UIs built on them read). Adapter names: ``lora_unet_`` + the official
module path (``lora_unet_blocks_0_attn_qkv``, fused over ``attn1.to_q | to_k | to_v``; ``cross_attn.kv_linear`` over
``attn2.to_k | to_v``): ComfyUI's ``lora_unet_`` rule on its ``diffusion_model.*`` keys.
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from library.files.weights import save_state_dict
from library.objectives.ddpm import DDPMObjective, ddpm_objective, ddpm_problems
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from ..autoencoders import kl
from ..base import EPSILON, BlockList, Cond, FamilySpec, PartDtypes, Parts, Root, TargetClasses, TextEncoderSpec
from ..blocks import BlockLayout
from ..encoders import t5
from ..full_training import PlainFullTraining
from ..loading import META_CONFIGS, META_FAMILY
from ..saving import _save_weights, atomic_dir, clean_config, with_kind
from . import keys as K
from .loading import load_pixart, variant_of_folder, variant_of_keys
from .model import ALPHA, PIPELINES, SIGMA, TIED_T5, TOKENS, VAE_SCALE, eps_half, micro_conditions, released
from .options import PixArtOptions
from .tiny import PixArtTiny
from .vb_loss import pixart_objective

IMPLEMENTATION = "https://github.com/PixArt-alpha/PixArt-sigma"
T5_SPEC = TextEncoderSpec("text_encoders.t5xxl.transformer.", "t5", False, "<pad>", "google/t5-v1_1-xxl", "t5xxl")
SCRIPTS = {"network": "pixart_train_network.py", "fine_tune": "pixart_train.py", "dreambooth": "pixart_train.py"}
TARGETS = TargetClasses(
    transformer=("BasicTransformerBlock",),
    attention=("Attention",),
    text_encoder={},
    full_names=("pos_embed", "adaln_single", "caption_projection", "proj_out"),
    text_encoder_attention={},
)
_RE_BLOCK = re.compile(r"lora_unet_blocks_(\d+)_")


@dataclass(frozen=True)
class PixArtBlocks(BlockLayout):
    """Index = the transformer block (``lora_unet_blocks_<n>_``); the embedders and the final layer have none."""

    def names_match(self, name: str) -> bool:
        return bool(_RE_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _RE_BLOCK.match(name)
        return int(m.group(1)) if m else -1


def _spec(variant: str, title: str) -> FamilySpec:
    return FamilySpec(
        name=variant, title=title, text_encoders=(T5_SPEC,), configs={}, pipeline_class=PIPELINES[variant],
        training_script="pixart_train_network.py", scripts=SCRIPTS,
        load_hint="pixart_train_network.py (with --t5xxl --vae for an official single file)",
        detect=lambda sd, metadata: variant_of_keys(list(sd.keys()), metadata, lambda k: tuple(sd[k].shape)) == variant,
        detect_folder=lambda folder: variant_of_folder(Path(folder)) == variant, group="PixArt", block_swap=True,
    )  # fmt: skip


def options_of(parts: Parts) -> PixArtOptions:
    return parts.options if isinstance(parts.options, PixArtOptions) else PixArtOptions()


class PixArtFamily:
    """PixArt-α or PixArt-Σ (module docstring; ``library.families.protocol.ModelFamily``)."""

    size_multiple = 16  # 8x VAE, 2x2 patches
    num_text_encoders = 1
    ss_v2 = False
    adapter_prefixes = ("lora_unet",)
    blocks = PixArtBlocks("pixart", 28, 0, 0, 0)
    denoiser_name = "transformer"
    partial_text_cache = None  # one text encoder, frozen
    fp8_skip = ()
    target_classes = TARGETS
    options = PixArtOptions
    full_training = PlainFullTraining()
    adapter_rules = MappingProxyType({})

    def __init__(self, variant: str, title: str, architecture: str) -> None:
        self.spec = _spec(variant, title)
        self.name = variant
        self.vae_scale = VAE_SCALE[variant]
        self.ti_embedding_keys = (T5_SPEC.ti_key,)
        self._architecture = architecture
        self.tiny = PixArtTiny(self)
        self.extras: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # denoiser -> what diffusers drops

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # ------------------------------------------------------------------------------------------- files
    def load(self, path: str | Path, *, dtype: torch.dtype | PartDtypes = torch.float32, vae: str | Path | None = None,
             v_parameterization: bool | None = None, tokenizer_cache_dir: str | None = None, device: Any = "cpu",
             options: PixArtOptions | None = None) -> Parts:  # fmt: skip
        """An official file (+ ``options.t5xxl``, ``vae``) or a diffusers folder (``loading.py``)."""
        options = options or PixArtOptions()
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to PixArt: it predicts ε (and a variance)")
        parts, extras = load_pixart(self.name, path, dtype=dtype, device=device, t5xxl=options.t5xxl, vae=vae,
                                    tokenizer_cache_dir=tokenizer_cache_dir, tiny=self.tiny.part_configs())  # fmt: skip
        self.extras[parts.denoiser] = extras
        parts.options = dataclasses.replace(options, t5xxl_max_token_length=options.t5xxl_max_token_length
                                            or TOKENS[self.name])  # fmt: skip
        return parts

    def official_extras(self, parts: Parts) -> dict[str, Tensor]:
        """``pos_embed`` (the transformer's sin-cos table) and ``y_embedder.y_embedding`` (the loaded file's, else
        zeros of (T5 tokens, caption width)): what ComfyUI reads the input size and token length from."""
        found = dict(self.extras.get(parts.denoiser, {}))
        denoiser = parts.denoiser
        found[K.POS_EMBED] = denoiser.pos_embed.pos_embed.detach().cpu()
        if K.Y_EMBEDDING not in found:
            width = denoiser.config.caption_channels
            found[K.Y_EMBEDDING] = torch.zeros(options_of(parts).t5xxl_max_token_length or TOKENS[self.name], width)
        return found

    def save(self, parts: Parts, path: str | Path, *, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None, safetensors: bool = True) -> Path:  # fmt: skip
        """``*.safetensors``: the transformer under the official names (ComfyUI's checkpoint; T5 and the VAE stay the
        user's files); a pickle suffix is refused; any other path: a diffusers pipeline folder."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".ckpt", ".pt", ".pth", ".bin"):
            raise ValueError(f"{path}: PixArt models are saved as .safetensors or a diffusers folder, not pickles")
        if suffix == ".safetensors":
            state = K.diffusers_to_official(parts.denoiser.state_dict(), extras=self.official_extras(parts))
            meta = {META_FAMILY: self.name, META_CONFIGS: json.dumps(model_configs(parts)), **self._modelspec(path.stem),
                    **(metadata or {})}  # fmt: skip
            return save_state_dict(state, path, meta, dtype)
        suffix = ".safetensors" if safetensors else ".bin"
        with atomic_dir(path) as tmp:
            self.pipeline(parts, None).save_config(tmp)
            for name, module in (("transformer", parts.denoiser), ("vae", parts.vae)):
                module.save_config(tmp / name)
                _save_weights(module.state_dict(), tmp / name / ("diffusion_pytorch_model" + suffix), dtype)
            encoder = parts.text_encoders[0]
            encoder.config.save_pretrained(tmp / "text_encoder")
            state = {k: v for k, v in encoder.state_dict().items() if k != TIED_T5}
            _save_weights(state, tmp / "text_encoder" / (("model" if safetensors else "pytorch_model")
                                                                       + suffix), dtype)  # fmt: skip
            parts.tokenizers[0].save_pretrained(tmp / "tokenizer")
            self._scheduler(parts).save_pretrained(tmp / "scheduler")
        return path

    def _modelspec(self, title: str) -> dict[str, str]:
        from library.files.metadata import modelspec

        return modelspec(architecture=self.modelspec_architecture(), implementation=IMPLEMENTATION, title=title,
                         resolution=self.default_resolution())  # fmt: skip

    def reference_parts(self) -> Parts:
        """The released transformer and T5-XXL on the meta device; ``vae`` None."""
        from accelerate import init_empty_weights

        from .model import transformer_factory

        configs = released(self.name)
        with init_empty_weights():
            denoiser = transformer_factory(configs["transformer"])()
            encoder = t5.factory(configs["text_encoder"])()
        return Parts(denoiser, None, [encoder], [], configs["scheduler"], self.name)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """``[ids (B, L), mask (B, L)]``, L = ``--t5xxl_max_token_length`` (120 α, 300 Σ); CLIP's
        ``max_token_length`` is not read."""
        length = options_of(parts).t5xxl_max_token_length or TOKENS[self.name]
        ids, mask = t5.tokenize_t5(parts.tokenizers[0], captions, length)
        return [ids, mask]

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(T5's last hidden state (B, L, 4096) computed with the padding masked, no pooled output, mask)."""
        ids, mask = tokens
        hidden = t5.t5_hidden(parts.text_encoders[0], ids, mask)
        return Cond(hidden, None, mask.to(hidden.device))

    def encode_prompt(self, parts: Parts, captions: list[str], clip_skip: int | None = None,
                      max_token_length: int | None = None) -> Cond:  # fmt: skip
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length), clip_skip)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        return None  # α's micro-conditions come from the latents' size (predict)

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        raise ValueError("PixArt's T5-XXL is not trained: its cached outputs are the conditioning")

    # ------------------------------------------------------------------------------------------- denoising
    def predict(self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *,
                time_ids: Tensor | None = None, with_variance: bool = False) -> Tensor:  # fmt: skip
        """ε (B, 4, h, w): the ε half of the transformer's 8 channels (all 8 ``with_variance``: the training loss's
        bound reads the variance half), at integer timesteps t, with T5's states and mask in the cross-attention
        and, for α, the micro-conditions of the latents' size."""
        if time_ids is not None:
            raise ValueError("PixArt takes no SDXL size/crop time_ids")
        mask = cond.mask
        if mask is None:
            mask = torch.ones(cond.hidden_states.shape[:2], dtype=torch.long, device=noisy.device)
        timesteps = t.to(noisy.device).expand(noisy.shape[0]) if t.ndim else t.to(noisy.device).repeat(noisy.shape[0])
        out = denoiser(noisy, encoder_hidden_states=cond.hidden_states.to(noisy.dtype),
                       encoder_attention_mask=mask.to(noisy.device), timestep=timesteps,
                       added_cond_kwargs=micro_conditions(denoiser, noisy), return_dict=False)[0]  # fmt: skip
        return out if with_variance else eps_half(out, noisy.shape[1])

    def objective(self, parts: Parts) -> str:
        return EPSILON

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: PixArtOptions) -> list[str]:
        problems = ddpm_problems(noise, loss)
        if noise.v_parameterization or loss.v_parameterization:
            problems.append("--v_parameterization: PixArt predicts ε (there is no v-prediction release)")
        return problems

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> DDPMObjective:
        base = ddpm_objective(self.spec.title, EPSILON, parts.scheduler_config, noise, loss)
        return pixart_objective(base, options_of(parts).vb_loss_strength)

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        return [BlockList(denoiser.transformer_blocks, 1)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return kl.encode_latents(parts.vae, pixels, self.vae_scale, generator)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        return kl.decode_latents(parts.vae, latents, self.vae_scale)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the transformer under official module paths, ``attn.qkv`` and ``cross_attn.kv_linear``
        fused (module docstring); T5 takes no adapter."""
        return [Root("lora_unet", parts.denoiser, K.rename, K.fused_modules(parts.denoiser))]

    def base_model_version(self, prediction_type: str = EPSILON) -> str:
        return self.name

    def modelspec_architecture(self, kind: str = "", prediction_type: str = EPSILON) -> str:
        return with_kind(self._architecture, kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def _scheduler(self, parts: Parts) -> Any:
        from diffusers import DPMSolverMultistepScheduler

        return DPMSolverMultistepScheduler.from_config(dict(parts.scheduler_config))

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        """``PixArtAlphaPipeline`` / ``PixArtSigmaPipeline`` over ``parts`` (the same modules)."""
        import diffusers

        cls = getattr(diffusers, PIPELINES[self.name])
        return cls(tokenizer=parts.tokenizers[0] if parts.tokenizers else None, text_encoder=parts.text_encoders[0],
                   vae=parts.vae, transformer=parts.denoiser, scheduler=scheduler or self._scheduler(parts))  # fmt: skip

    def flow_sampling(self, parts: Parts) -> None:
        return None

    def default_resolution(self, prediction_type: str = EPSILON) -> int:
        return 1024


def model_configs(parts: Parts) -> dict[str, Any]:
    return {"family": parts.family, "transformer": clean_config(parts.denoiser.config),
            "vae": clean_config(parts.vae.config) if parts.vae is not None else None,
            "text_encoder": clean_config(parts.text_encoders[0].config.to_dict()) if parts.text_encoders else None,
            "scheduler": dict(parts.scheduler_config)}  # fmt: skip


PIXART_ALPHA = PixArtFamily(ALPHA, "PixArt-α", "pixart-alpha")
PIXART_SIGMA = PixArtFamily(SIGMA, "PixArt-Σ", "pixart-sigma")
