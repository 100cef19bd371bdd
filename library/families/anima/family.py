"""Anima (CircleStone Labs, on NVIDIA Cosmos-Predict2's 2B DiT): one family object, ``ANIMA`` (registry name
"anima"), trained by ``anima_train_network.py`` (LoRA) and ``anima_train.py`` (full fine-tune).

Parts: the DiT with its LLM adapter (``model.AnimaTransformer``: diffusers' ``CosmosTransformer3DModel`` +
``AnimaTextConditioner``), Qwen3-0.6B (transformers' ``Qwen3Model``), the Qwen-Image VAE (diffusers'
``AutoencoderKLQwenImage``, ``autoencoders/qwen_image.py``), the Qwen3 and T5 tokenizers (``text.py``). Files:
``loading.py`` / ``saving.py``; names: ``keys.py``; objective: ``objective.py``; flags: ``options.py``; LoRA rules:
``lora.py``; full fine-tuning: ``full_training.py``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from ..autoencoders import qwen_image
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
from ..blocks import BlockLayout
from ..saving import with_kind
from . import keys as K
from . import lora, text
from .full_training import AnimaFullTraining
from .loading import load_anima
from .objective import AnimaFlowObjective, anima_objective, objective_problems
from .options import AnimaOptions
from .saving import FOLDER_FILES, save_dit, save_folder
from .tiny import AnimaTiny

log = logging.getLogger(__name__)

ARCHITECTURE = "anima-preview"  # sd-scripts' sai_model_spec ARCH_ANIMA_PREVIEW
IMPLEMENTATION = "https://huggingface.co/circlestone-labs/Anima"  # sd-scripts' IMPL_ANIMA
SCRIPTS = {"network": "anima_train_network.py", "fine_tune": "anima_train.py", "dreambooth": "anima_train.py"}

TARGETS = TargetClasses(
    transformer=("CosmosTransformerBlock", "CosmosPatchEmbed", "CosmosTimestepEmbedding", "CosmosAdaLayerNorm"),
    attention=("CosmosAttention", "Attention"),
    text_encoder={"lora_te": ("Qwen3Attention", "Qwen3MLP")},
    full_names=("patch_embed", "time_embed", "norm_out", "proj_out"),
    text_encoder_attention={"lora_te": ("Qwen3Attention",)},
)
_BLOCK = re.compile(r"lora_unet_blocks_(\d+)_")


@dataclass(frozen=True)
class AnimaBlocks(BlockLayout):
    """The DiT's blocks in sd-scripts' names (``lora_unet_blocks_<n>_...``); no down / mid / up weights."""

    def names_match(self, name: str) -> bool:
        return bool(_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _BLOCK.match(name)
        return int(m.group(1)) if m else -1


ANIMA_BLOCKS = AnimaBlocks("anima", 28, 0, 0, 0)


def _detect(sd: Mapping[str, Any], metadata: Mapping[str, str]) -> bool:
    return K.is_anima(sd.keys())


def _detect_folder(folder: Path) -> bool:
    return (Path(folder) / FOLDER_FILES["dit"]).is_file()


SPEC = FamilySpec(
    name="anima",
    title="Anima",
    text_encoders=(TextEncoderSpec("", "qwen3", False, "<|endoftext|>", "Qwen/Qwen3-0.6B", "qwen3"),),
    configs={FLOW_MATCHING: "anima"},
    pipeline_class="",
    training_script="anima_train_network.py",
    scripts=SCRIPTS,
    load_hint="anima_train_network.py --pretrained_model_name_or_path DIT --qwen3 QWEN3 --vae VAE",
    detect=_detect,
    detect_folder=_detect_folder,
    block_swap=True,
)


def options_of(parts: Parts) -> AnimaOptions:
    return parts.options if isinstance(parts.options, AnimaOptions) else AnimaOptions()


def _identity(path: str) -> str:
    return path


class AnimaFamily:
    """Anima (module docstring; ``library.families.protocol.ModelFamily``)."""

    vae_scale = 1.0  # latents are normalised per channel (autoencoders/qwen_image.py)
    size_multiple = 16  # 8x VAE, 2x2 patches (sd-scripts: verify_bucket_reso_steps(16))
    num_text_encoders = 1
    ss_v2 = False
    adapter_prefixes = ("lora_unet", "lora_te")
    blocks = ANIMA_BLOCKS
    denoiser_name = "transformer"
    partial_text_cache = None  # one text encoder: its cached outputs cannot train its adapters
    # --fp8_base: sd-scripts' Anima exclusions (embedders, norms / adaLN modulations, final layer) stay in the compute
    # dtype; every other Linear of the blocks (and of the adapter) is stored in float8
    fp8_skip = ("patch_embed", "time_embed", "norm", "proj_out")
    target_classes = TARGETS
    options = AnimaOptions
    full_training = AnimaFullTraining()
    adapter_rules = MappingProxyType({lora.MODULE: lora})

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)
        self.tiny = AnimaTiny(self)

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
        options: AnimaOptions | None = None,
    ) -> Parts:
        """The DiT file (+ ``options.qwen3``, ``vae``, ``options.llm_adapter_path``) or an Anima folder
        (``loading.py``); ``ValueError`` naming the flag or the file."""
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to Anima: it is a flow-matching model")
        return load_anima(self.name, path, dtype=dtype, vae=None if vae is None else str(vae), device=device,
                          options=options or AnimaOptions())  # fmt: skip

    def save(
        self,
        parts: Parts,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        metadata: Mapping[str, str] | None = None,
        safetensors: bool = True,
    ) -> Path:
        """``*.safetensors``: the DiT as sd-scripts' full fine-tune writes it (``net.`` names, the adapter inside);
        another path: an Anima folder with the DiT, Qwen3 and the VAE; pickles are refused."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".ckpt", ".pt", ".pth", ".bin"):
            raise ValueError(f"{path}: Anima models are saved as .safetensors (or a folder), not pickles")
        if suffix == ".safetensors":
            return save_dit(parts, path, self, dtype, metadata)
        return save_folder(parts, path, self, dtype, metadata)

    def modelspec(self, title: str) -> dict[str, str]:
        from library.files.metadata import modelspec

        return modelspec(architecture=self.modelspec_architecture(), implementation=self.modelspec_implementation(),
                         title=title, resolution=self.default_resolution(), prediction_type=None)  # fmt: skip

    def reference_parts(self) -> Parts:
        """The released DiT (with its adapter) and Qwen3-0.6B on the meta device; ``vae`` None."""
        from accelerate import init_empty_weights

        from .model import build, released_config

        with init_empty_weights(include_buffers=True):
            denoiser = build(released_config())
            encoder = text.qwen3_factory(text.qwen3_config())()
        return Parts(denoiser, None, [encoder], [], {"shift": 3.0}, self.name)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """``[qwen3 ids, qwen3 mask, t5 ids, t5 mask]`` at the loaded lengths (``--qwen3_max_token_length`` /
        ``--t5_max_token_length``; ``max_token_length``, a CLIP setting, is not read)."""
        o = options_of(parts)
        return text.tokenize(parts.tokenizers, captions, o.qwen3_max_token_length, o.t5_max_token_length)

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(Qwen3 states (B, Lq, D), None, packed integer rows (``text.pack``))."""
        states, mask, t5_ids, t5_mask = text.encode(parts.text_encoders[0], tokens)
        return Cond(states, None, text.pack(mask.to(states.device), t5_ids.to(states.device), t5_mask))

    def encode_prompt(
        self, parts: Parts, captions: list[str], clip_skip: int | None = None, max_token_length: int | None = None
    ) -> Cond:
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length), clip_skip)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        raise ValueError("Anima has one text encoder: its cached outputs cannot train its adapters (add "
                         "--network_train_unet_only or drop --cache_text_encoder_outputs, as sd-scripts requires)")  # fmt: skip

    # ------------------------------------------------------------------------------------------- denoising
    def predict(
        self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *, time_ids: Tensor | None = None
    ) -> Tensor:
        """The velocity (B, 16, h, w) at t = 1000 σ (B,): the DiT runs on σ ∈ [0, 1] with the LLM adapter over the
        Qwen3 states and T5 ids (sd-scripts' ``Anima.forward``)."""
        if time_ids is not None:
            raise ValueError("Anima takes no size/crop time_ids")
        if cond.mask is None:
            raise ValueError("Anima needs the packed Qwen3 mask and T5 ids (cond.mask) to predict")
        qwen3_mask, t5_ids, t5_mask = text.unpack(cond.mask, cond.hidden_states.shape[1])
        b = noisy.shape[0]
        sigma = (t.to(noisy.device, torch.float32) / 1000).expand(b)
        return denoiser(noisy, sigma.to(noisy.dtype), cond.hidden_states.to(noisy.dtype),
                        source_attention_mask=qwen3_mask.to(noisy.device), t5_input_ids=t5_ids.to(noisy.device),
                        t5_attention_mask=t5_mask.to(noisy.device))  # fmt: skip

    def objective(self, parts: Parts) -> str:
        return FLOW_MATCHING

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: AnimaOptions) -> list[str]:
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> AnimaFlowObjective:
        flow = options_of(parts).flow
        if flow is None:
            from .objective import AnimaFlowConfig

            flow = AnimaFlowConfig()
        return anima_objective(self.spec.title, flow, noise, loss)

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        """``--blocks_to_swap``: the DiT's blocks, one per unit (sd-scripts' Anima allows up to blocks - 2)."""
        return [BlockList(denoiser.transformer_blocks, 1)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return qwen_image.encode(parts.vae, pixels)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        return qwen_image.decode(parts.vae, latents)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the DiT under sd-scripts' module paths (``keys.module_to_sd``); ``lora_te``: Qwen3 under
        its transformers paths (``layers.0.self_attn.q_proj``), as sd-scripts' ``lora_anima``."""
        return [Root("lora_unet", parts.denoiser, K.module_to_sd), Root("lora_te", parts.text_encoders[0], _identity)]

    def base_model_version(self, prediction_type: str = FLOW_MATCHING) -> str:
        return "anima"  # sd-scripts' AnimaNetworkTrainer.load_target_model

    def modelspec_architecture(self, kind: str = "", prediction_type: str = FLOW_MATCHING) -> str:
        return with_kind(ARCHITECTURE, kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        raise ValueError("Anima has no classic diffusers pipeline: it samples with the flow-matching Euler sampler")

    def flow_sampling(self, parts: Parts) -> FlowSampling:
        """sd-scripts' Anima sampling: the static shift 3.0 (``flow_shift``), noise (1, 16, h, w), 30 steps, CFG
        7.5."""
        return FlowSampling(embedded_guidance=False, shift=False, latent_channels=int(parts.denoiser.config.in_channels),
                            static_shift=float(parts.scheduler_config.get("shift", 3.0)), packed_noise=False,
                            default_steps=30, default_scale=7.5)  # fmt: skip

    def default_resolution(self, prediction_type: str = FLOW_MATCHING) -> int:
        return 1024


ANIMA = AnimaFamily(SPEC)
