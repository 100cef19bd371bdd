"""Z-Image (Tongyi-MAI; Turbo and Base): one family object, ``ZIMAGE`` (registry name "zimage"), trained by
``zimage_train_network.py`` (LoRA, musubi-tuner's command line) and ``zimage_train.py`` (full fine-tune).

Parts: the DiT (diffusers' ``ZImageTransformer2DModel``, ``model.py``), Qwen3-4B (``encoders/qwen3.py``, shared),
FLUX.1's AE (``autoencoders/flux_ae.py``: latents (z − 0.1159) · 0.3611), the Qwen3 tokenizer (shipped). Files:
``loading.py`` / ``saving.py``; objective: ``objective.py``; flags: ``options.py``; LoRA rules: ``lora.py``; tiny
model: ``tiny.py``.

Prompts: Qwen3's chat template around each caption (one user turn, thinking on: diffusers' ``ZImagePipeline``,
musubi-tuner's ``get_text_embeds``), hidden-states layer −2 at the real tokens, zero-padded to the batch's longest,
with their mask; the DiT gets each caption at its own length. One text encoder, so its cached outputs cannot train
its adapters (``partial_text_cache = None``); musubi-tuner trains none.

Turbo and Base have the same weights' layout; ``--model_version base|turbo`` picks the sampler defaults.
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

from ..autoencoders import flux_ae
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
from ..encoders import qwen3
from ..full_training import PlainFullTraining
from ..saving import with_kind
from . import lora
from . import model as M
from .loading import is_dit, is_folder, load_zimage
from .objective import ZImageFlowConfig, ZImageFlowObjective, objective_problems, zimage_objective
from .options import ZImageOptions
from .saving import FOLDER_FILES, save_dit, save_folder
from .tiny import ZImageTiny

log = logging.getLogger(__name__)

ARCHITECTURE = "z-image"
IMPLEMENTATION = "https://github.com/Tongyi-MAI/Z-Image"
SCRIPTS = {"network": "zimage_train_network.py", "fine_tune": "zimage_train.py", "dreambooth": "zimage_train.py"}
SCALE, SHIFT = 0.3611, 0.1159  # FLUX.1's AE latents (musubi-tuner's ZIMAGE_VAE_SCALING_FACTOR / SHIFT_FACTOR)
# steps, CFG as uncond + s (cond − uncond) (1.0: none); musubi-tuner's base default is its cond + 4 (cond − uncond)
SAMPLER = {"base": (25, 5.0), "turbo": (8, 1.0)}

TARGETS = TargetClasses(
    transformer=lora.BLOCK_CLASSES,
    attention=("Attention",),
    text_encoder={},
    # not t_embedder: diffusers' TimestepEmbedder reads its first Linear's .weight.dtype outside that Linear's forward
    full_names=("all_x_embedder", "cap_embedder", "all_final_layer"),
)
_BLOCK = re.compile(r"lora_unet_layers_(\d+)_")


@dataclass(frozen=True)
class ZImageBlocks(BlockLayout):
    """The DiT's main blocks in musubi-tuner's names (``lora_unet_layers_<n>_...``)."""

    def names_match(self, name: str) -> bool:
        return bool(_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _BLOCK.match(name)
        return int(m.group(1)) if m else -1


ZIMAGE_BLOCKS = ZImageBlocks("zimage", 30, 0, 0, 0)


def _detect(sd: Mapping[str, Any], metadata: Mapping[str, str]) -> bool:
    return is_dit(sd.keys())


def _detect_folder(folder: Path) -> bool:
    folder = Path(folder)
    return is_folder(folder) or (folder / FOLDER_FILES["dit"]).is_file() and (folder / "text_encoder").is_dir() and \
        _detect(_keys(folder / FOLDER_FILES["dit"]), {})  # fmt: skip


def _keys(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict.fromkeys(f.keys())


SPEC = FamilySpec(
    name="zimage",
    title="Z-Image",
    text_encoders=(TextEncoderSpec("", "qwen3", False, "<|endoftext|>", "Tongyi-MAI/Z-Image", "qwen3"),),
    configs={FLOW_MATCHING: "zimage"},
    pipeline_class="",
    training_script="zimage_train_network.py",
    scripts=SCRIPTS,
    load_hint="zimage_train_network.py --dit DIT --text_encoder QWEN3 --vae AE",
    detect=_detect,
    detect_folder=_detect_folder,
    block_swap=True,
)


def options_of(parts: Parts) -> ZImageOptions:
    return parts.options if isinstance(parts.options, ZImageOptions) else ZImageOptions()


def _identity(path: str) -> str:
    return path


class ZImageFamily:
    """Z-Image (module docstring; ``library.families.protocol.ModelFamily``)."""

    vae_scale = SCALE
    size_multiple = 16  # 8x AE, 2x2 patches
    num_text_encoders = 1
    ss_v2 = False
    adapter_prefixes = ("lora_unet",)
    blocks = ZIMAGE_BLOCKS
    denoiser_name = "transformer"
    partial_text_cache = None  # one text encoder: its cached outputs cannot train its adapters
    # --fp8_base: the embedders, the final layer, the modulations and norms stay in the compute dtype (musubi-tuner
    # stores only the blocks' Linears in fp8, not their _modulation / norms)
    fp8_skip = ("t_embedder", "cap_embedder", "all_x_embedder", "all_final_layer", "adaLN_modulation", "norm")
    fp8_base_text_encoders = False  # musubi-tuner's --fp8_base stores the DiT only; Qwen3 has --fp8_llm
    # what lowers the text-caching phase (library/measure/advice.py tries them there)
    caching_memory_flags = (
        CachingMemoryFlag(("--fp8_llm",), "Qwen3 in float8", "text caching", 0.0,
                          "none in step time (the captions are encoded once, while caching); Qwen3's Linear weights "
                          "in float8: slightly less exact text outputs, cached anew (musubi-tuner's docs/zimage.md)"),
    )  # fmt: skip
    target_classes = TARGETS
    options = ZImageOptions
    full_training = PlainFullTraining()
    adapter_rules = MappingProxyType({lora.MODULE: lora.RULES})

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)
        self.tiny = ZImageTiny(self)

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # ------------------------------------------------------------------------------------------- files
    def load(self, path: str | Path, *, dtype: torch.dtype | PartDtypes = torch.float32, vae: str | Path | None = None,
             v_parameterization: bool | None = None, tokenizer_cache_dir: str | None = None, device: Any = "cpu",
             options: ZImageOptions | None = None) -> Parts:  # fmt: skip
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to Z-Image: it is a flow-matching model")
        return load_zimage(self.name, path, dtype=dtype, vae=None if vae is None else str(vae), device=device,
                           options=options or ZImageOptions())  # fmt: skip

    def save(self, parts: Parts, path: str | Path, *, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None, safetensors: bool = True) -> Path:  # fmt: skip
        """``*.safetensors``: the DiT in diffusers' names (musubi-tuner's full fine-tune output layout); another
        path: a folder with the DiT, Qwen3 and the AE; pickles are refused."""
        path = Path(path)
        if path.suffix.lower() in (".ckpt", ".pt", ".pth", ".bin"):
            raise ValueError(f"{path}: Z-Image models are saved as .safetensors (or a folder), not pickles")
        if path.suffix.lower() == ".safetensors":
            return save_dit(parts, path, self, dtype, metadata)
        return save_folder(parts, path, self, dtype, metadata)

    def modelspec(self, title: str) -> dict[str, str]:
        from library.files.metadata import modelspec

        return modelspec(architecture=self.modelspec_architecture(), implementation=self.modelspec_implementation(),
                         title=title, resolution=self.default_resolution(), prediction_type=None)  # fmt: skip

    def reference_parts(self) -> Parts:
        """The released DiT and Qwen3-4B on the meta device; ``vae`` None."""
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=True):
            denoiser = M.build(M.RELEASED)
            encoder = qwen3.factory(qwen3.RELEASED_4B)()
        return Parts(denoiser, None, [encoder], [], dict(M.SCHEDULER), self.name)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """``[ids, mask]`` of the captions in Qwen3's chat template (the batch's longest, at most 512)."""
        ids, mask = qwen3.tokenize(parts.tokenizers[0], captions)
        return [ids, mask]

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(states (B, L, 2560) of hidden-states layer −2 at the real tokens (zero past them), None, mask)."""
        ids, mask = tokens
        return Cond(qwen3.hidden(parts.text_encoders[0], ids, mask), None, mask)

    def encode_prompt(self, parts: Parts, captions: list[str], clip_skip: int | None = None,
                      max_token_length: int | None = None, negative: bool = False) -> Cond:  # fmt: skip
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length), clip_skip)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        raise ValueError("Z-Image has one text encoder: its cached outputs cannot train its adapters (add "
                         "--network_train_unet_only or drop --cache_text_encoder_outputs)")  # fmt: skip

    # ------------------------------------------------------------------------------------------- denoising
    def predict(self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *,
                time_ids: Tensor | None = None) -> Tensor:  # fmt: skip
        """The velocity ε − x0 (B, 16, h, w) at the timesteps ``t`` (B,): the DiT runs on τ = (1000 − t) / 1000
        (musubi-tuner's ``call_dit``) and predicts x0 − ε, which is negated (``objective.py``)."""
        if time_ids is not None:
            raise ValueError("Z-Image takes no size/crop time_ids")
        b = noisy.shape[0]
        tau = ((1000 - t.to(noisy.device, torch.float32)) / 1000).expand(b)
        return -M.forward(denoiser, noisy, tau, cond.hidden_states.to(noisy.dtype), cond.mask)

    def objective(self, parts: Parts) -> str:
        return FLOW_MATCHING

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: ZImageOptions) -> list[str]:
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> ZImageFlowObjective:
        flow = options_of(parts).flow or ZImageFlowConfig()
        return zimage_objective(self.spec.title, flow, noise, loss)

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        return [BlockList(denoiser.layers, 1)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return flux_ae.encode(parts.vae, pixels, SCALE, SHIFT, generator)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        return flux_ae.decode(parts.vae, latents, SCALE, SHIFT)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the DiT under its module paths (musubi-tuner's names)."""
        return [Root("lora_unet", parts.denoiser, _identity)]

    def base_model_version(self, prediction_type: str = FLOW_MATCHING) -> str:
        return "zimage"

    def modelspec_architecture(self, kind: str = "", prediction_type: str = FLOW_MATCHING) -> str:
        return with_kind(ARCHITECTURE, kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        raise ValueError("Z-Image samples with the flow-matching Euler sampler, not a classic diffusers pipeline")

    def flow_sampling(self, parts: Parts) -> FlowSampling:
        """musubi-tuner's Z-Image sampling: a static shift (3.0, or ``scheduler_config["static_shift"]``), noise drawn
        as (1, 16, h, w); base: 25 steps, CFG 5.0 (musubi-tuner's 4.0: its CFG is cond + g (cond − uncond)); turbo: 8 steps, no CFG (``--model_version``)."""
        steps, scale = SAMPLER.get(options_of(parts).model_version, SAMPLER["base"])
        shift = float(parts.scheduler_config.get("static_shift", parts.scheduler_config.get("shift", 3.0)))
        return FlowSampling(embedded_guidance=False, shift=False, static_shift=shift,
                            latent_channels=int(parts.denoiser.config.in_channels), packed_noise=False,
                            default_steps=steps, default_scale=scale, linear_grid=True)  # fmt: skip

    def default_resolution(self, prediction_type: str = FLOW_MATCHING) -> int:
        return 1024


ZIMAGE = ZImageFamily(SPEC)
