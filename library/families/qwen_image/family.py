"""Qwen-Image (Alibaba Qwen): one family object, ``QWEN_IMAGE`` (registry name "qwen_image"), trained by
``qwen_image_train_network.py`` (LoRA, musubi-tuner's command line) and ``qwen_image_train.py`` (full fine-tune).

Parts: the DiT (diffusers' ``QwenImageTransformer2DModel``, ``model.py``), Qwen2.5-VL-7B's language model
(``encoders/qwen25vl.py``, shared with HunyuanImage 2.1), the Qwen-Image VAE (``autoencoders/qwen_image.py``, shared
with Anima), the Qwen2.5-VL tokenizer (shipped). Files: ``loading.py`` / ``saving.py``; objective: ``objective.py``;
flags: ``options.py``; LoRA rules: ``lora.py``; tiny model: ``tiny.py``.

Prompts: Qwen-Image's template around each caption, Qwen2.5-VL's last hidden states of the caption's tokens (the 34
template tokens dropped), zero-padded to the batch's longest, with their mask (musubi-tuner's
``get_qwen_prompt_embeds``). One text encoder, so its cached outputs cannot train its adapters
(``partial_text_cache = None``); musubi-tuner trains none.
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

from ..autoencoders import qwen_image
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
from ..encoders import qwen25vl
from ..full_training import PlainFullTraining
from ..saving import with_kind
from . import edit, lora
from . import model as M
from .loading import is_dit, is_folder, load_qwen_image
from .objective import QwenFlowConfig, QwenFlowObjective, objective_problems, qwen_objective
from .options import QwenImageOptions
from .saving import FOLDER_FILES, save_dit, save_folder
from .tiny import QwenImageTiny

log = logging.getLogger(__name__)

ARCHITECTURE = "qwen-image"  # musubi-tuner's sai_model_spec ARCH_QWEN_IMAGE
IMPLEMENTATION = "https://github.com/QwenLM/Qwen-Image"
SCRIPTS = {"network": "qwen_image_train_network.py", "fine_tune": "qwen_image_train.py",
           "dreambooth": "qwen_image_train.py"}  # fmt: skip
# the flow sampler's μ line is given at 4096 tokens: Qwen-Image's line through (256, 0.5) and (8192, 0.9) there
MU_AT_4096 = 0.5 + 0.4 * (4096 - 256) / (8192 - 256)

TARGETS = TargetClasses(
    transformer=lora.BLOCK_CLASSES,
    attention=("Attention",),
    text_encoder={},
    full_names=("img_in", "txt_in", "time_text_embed", "norm_out", "proj_out"),
)
_BLOCK = re.compile(r"lora_unet_transformer_blocks_(\d+)_")


@dataclass(frozen=True)
class QwenImageBlocks(BlockLayout):
    """The DiT's blocks in musubi-tuner's names (``lora_unet_transformer_blocks_<n>_...``)."""

    def names_match(self, name: str) -> bool:
        return bool(_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _BLOCK.match(name)
        return int(m.group(1)) if m else -1


QWEN_IMAGE_BLOCKS = QwenImageBlocks("qwen_image", 60, 0, 0, 0)


def _detect(sd: Mapping[str, Any], metadata: Mapping[str, str]) -> bool:
    return is_dit(sd.keys())


def _detect_folder(folder: Path) -> bool:
    return is_folder(Path(folder)) or (Path(folder) / FOLDER_FILES["dit"]).is_file() and \
        (Path(folder) / "text_encoder").is_dir()  # fmt: skip


SPEC = FamilySpec(
    name="qwen_image",
    title="Qwen-Image",
    text_encoders=(TextEncoderSpec("", "qwen25vl", False, "<|endoftext|>", "Qwen/Qwen-Image", "qwen25vl"),),
    configs={FLOW_MATCHING: "qwen_image"},
    pipeline_class="",
    training_script="qwen_image_train_network.py",
    scripts=SCRIPTS,
    load_hint="qwen_image_train_network.py --dit DIT --text_encoder QWEN2.5-VL --vae VAE",
    detect=_detect,
    detect_folder=_detect_folder,
    block_swap=True,
)


def options_of(parts: Parts) -> QwenImageOptions:
    return parts.options if isinstance(parts.options, QwenImageOptions) else QwenImageOptions()


def _identity(path: str) -> str:
    return path


class QwenImageFamily:
    """Qwen-Image (module docstring; ``library.families.protocol.ModelFamily``)."""

    vae_scale = 1.0  # latents are normalised per channel (autoencoders/qwen_image.py)
    size_multiple = 16  # 8x VAE, 2x2 patches
    num_text_encoders = 1
    ss_v2 = False
    adapter_prefixes = ("lora_unet",)
    blocks = QWEN_IMAGE_BLOCKS
    denoiser_name = "transformer"
    partial_text_cache = None  # one text encoder: its cached outputs cannot train its adapters
    # --fp8_base: the embedders, norms and the final projection stay in the compute dtype (musubi-tuner keeps
    # img_in / txt_in / norm_out / proj_out / time_text_embed out of fp8)
    fp8_skip = ("img_in", "txt_in", "time_text_embed", "norm", "proj_out")
    fp8_base_text_encoders = False  # musubi-tuner's --fp8_base stores the DiT only; Qwen2.5-VL has --fp8_vl
    # what lowers the text-caching phase (library/measure/advice.py tries them there)
    caching_memory_flags = (
        CachingMemoryFlag(("--fp8_vl",), "Qwen2.5-VL in float8", "text caching", 0.0,
                          "none in step time (the captions are encoded once, while caching); Qwen2.5-VL's Linear "
                          "weights in float8: slightly less exact text outputs, cached anew (musubi-tuner's "
                          "docs/qwen_image.md: recommended below 16 GB)"),
    )  # fmt: skip
    target_classes = TARGETS
    options = QwenImageOptions
    full_training = PlainFullTraining()
    adapter_rules = MappingProxyType({lora.MODULE: lora.RULES})

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)
        self.tiny = QwenImageTiny(self)

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # ------------------------------------------------------------------------------------------- files
    def load(self, path: str | Path, *, dtype: torch.dtype | PartDtypes = torch.float32, vae: str | Path | None = None,
             v_parameterization: bool | None = None, tokenizer_cache_dir: str | None = None, device: Any = "cpu",
             options: QwenImageOptions | None = None) -> Parts:  # fmt: skip
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to Qwen-Image: it is a flow-matching model")
        return load_qwen_image(self.name, path, dtype=dtype, vae=None if vae is None else str(vae), device=device,
                               options=options or QwenImageOptions())  # fmt: skip

    def save(self, parts: Parts, path: str | Path, *, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None, safetensors: bool = True) -> Path:  # fmt: skip
        """``*.safetensors``: the DiT in diffusers' names (musubi-tuner's full fine-tune output layout); another
        path: a folder with the DiT, Qwen2.5-VL and the VAE; pickles are refused."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".ckpt", ".pt", ".pth", ".bin"):
            raise ValueError(f"{path}: Qwen-Image models are saved as .safetensors (or a folder), not pickles")
        if suffix == ".safetensors":
            return save_dit(parts, path, self, dtype, metadata)
        return save_folder(parts, path, self, dtype, metadata)

    def modelspec(self, title: str) -> dict[str, str]:
        from library.files.metadata import modelspec

        return modelspec(architecture=self.modelspec_architecture(), implementation=self.modelspec_implementation(),
                         title=title, resolution=self.default_resolution(), prediction_type=None)  # fmt: skip

    def reference_parts(self) -> Parts:
        """The released DiT and Qwen2.5-VL-7B's language model on the meta device; ``vae`` None."""
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=True):
            denoiser = M.build(M.RELEASED)
            encoder = qwen25vl.factory(qwen25vl.RELEASED_TEXT)()
        return Parts(denoiser, None, [encoder], [], dict(M.SCHEDULER), self.name)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """``[ids, mask]`` of the captions in Qwen-Image's template (the batch's longest; ``max_token_length``, a
        CLIP setting, is not read)."""
        ids, mask = qwen25vl.tokenize(parts.tokenizers[0], captions)
        return [ids, mask]

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(states (B, L, 3584) of the caption tokens, None, mask (B, L))."""
        ids, mask = tokens
        states = qwen25vl.hidden(parts.text_encoders[0], ids, mask)
        states, mask = qwen25vl.trim(states, mask, qwen25vl.QWEN_IMAGE_DROP)
        return Cond(states, None, mask)

    def encode_prompt(self, parts: Parts, captions: list[str], clip_skip: int | None = None,
                      max_token_length: int | None = None, negative: bool = False,
                      controls: list[tuple[tuple[str, tuple[int, int]], ...]] | None = None) -> Cond:  # fmt: skip
        """The captions' conditioning; an edit model's with each caption's control images ``controls``: (file,
        (width, height) the dataset trains it at) each (``edit.py``). Without control images the plain prompt, as
        musubi-tuner encodes an edit model's caption that has none."""
        version = options_of(parts).model_version
        if controls and all(controls) and version in edit.E.VERSIONS:
            states, mask = edit.encode(parts.text_encoders[0], parts.tokenizers[0], captions, controls, version)
            return Cond(states, None, mask)
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length), clip_skip)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        raise ValueError("Qwen-Image has one text encoder: its cached outputs cannot train its adapters (add "
                         "--network_train_unet_only or drop --cache_text_encoder_outputs)")  # fmt: skip

    # ------------------------------------------------------------------------------------------- denoising
    def predict(self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *, time_ids: Tensor | None = None,
                references: Sequence[Tensor] = ()) -> Tensor:  # fmt: skip
        """The velocity (B, 16, h, w) at the timesteps ``t`` (B,): the DiT gets t / 1000 (musubi-tuner's
        ``call_dit``; training's timesteps are 1000 σ + 1, as musubi-tuner's); ``references``: an edit model's
        control latents (B, 16, h_k, w_k), packed after the noisy latents (``model.forward``)."""
        if time_ids is not None:
            raise ValueError("Qwen-Image takes no size/crop time_ids")
        b = noisy.shape[0]
        sigma = (t.to(noisy.device, torch.float32) / 1000).expand(b)
        refs = [r.to(noisy.dtype) for r in references]
        return M.forward(denoiser, noisy, sigma, cond.hidden_states.to(noisy.dtype), cond.mask, references=refs)

    def objective(self, parts: Parts) -> str:
        return FLOW_MATCHING

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: QwenImageOptions) -> list[str]:
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> QwenFlowObjective:
        flow = options_of(parts).flow or QwenFlowConfig()
        return qwen_objective(self.spec.title, flow, noise, loss)

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        return [BlockList(denoiser.transformer_blocks, 1)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return qwen_image.encode(parts.vae, pixels)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        return qwen_image.decode(parts.vae, latents)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the DiT under its module paths (musubi-tuner's names)."""
        return [Root("lora_unet", parts.denoiser, _identity)]

    def base_model_version(self, prediction_type: str = FLOW_MATCHING) -> str:
        return "qwen_image"

    def modelspec_architecture(self, kind: str = "", prediction_type: str = FLOW_MATCHING) -> str:
        return with_kind(ARCHITECTURE, kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        raise ValueError("Qwen-Image samples with the flow-matching Euler sampler, not a classic diffusers pipeline")

    def flow_sampling(self, parts: Parts) -> FlowSampling:
        """musubi-tuner's Qwen-Image sampling (without its shift_terminal stretch): the dynamic shift (μ from
        (256, 0.5) to (8192, 0.9)), noise drawn as
        (1, 16, h, w), 25 steps, true CFG 4.0 (its qwen_image_generate_image.py defaults); a static shift instead
        when ``scheduler_config["static_shift"]`` is set (``--flow_shift``)."""
        static = parts.scheduler_config.get("static_shift")
        if static is not None:
            return FlowSampling(embedded_guidance=False, shift=False, static_shift=float(static),
                                latent_channels=int(parts.denoiser.config.out_channels), packed_noise=False,
                                default_steps=25, default_scale=4.0)  # fmt: skip
        return FlowSampling(embedded_guidance=False, shift=True, base_shift=0.5, max_shift=MU_AT_4096,
                            latent_channels=int(parts.denoiser.config.out_channels), packed_noise=False,
                            default_steps=25, default_scale=4.0)  # fmt: skip

    def default_resolution(self, prediction_type: str = FLOW_MATCHING) -> int:
        return 1024


QWEN_IMAGE = QwenImageFamily(SPEC)
