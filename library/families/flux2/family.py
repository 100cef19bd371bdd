"""FLUX.2 (Black Forest Labs): one family object, ``FLUX2`` (registry name "flux2"), trained by
``flux_2_train_network.py`` (LoRA, musubi-tuner's command line).

Parts: the DiT (diffusers' ``Flux2Transformer2DModel``, BFL files through ``keys.py``, ``model.py``), the text encoder
(klein: Qwen3-4B / -8B, the shared ``encoders/qwen3.py``; dev: Mistral-Small-3.1's language model,
``encoders/mistral3.py``, with the tokenizer found beside it), FLUX.2's AE
(``autoencoders/flux2.py``: 128 normalised channels at 1/16), the Qwen3 tokenizer (shipped). Files: ``loading.py`` /
``saving.py``; objective: ``objective.py``; flags: ``options.py``; LoRA rules: ``lora.py``; tiny model: ``tiny.py``.

Prompts: each caption in Qwen3's chat template (thinking off), padded to 512 tokens, the hidden states of layers 9,
18 and 27 side by side per token (B, 512, 3 D), padding included (musubi-tuner's ``Qwen3Embedder``, diffusers'
``Flux2KleinPipeline``). The DiT is called with 4-axis position ids and, for dev, guidance 1.0 in training
(musubi-tuner's ``call_dit``). One text encoder, so its cached outputs cannot train its adapters.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from ..autoencoders import flux2 as ae
from ..base import (
    FLOW_MATCHING,
    BlockList,
    CachingMemoryFlag,
    Cond,
    FamilySpec,
    FlowSampling,
    PartDtypes,
    Parts,
    Root,
    TargetClasses,
    TextEncoderSpec,
)
from ..blocks import BlockLayout
from ..encoders import mistral3, qwen3
from ..full_training import PlainFullTraining
from ..saving import with_kind
from . import keys as K
from . import lora
from . import model as M
from .loading import TEXT_LAYERS, TEXT_LENGTH, is_dit, is_folder, load_flux2
from .objective import Flux2FlowConfig, Flux2FlowObjective, flux2_objective, objective_problems
from .options import Flux2Options
from .saving import save_dit
from .tiny import Flux2Tiny

log = logging.getLogger(__name__)

ARCHITECTURE = "flux-2"
IMPLEMENTATION = "https://github.com/black-forest-labs/flux2"
SCRIPTS = {"network": "flux_2_train_network.py"}


def _sampler_line() -> tuple[float, float]:
    """FLUX's shift line μ(n) through (256, 0.5) and (4096, 1.15) at FLUX.2's n = (H/16)(W/16) tokens, written as the
    (base, max) shifts of the shared sampler, which counts (H/32)(W/32) = n/4 tokens between 256 and 4096:
    μ'(n/4) = μ(n), so μ' has 4x the slope and μ'(256) = μ(1024)."""
    slope = (1.15 - 0.5) / (4096 - 256)
    base = 0.5 + slope * (4 * 256 - 256)
    return base, base + 4 * slope * (4096 - 256)


SAMPLER_LINE = _sampler_line()

TARGETS = TargetClasses(
    transformer=lora.BLOCK_CLASSES,
    attention=("Flux2Attention", "Flux2ParallelSelfAttention"),
    text_encoder={},
    full_names=(
        "x_embedder",
        "context_embedder",
        "time_guidance_embed",
        "double_stream_modulation_img",
        "double_stream_modulation_txt",
        "single_stream_modulation",
        "norm_out",
        "proj_out",
    ),
)
_BLOCK = re.compile(r"lora_unet_(double|single)_blocks_(\d+)_")


@dataclass(frozen=True)
class Flux2Blocks(BlockLayout):
    """The DiT's blocks in musubi-tuner's names (``lora_unet_double_blocks_<n>_...``, then the single blocks after
    the most double blocks any variant has)."""

    def names_match(self, name: str) -> bool:
        return bool(_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _BLOCK.match(name)
        if not m:
            return -1
        return int(m.group(2)) + (MOST_DOUBLE if m.group(1) == "single" else 0)


MOST_DOUBLE = 8  # the double blocks of dev and klein 9B: single block k is numbered 8 + k in every variant
FLUX2_BLOCKS = Flux2Blocks("flux2", MOST_DOUBLE + 48, 0, 0, 0)


def _detect(sd: Mapping[str, Any], metadata: Mapping[str, str]) -> bool:
    return is_dit(sd.keys())


def _detect_folder(folder: Path) -> bool:
    return is_folder(Path(folder))


SPEC = FamilySpec(
    name="flux2",
    title="FLUX.2",
    text_encoders=(TextEncoderSpec("", "qwen3", False, "<|endoftext|>", "Qwen/Qwen3-4B", "qwen3"),),
    configs={FLOW_MATCHING: "flux2"},
    pipeline_class="",
    training_script="flux_2_train_network.py",
    scripts=SCRIPTS,
    load_hint="flux_2_train_network.py --dit DIT --text_encoder QWEN3 --vae AE",
    detect=_detect,
    detect_folder=_detect_folder,
    block_swap=True,
)


def reference(name: str, version: str) -> Parts:
    """The released DiT of ``version`` and its text encoder's architecture on the meta device; ``vae`` None."""
    from accelerate import init_empty_weights

    arch = version.replace("base-", "")
    text = {"dev": (mistral3.factory, mistral3.RELEASED), "klein-9b": (qwen3.factory, qwen3.QWEN3_8B)}
    make, config = text.get(arch, (qwen3.factory, qwen3.QWEN3_4B))
    with init_empty_weights(include_buffers=True):
        denoiser = M.build(M.RELEASED[arch])
        encoder = make(config)()
    return Parts(denoiser, None, [encoder], [], {"model_version": version}, name)


def _is_dev(parts: Parts) -> bool:
    return parts.scheduler_config.get("model_version") == "dev"


def options_of(parts: Parts) -> Flux2Options:
    return parts.options if isinstance(parts.options, Flux2Options) else Flux2Options()


class Flux2Family:
    """FLUX.2 (module docstring; ``library.families.protocol.ModelFamily``)."""

    vae_scale = 1.0  # latents are normalised by the AE's BatchNorm statistics (autoencoders/flux2.py)
    size_multiple = 16  # 8x AE, 2x2 patches
    latent_downscale = 16  # the latents are the AE's in 2x2 patches (the latent cache checks their size by it)
    num_text_encoders = 1
    ss_v2 = False
    adapter_prefixes = ("lora_unet",)
    blocks = FLUX2_BLOCKS
    denoiser_name = "transformer"
    partial_text_cache = None  # one text encoder: its cached outputs cannot train its adapters
    # --fp8_base: only the blocks' Linears in float8 (musubi-tuner's FP8_OPTIMIZATION_TARGET_KEYS; norms excluded)
    block_swap_split = "ratio"  # musubi-tuner's share of --blocks_to_swap by the lists' ratio (dev: up to 29)
    fp8_skip = ("x_embedder", "context_embedder", "time_guidance_embed", "modulation", "norm", "proj_out")
    # what lowers the text-caching phase (library/measure/advice.py tries them there)
    caching_memory_flags = (
        CachingMemoryFlag(("--fp8_text_encoder",), "the text encoder in float8", "text caching", 0.0,
                          "none in step time (the captions are encoded once, while caching); the text encoder's "
                          "Linear weights in float8: slightly less exact text outputs, cached anew (musubi-tuner's "
                          "docs/flux_2.md: with --fp8_base, klein only)"),
    )  # fmt: skip
    target_classes = TARGETS
    options = Flux2Options
    full_training = PlainFullTraining()
    adapter_rules = MappingProxyType({lora.MODULE: lora.RULES})

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)
        self.tiny = Flux2Tiny(self)

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # ------------------------------------------------------------------------------------------- files
    def load(self, path: str | Path, *, dtype: torch.dtype | PartDtypes = torch.float32, vae: str | Path | None = None,
             v_parameterization: bool | None = None, tokenizer_cache_dir: str | None = None, device: Any = "cpu",
             options: Flux2Options | None = None) -> Parts:  # fmt: skip
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to FLUX.2: it is a flow-matching model")
        return load_flux2(self.name, path, dtype=dtype, vae=None if vae is None else str(vae), device=device,
                          options=options or Flux2Options())  # fmt: skip

    def save(self, parts: Parts, path: str | Path, *, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None, safetensors: bool = True) -> Path:  # fmt: skip
        """``*.safetensors``: the DiT in BFL's names (the released single-file layout); pickles and folders are
        refused."""
        path = Path(path)
        if path.suffix.lower() != ".safetensors":
            raise ValueError(f"{path}: FLUX.2 models are saved as one .safetensors DiT (BFL names)")
        return save_dit(parts, path, self, dtype, metadata)

    def modelspec(self, title: str) -> dict[str, str]:
        from library.files.metadata import modelspec

        return modelspec(architecture=self.modelspec_architecture(), implementation=self.modelspec_implementation(),
                         title=title, resolution=self.default_resolution(), prediction_type=None)  # fmt: skip

    def reference_parts(self) -> Parts:
        """dev's DiT (the most blocks of both lists: checks made before loading, such as ``--blocks_to_swap``'s limit,
        allow every variant's; the run checks the loaded model) and Mistral 3 on the meta device; ``vae`` None
        (:func:`reference` for the others)."""
        return reference(self.name, "dev")

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """``[ids, mask]`` (B, 512) of the captions in the text encoder's chat template (Qwen3's, thinking off; dev:
        Mistral's with the system message); ``max_token_length``, a CLIP setting, is not read."""
        if _is_dev(parts):
            return list(mistral3.tokenize(parts.tokenizers[0], captions, TEXT_LENGTH))
        return list(qwen3.tokenize_chat(parts.tokenizers[0], captions, TEXT_LENGTH))

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(states (B, 512, 3 D): hidden states 9, 18, 27 (Qwen3) or 10, 20, 30 (Mistral 3) side by side, None,
        None)."""
        ids, mask = tokens
        layers = TEXT_LAYERS["mistral" if _is_dev(parts) else "qwen3"]
        return Cond(qwen3.stacked_layers(parts.text_encoders[0], ids, mask, layers), None, None)

    def encode_prompt(self, parts: Parts, captions: list[str], clip_skip: int | None = None,
                      max_token_length: int | None = None, negative: bool = False) -> Cond:  # fmt: skip
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length), clip_skip)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        raise ValueError("FLUX.2 has one text encoder: its cached outputs cannot train its adapters (add "
                         "--network_train_unet_only or drop --cache_text_encoder_outputs)")  # fmt: skip

    # ------------------------------------------------------------------------------------------- denoising
    def predict(self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *,
                time_ids: Tensor | None = None, guidance: Tensor | None = None,
                references: Sequence[Tensor] = ()) -> Tensor:  # fmt: skip
        """The velocity (B, 128, h, w) at the timesteps ``t`` (B,): the DiT gets t / 1000 (musubi-tuner's
        ``call_dit``; training's timesteps are 1000 σ + 1, as musubi-tuner's) and, for dev, ``guidance`` (B,) (default 1.0, musubi-tuner's training value; sampling gives the embedded
        guidance scale); ``references``: the control images' latents (B, 128, h_k, w_k), the edit mode."""
        if time_ids is not None:
            raise ValueError("FLUX.2 takes no size/crop time_ids")
        b = noisy.shape[0]
        sigma = (t.to(noisy.device, torch.float32) / 1000).expand(b)
        return M.forward(denoiser, noisy, sigma, cond.hidden_states.to(noisy.device), guidance, references)

    def objective(self, parts: Parts) -> str:
        return FLOW_MATCHING

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: Flux2Options) -> list[str]:
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> Flux2FlowObjective:
        flow = options_of(parts).flow or Flux2FlowConfig()
        return flux2_objective(self.spec.title, flow, noise, loss)

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        """A double block weighs about two single blocks (musubi-tuner: double + 2 single = one swap unit)."""
        return [BlockList(denoiser.transformer_blocks, 1), BlockList(denoiser.single_transformer_blocks, 2)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return ae.encode(parts.vae, pixels)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        return ae.decode(parts.vae, latents)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the DiT under BFL module paths (musubi-tuner's names), the double blocks' qkv fused."""
        denoiser = parts.denoiser
        c = denoiser.config
        layout = K.layout_of_diffusers(name for name, _ in denoiser.named_parameters())
        renames = K.module_renames(*layout)
        width = c.num_attention_heads * c.attention_head_dim
        return [Root("lora_unet", denoiser, renames.__getitem__, K.fused_modules(*layout, width))]

    def base_model_version(self, prediction_type: str = FLOW_MATCHING) -> str:
        return "flux2"

    def modelspec_architecture(self, kind: str = "", prediction_type: str = FLOW_MATCHING) -> str:
        return with_kind(ARCHITECTURE, kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        raise ValueError("FLUX.2 samples with the flow-matching Euler sampler, not a classic diffusers pipeline")

    def flow_sampling(self, parts: Parts) -> FlowSampling:
        """musubi-tuner's FLUX.2 defaults: klein 4 steps, guidance 1; base and dev 50 steps, guidance 4 (true CFG
        for base, embedded guidance for dev); FLUX's resolution-dependent shift at FLUX.2's token count
        (:data:`SAMPLER_LINE`; musubi-tuner's empirical μ is not done); ``--flow_shift``: a static shift."""
        cfg = parts.scheduler_config
        distilled = bool(cfg.get("guidance_distilled", False))
        embedded = bool(getattr(parts.denoiser.config, "guidance_embeds", False))
        static = cfg.get("static_shift")  # --flow_shift
        shift = {"shift": True, "base_shift": SAMPLER_LINE[0], "max_shift": SAMPLER_LINE[1]} if static is None else \
            {"shift": False, "static_shift": float(static)}  # fmt: skip
        return FlowSampling(embedded_guidance=embedded, latent_channels=int(parts.denoiser.config.in_channels),
                            packed_noise=False, latent_downscale=16,
                            default_steps=int(cfg.get("default_steps", 4 if distilled else 50)),
                            default_scale=float(cfg.get("default_guidance", 1.0 if distilled else 4.0)), **shift)  # fmt: skip

    def default_resolution(self, prediction_type: str = FLOW_MATCHING) -> int:
        return 1024


FLUX2 = Flux2Family(SPEC)
