"""HunyuanImage 2.1 (Tencent): one family object, ``HUNYUAN_IMAGE`` (registry name "hunyuan_image"), trained by
``hunyuan_image_train_network.py`` (LoRA; sd-scripts has no full fine-tune script for it).

Parts: the DiT (diffusers' ``HunyuanImageTransformer2DModel``, read from Tencent's file through ``keys.py``),
Qwen2.5-VL-7B (the shared ``encoders/qwen25vl.py``) and byT5-small Glyph (transformers' ``T5EncoderModel``), the 32x
VAE with 64 latent channels (diffusers' ``AutoencoderKLHunyuanImage``); latents = the VAE's sample x 0.75289 (sd-scripts'
``shift_scale_latents``). The objective is sd-scripts' (``objective.py``): integer timesteps ``int(1000 σ)``, target
ε − x0. Conditioning (``model.py``): ``Cond.hidden_states`` holds Qwen's states then byT5's 128 rows (zero-padded to
Qwen's width), ``Cond.mask`` both masks side by side.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from library.files.weights import save_state_dict
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from ..base import (
    FLOW_MATCHING,
    BlockList,
    CachingMemoryFlag,
    Cond,
    FamilySpec,
    FlowSampling,
    PartDtypes,
    Parts,
    ProjectedGuidance,
    Root,
    TargetClasses,
    TextEncoderSpec,
)
from ..blocks import BlockLayout
from ..full_training import PlainFullTraining
from ..loading import META_CONFIGS, META_FAMILY
from ..saving import clean_config, with_kind
from . import keys as K
from . import lora
from . import model as M
from .loading import load_hunyuan
from .objective import HunyuanFlowConfig, HunyuanFlowObjective, hunyuan_objective, objective_problems
from .options import HunyuanOptions
from .tiny import HunyuanTiny

log = logging.getLogger(__name__)

ARCHITECTURE = "hunyuan-image-2.1"  # sd-scripts' sai_model_spec
IMPLEMENTATION = "https://github.com/Tencent-Hunyuan/HunyuanImage-2.1"
SCRIPTS = {"network": "hunyuan_image_train_network.py"}
TARGETS = TargetClasses(
    transformer=("HunyuanImageTransformerBlock", "HunyuanImageSingleTransformerBlock"),
    attention=("Attention",),
    text_encoder={},
    full_names=(
        "x_embedder",
        "context_embedder",
        "context_embedder_2",
        "time_guidance_embed",
        "norm_out",
        "proj_out",
    ),  # fmt: skip
    text_encoder_attention={},
)
_BLOCK = re.compile(r"lora_unet_(double|single)_blocks_(\d+)_")


@dataclass(frozen=True)
class HunyuanBlocks(BlockLayout):
    """The double blocks, then the single blocks (``lora_unet_double_blocks_<n>_`` / ``..._single_blocks_<n>_``)."""

    def names_match(self, name: str) -> bool:
        return bool(_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _BLOCK.match(name)
        if not m:
            return -1
        return int(m.group(2)) + (20 if m.group(1) == "single" else 0)


HUNYUAN_BLOCKS = HunyuanBlocks("hunyuan_image", 60, 0, 0, 0)

SPEC = FamilySpec(
    name="hunyuan_image",
    title="HunyuanImage 2.1",
    text_encoders=(
        TextEncoderSpec("", "qwen2_5_vl", False, "<|endoftext|>", "Qwen/Qwen2.5-VL-7B-Instruct", "qwen25vl"),
        TextEncoderSpec("", "byt5", False, "<pad>", "google/byt5-small", "byt5"),
    ),  # fmt: skip
    configs={FLOW_MATCHING: "hunyuan_image"},
    pipeline_class="HunyuanImagePipeline",
    training_script="hunyuan_image_train_network.py",
    scripts=SCRIPTS,
    load_hint="hunyuan_image_train_network.py --pretrained_model_name_or_path DIT --text_encoder QWEN --byt5 BYT5 "
    "--vae VAE",
    detect=lambda sd, metadata: K.is_tencent(sd.keys()),
    detect_folder=None,
    block_swap=True,
)


def options_of(parts: Parts) -> HunyuanOptions:
    return parts.options if isinstance(parts.options, HunyuanOptions) else HunyuanOptions()


class HunyuanImageFamily:
    """HunyuanImage 2.1 (module docstring; ``library.families.protocol.ModelFamily``)."""

    vae_scale = 0.75289
    size_multiple = 32  # 32x VAE, 1x1 patches (sd-scripts: verify_bucket_reso_steps(32))
    latent_downscale = 32  # the VAE's spatial factor (the latent cache checks the latents' size by it)
    num_text_encoders = 2
    ss_v2 = False
    adapter_prefixes = ("lora_unet",)
    blocks = HUNYUAN_BLOCKS
    denoiser_name = "transformer"
    partial_text_cache = None  # no text-encoder adapters: --network_train_unet_only is required
    # sd-scripts ignores --fp8_base beside --fp8_scaled (and refuses it alone): Qwen2.5-VL's float8 is --fp8_vl
    fp8_base_text_encoders = False
    # sd-scripts' fp8 rule (FP8_OPTIMIZATION_TARGET_KEYS): every Linear of the double / single blocks (modulations
    # and the single blocks' proj_out included), nothing outside them
    fp8_skip = ("x_embedder", "context_embedder", "time_guidance_embed", "norm_out", "proj_out$")
    # what lowers the text-caching phase (library/measure/advice.py tries them there); --text_encoder_cpu is named,
    # not planned: the planner's device check refuses host compute while a device phase runs, and planning it would
    # compute the 7 B encoder on the host's phantom weights
    caching_memory_flags = (
        CachingMemoryFlag(("--fp8_vl",), "Qwen2.5-VL in float8", "text caching", 0.0,
                          "none in step time (the captions are encoded once, while caching); Qwen2.5-VL's Linear "
                          "and norm weights in float8: slightly less exact text outputs, cached anew (sd-scripts' "
                          "docs/hunyuan_image_train_network.md)"),
        CachingMemoryFlag(("--text_encoder_cpu",), "the text encoders on the CPU", "text caching", 0.0,
                          "none in step time with the outputs cached; the captions are encoded on the CPU, a few "
                          "minutes each (sd-scripts' docs/hunyuan_image_train_network.md: under 12 GB, with "
                          "--cache_text_encoder_outputs_to_disk)",
                          planned=False),
    )  # fmt: skip
    target_classes = TARGETS
    options = HunyuanOptions
    full_training = PlainFullTraining()
    adapter_rules = MappingProxyType({lora.MODULE: lora})

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)
        self.tiny = HunyuanTiny(self)

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # ------------------------------------------------------------------------------------------- files
    def load(self, path: str | Path, *, dtype: torch.dtype | PartDtypes = torch.float32, vae: str | Path | None = None,
             v_parameterization: bool | None = None, tokenizer_cache_dir: str | None = None, device: Any = "cpu",
             options: HunyuanOptions | None = None) -> Parts:  # fmt: skip
        """Tencent's DiT file + ``options.text_encoder`` / ``options.byt5`` / ``vae`` (``loading.py``)."""
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to HunyuanImage 2.1: it is a flow-matching model")
        return load_hunyuan(self.name, path, dtype=dtype, vae=None if vae is None else str(vae), device=device,
                            options=options or HunyuanOptions())  # fmt: skip

    def save(self, parts: Parts, path: str | Path, *, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None, safetensors: bool = True) -> Path:  # fmt: skip
        """``*.safetensors``: the DiT under Tencent's names (what sd-scripts and ComfyUI read); other paths are
        refused (the text encoders and the VAE stay the user's files)."""
        path = Path(path)
        if path.suffix.lower() != ".safetensors":
            raise ValueError(f"{path}: HunyuanImage 2.1's DiT is saved as one .safetensors file (Tencent's layout)")
        state = K.diffusers_to_tencent(parts.denoiser.state_dict())
        meta = {META_FAMILY: self.name, META_CONFIGS: json.dumps(model_configs(parts)), **self._modelspec(path.stem),
                **(metadata or {})}  # fmt: skip
        return save_state_dict(state, path, meta, dtype)

    def _modelspec(self, title: str) -> dict[str, str]:
        return {"modelspec.sai_model_spec": "1.0.1", "modelspec.architecture": ARCHITECTURE,
                "modelspec.implementation": IMPLEMENTATION, "modelspec.title": title,
                "modelspec.resolution": "2048x2048",
                "modelspec.date": datetime.datetime.now().replace(microsecond=0).isoformat()}  # fmt: skip

    def reference_parts(self) -> Parts:
        """The released DiT and both text encoders on the meta device; ``vae`` None."""
        from accelerate import init_empty_weights

        from ..encoders import qwen25vl

        with init_empty_weights():
            denoiser = M.transformer_factory(M.TRANSFORMER)()
            qwen = qwen25vl.factory(qwen25vl.RELEASED_TEXT)()
            byt5 = M.byt5_factory(M.BYT5)()
        return Parts(denoiser, None, [qwen, byt5], [], dict(M.SCHEDULER), self.name)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """``[qwen ids, qwen mask, byt5 ids, byt5 mask]`` (``model.py``); ``max_token_length`` (CLIP's) is not read."""
        qwen_ids, qwen_mask = M.tokenize_qwen(parts.tokenizers[0], captions, options_of(parts).qwen_max_length)
        byt5_ids, byt5_mask = M.tokenize_byt5(parts.tokenizers[1], captions)
        return [qwen_ids, qwen_mask, byt5_ids, byt5_mask]

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond([Qwen hidden_states[-3] without the template | byT5 states], None, [Qwen mask | byT5 mask])."""
        qwen_ids, qwen_mask, byt5_ids, byt5_mask = tokens
        states, mask = M.encode_qwen(parts.text_encoders[0], qwen_ids, qwen_mask)
        byt5_states = M.encode_byt5(parts.text_encoders[1], byt5_ids, byt5_mask)
        hidden, packed = M.pack(states, mask, byt5_states, byt5_mask)
        return Cond(hidden, None, packed)

    def encode_prompt(self, parts: Parts, captions: list[str], clip_skip: int | None = None,
                      max_token_length: int | None = None) -> Cond:  # fmt: skip
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length), clip_skip)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        raise ValueError("HunyuanImage 2.1 trains no text-encoder adapters (add --network_train_unet_only)")

    # ------------------------------------------------------------------------------------------- denoising
    def predict(self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *,
                time_ids: Tensor | None = None) -> Tensor:  # fmt: skip
        """The velocity (B, 64, h, w) at timesteps t (B,) (whole numbers, as sd-scripts passes them; sampling's
        1000 σ is truncated):
        Qwen's states cut to the batch's longest caption, byT5's to the batch's longest quoted text (none without
        one): sd-scripts' ``HYImageDiffusionTransformer.forward`` cuts the joined text to the batch's longest valid
        part too, where diffusers' transformer would carry all 128 masked byT5 rows through every block."""
        if time_ids is not None:
            raise ValueError("HunyuanImage 2.1 takes no size/crop time_ids")
        qwen, qwen_mask, byt5, byt5_mask = M.unpack(cond.hidden_states, cond.mask,
                                                    int(denoiser.config.text_embed_2_dim))  # fmt: skip
        qwen, qwen_mask = M.trim_text(qwen, qwen_mask)
        byt5, byt5_mask = M.trim_text(byt5, byt5_mask, minimum=0)
        b = noisy.shape[0]
        # whole numbers in float32, as sd-scripts embeds them: training passes int(1000 σ), sampling 1000 σ, which
        # sd-scripts' sampler truncates (``.to(torch.int64)``)
        timestep = t.to(noisy.device, torch.float32).floor().expand(b)
        dtype, device = noisy.dtype, noisy.device
        return denoiser(noisy, timestep, qwen.to(device, dtype), qwen_mask.to(device),
                        encoder_hidden_states_2=byt5.to(device, dtype), encoder_attention_mask_2=byt5_mask.to(device),
                        return_dict=False)[0]  # fmt: skip

    def objective(self, parts: Parts) -> str:
        return FLOW_MATCHING

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: HunyuanOptions) -> list[str]:
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> HunyuanFlowObjective:
        flow = options_of(parts).flow or HunyuanFlowConfig()
        return hunyuan_objective(self.spec.title, flow, noise, loss)

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        """``--blocks_to_swap`` N: N // 2 double blocks and 2 (N - N // 2) single blocks, as sd-scripts splits N."""
        return [BlockList(denoiser.transformer_blocks, 1), BlockList(denoiser.single_transformer_blocks, 2)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """The VAE's posterior sample x 0.75289 (sd-scripts: ``vae.encode(x).sample()`` then
        ``shift_scale_latents``)."""
        vae = parts.vae
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        return dist.sample(generator) * self.vae_scale

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        vae = parts.vae
        return vae.decode((latents / self.vae_scale).to(vae.device, vae.dtype)).sample

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the DiT under Tencent's module paths, the fused modules over diffusers' leaves."""
        return [Root("lora_unet", parts.denoiser, K.rename, K.fused_modules(parts.denoiser))]

    def base_model_version(self, prediction_type: str = FLOW_MATCHING) -> str:
        return "hunyuan_image_2.1"  # sd-scripts' HunyuanImageNetworkTrainer model_version

    def modelspec_architecture(self, kind: str = "", prediction_type: str = FLOW_MATCHING) -> str:
        return with_kind(ARCHITECTURE, kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        raise ValueError("HunyuanImage 2.1 samples with the flow-matching Euler sampler here (diffusers' "
                         "HunyuanImagePipeline needs the full Qwen2.5-VL processor)")  # fmt: skip

    def flow_sampling(self, parts: Parts) -> FlowSampling:
        """sd-scripts' sampler (``hunyuan_image_minimal_inference.generate_body``, which its training samples call
        too): 20 steps (sample prompts), CFG 3.5, the static shift 5.0 on ``linspace(1, 0, steps + 1)``, noise
        (1, 64, h, w), and APG after step 5 (38 for a prompt with quoted text). ``parts.scheduler_config`` may set
        ``shift`` and the APG settings (the minimal inference script's ``--flow_shift --apg_start_step_general
        --apg_start_step_ocr --guidance_rescale --guidance_rescale_apg``)."""
        config = parts.scheduler_config
        apg = ProjectedGuidance(start_step=int(config.get("apg_start_step_general", 5)),
                                text_start_step=int(config.get("apg_start_step_ocr", 38)),
                                rescale=float(config.get("guidance_rescale", 0.0)),
                                rescale_apg=float(config.get("guidance_rescale_apg", 0.0)),
                                renders_text=lambda prompt: M.glyph_text(prompt) is not None)  # fmt: skip
        return FlowSampling(embedded_guidance=False, shift=False, latent_channels=int(parts.denoiser.config.in_channels),
                            static_shift=float(config.get("shift", 5.0)), packed_noise=False, default_steps=20,
                            default_scale=3.5, latent_downscale=32, linear_shift=True, apg=apg,
                            latent_patch=1)  # fmt: skip

    def default_resolution(self, prediction_type: str = FLOW_MATCHING) -> int:
        return 2048


def model_configs(parts: Parts) -> dict[str, Any]:
    return {"family": parts.family, "transformer": clean_config(parts.denoiser.config),
            "scheduler": dict(parts.scheduler_config)}  # fmt: skip


HUNYUAN_IMAGE = HunyuanImageFamily(SPEC)
