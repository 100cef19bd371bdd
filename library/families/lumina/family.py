"""Lumina Image 2.0 (``LUMINA2``, "lumina2"): Alpha-VLLM's NextDiT 2B (diffusers ``Lumina2Transformer2DModel``),
conditioned on Gemma-2-2B's second-to-last hidden states under a system prompt, over the FLUX AE's
``(z − 0.1159) · 0.3611`` latents; a rectified flow whose network runs on τ = 1 − σ and predicts x0 − ε
(``objective.py``). Trained by ``lumina_train_network.py`` / ``lumina_train.py``.

Files (``loading.py``): the Alpha-VLLM single file (``model.diffusion_model.`` optional) with ``--gemma2 --ae``, or a
diffusers ``Lumina2Pipeline`` folder. Saving a ``.safetensors`` writes the transformer under Alpha-VLLM names (what
sd-scripts' ``lumina_train.py`` writes, what ComfyUI and diffusers' ``from_single_file`` read); any other path a
diffusers folder. Adapter names: ``lora_unet`` (Alpha-VLLM module paths, ``attention.qkv`` fused) and ``lora_te``
(Gemma), as sd-scripts' ``networks/lora_lumina.py``.
"""

from __future__ import annotations

import dataclasses
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
    TextEncoderSpec,
)
from ..blocks import BlockLayout
from ..loading import META_CONFIGS, META_FAMILY
from ..saving import _save_weights, atomic_dir, clean_config, with_kind
from . import keys as K
from . import lora
from .full_training import LuminaFullTraining
from .loading import is_lumina_folder, is_lumina_keys, load_lumina
from .model import DEFAULT_MAX_LENGTH, GEMMA_ID, gemma_hidden, released, time_of, tokenize, with_system_prompt
from .objective import LuminaFlowObjective, lumina_objective, objective_problems
from .options import LuminaOptions
from .tiny import LuminaTiny

log = logging.getLogger(__name__)

IMPLEMENTATION = "https://github.com/Alpha-VLLM/Lumina-Image-2.0"
ARCHITECTURE = "lumina-2"
GEMMA_SPEC = TextEncoderSpec("text_encoders.gemma2_2b.transformer.model.", "gemma2", False, "<pad>", GEMMA_ID,
                             "gemma2")  # fmt: skip
SCRIPTS = {"network": "lumina_train_network.py", "fine_tune": "lumina_train.py", "dreambooth": "lumina_train.py"}
TARGETS = TargetClasses(
    transformer=("Lumina2TransformerBlock", "LuminaLayerNormContinuous"),
    attention=("Attention",),
    text_encoder={"lora_te": lora.GEMMA_CLASSES},
    full_names=("x_embedder", "time_caption_embed"),
    text_encoder_attention={"lora_te": ("Gemma2Attention",)},
)
_RE_BLOCK = re.compile(r"lora_unet_layers_(\d+)_")


@dataclass(frozen=True)
class LuminaBlocks(BlockLayout):
    """Index = the main transformer layer (``lora_unet_layers_<n>_``); refiners, embedders and the final layer have
    none (sd-scripts' lora_lumina selects by ``train_blocks``, not block weights)."""

    def names_match(self, name: str) -> bool:
        return bool(_RE_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _RE_BLOCK.match(name)
        return int(m.group(1)) if m else -1


LUMINA_BLOCKS = LuminaBlocks("lumina2", 26, 0, 0, 0)

SPEC = FamilySpec(
    name="lumina2",
    title="Lumina Image 2.0",
    text_encoders=(GEMMA_SPEC,),
    configs={FLOW_MATCHING: "lumina2"},
    pipeline_class="Lumina2Pipeline",
    training_script="lumina_train_network.py",
    scripts=SCRIPTS,
    load_hint="lumina_train_network.py (with --gemma2 --ae for an Alpha-VLLM single file)",
    detect=lambda sd, metadata: is_lumina_keys(list(sd.keys())),
    detect_folder=lambda folder: is_lumina_folder(Path(folder)),
    group="Lumina 2",
    block_swap=True,
)


def options_of(parts: Parts) -> LuminaOptions:
    return parts.options if isinstance(parts.options, LuminaOptions) else LuminaOptions()


class LuminaFamily:
    """Lumina Image 2.0 (module docstring; ``library.families.protocol.ModelFamily``)."""

    vae_scale = 0.3611
    vae_shift = 0.1159
    size_multiple = 16  # 8x AE, 2x2 patches
    num_text_encoders = 1
    ss_v2 = False
    adapter_prefixes = ("lora_unet", "lora_te")
    blocks = LUMINA_BLOCKS
    denoiser_name = "transformer"
    # one text encoder: its cached outputs cannot train its adapters. --cache_text_encoder_outputs without
    # --network_train_unet_only trains the transformer's adapters only, with a warning (library/run/config.py;
    # sd-scripts builds Gemma's LoRA there and trains it over the cache, where it gets no gradient)
    partial_text_cache = None
    fp8_skip = ()
    target_classes = TARGETS
    options = LuminaOptions
    full_training = LuminaFullTraining()
    adapter_rules = MappingProxyType({lora.MODULE: lora})

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)
        self.tiny = LuminaTiny(self)
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # ------------------------------------------------------------------------------------------- files
    def load(self, path: str | Path, *, dtype: torch.dtype | PartDtypes = torch.float32, vae: str | Path | None = None,
             v_parameterization: bool | None = None, tokenizer_cache_dir: str | None = None, device: Any = "cpu",
             options: LuminaOptions | None = None) -> Parts:  # fmt: skip
        """An Alpha-VLLM file (+ ``options.gemma2`` / ``options.ae``) or a diffusers folder (``loading.py``);
        ``vae``: the same as ``ae``. ``ValueError`` / ``FileNotFoundError`` naming the flag or the file."""
        options = options or LuminaOptions()
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to Lumina 2: it is a flow-matching model")
        if vae is not None and options.ae is not None and Path(vae) != Path(options.ae):
            raise ValueError("--vae and --ae name different files; Lumina 2 has one AE: pass --ae only")
        parts = load_lumina(path, dtype=dtype, device=device, gemma2=options.gemma2, ae=options.ae or vae,
                            tokenizer_cache_dir=tokenizer_cache_dir, tiny=self.tiny.part_configs())  # fmt: skip
        parts.options = dataclasses.replace(options, gemma2_max_token_length=options.gemma2_max_token_length
                                            or DEFAULT_MAX_LENGTH)  # fmt: skip
        return parts

    def save(self, parts: Parts, path: str | Path, *, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None, safetensors: bool = True) -> Path:  # fmt: skip
        """``*.safetensors``: the transformer under Alpha-VLLM names (sd-scripts' ``lumina_train.py`` file; Gemma and
        the AE stay the user's files); a pickle suffix is refused; any other path: a diffusers folder."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".ckpt", ".pt", ".pth", ".bin"):
            raise ValueError(f"{path}: Lumina 2 models are saved as .safetensors or a diffusers folder, not pickles")
        if suffix == ".safetensors":
            state = K.diffusers_to_alpha(parts.denoiser.state_dict())
            meta = {META_FAMILY: self.name, META_CONFIGS: json.dumps(model_configs(parts)),
                    **self._modelspec(path.stem), **(metadata or {})}  # fmt: skip
            return save_state_dict(state, path, meta, dtype)
        return self._save_folder(parts, path, dtype, safetensors)

    def _save_folder(self, parts: Parts, folder: Path, dtype: torch.dtype | None, safetensors: bool) -> Path:
        from diffusers import FlowMatchEulerDiscreteScheduler

        suffix = ".safetensors" if safetensors else ".bin"
        with atomic_dir(folder) as tmp:
            self.pipeline(parts, None).save_config(tmp)
            for name, module in (("transformer", parts.denoiser), ("vae", parts.vae)):
                module.save_config(tmp / name)
                _save_weights(module.state_dict(), tmp / name / ("diffusion_pytorch_model" + suffix), dtype)
            gemma = parts.text_encoders[0]
            gemma.config.save_pretrained(tmp / "text_encoder")
            _save_weights(gemma.state_dict(), tmp / "text_encoder" / (("model" if safetensors else "pytorch_model")
                                                                     + suffix), dtype)  # fmt: skip
            parts.tokenizers[0].save_pretrained(tmp / "tokenizer")
            kwargs = {k: v for k, v in parts.scheduler_config.items() if k != "prediction_type"}
            FlowMatchEulerDiscreteScheduler(**kwargs).save_pretrained(tmp / "scheduler")
        return folder

    def _modelspec(self, title: str) -> dict[str, str]:
        return {"modelspec.sai_model_spec": "1.0.1", "modelspec.architecture": ARCHITECTURE,
                "modelspec.implementation": IMPLEMENTATION, "modelspec.title": title,
                "modelspec.resolution": "1024x1024",
                "modelspec.date": datetime.datetime.now().replace(microsecond=0).isoformat()}  # fmt: skip

    def reference_parts(self) -> Parts:
        """The released transformer and Gemma-2-2B on the meta device; ``vae`` None."""
        from accelerate import init_empty_weights

        from .model import gemma_factory, transformer_factory

        configs = released()
        with init_empty_weights():
            denoiser = transformer_factory(configs["transformer"])()
            gemma = gemma_factory(configs["text_encoder"])()
        return Parts(denoiser, None, [gemma], [], configs["scheduler"], self.name)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None, *,
                 negative: bool = False) -> list[Tensor]:  # fmt: skip
        """``[ids (B, L), mask (B, L)]``: the system prompt rule (not for ``negative`` prompts), L =
        ``--gemma2_max_token_length`` (256) padded to a multiple of 8. ``max_token_length`` (CLIP's) is not read."""
        if max_token_length not in (None, 75):
            self._warn_once("mtl", "--max_token_length %s is ignored for Lumina 2 (Gemma's length is "
                            "--gemma2_max_token_length)", max_token_length)  # fmt: skip
        options = options_of(parts)
        texts = list(captions) if negative else with_system_prompt(captions, options.system_prompt)
        ids, mask = tokenize(parts.tokenizers[0], texts, options.gemma2_max_token_length or DEFAULT_MAX_LENGTH)
        return [ids, mask]

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(Gemma ``hidden_states[-2]`` (B, L, 2304), no pooled output, mask (B, L))."""
        if clip_skip is not None:
            self._warn_once("clip_skip", "--clip_skip %s is ignored for Lumina 2 (as in sd-scripts)", clip_skip)
        ids, mask = tokens
        hidden = gemma_hidden(parts.text_encoders[0], ids, mask)
        return Cond(hidden, None, mask.to(hidden.device))

    def encode_prompt(self, parts: Parts, captions: list[str], clip_skip: int | None = None,
                      max_token_length: int | None = None, *, negative: bool = False) -> Cond:  # fmt: skip
        """:meth:`tokenize` (``negative``: without the system prompt) then :meth:`encode_tokens`."""
        tokens = self.tokenize(parts, captions, max_token_length, negative=negative)
        return self.encode_tokens(parts, tokens, clip_skip)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        raise ValueError("Lumina 2 has one text encoder: its cached outputs cannot train its adapters (add "
                         "--network_train_unet_only or drop --cache_text_encoder_outputs)")  # fmt: skip

    # ------------------------------------------------------------------------------------------- denoising
    def predict(self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *,
                time_ids: Tensor | None = None) -> Tensor:  # fmt: skip
        """The velocity ε − x0 (B, 16, h, w) at t = 1000 σ (B,): the transformer runs on τ = 1 − t / 1000 with
        Gemma's states and mask and predicts x0 − ε, which is negated (``objective.py``)."""
        if time_ids is not None:
            raise ValueError("Lumina 2 takes no size/crop time_ids")
        mask = cond.mask
        if mask is None:
            mask = torch.ones(cond.hidden_states.shape[:2], dtype=torch.long, device=cond.hidden_states.device)
        tau = time_of(t, noisy.shape[0], noisy.device, noisy.dtype)
        out = denoiser(hidden_states=noisy, timestep=tau, encoder_hidden_states=cond.hidden_states.to(noisy.dtype),
                       encoder_attention_mask=mask.to(noisy.device, torch.int32), return_dict=False)[0]  # fmt: skip
        return -out

    def objective(self, parts: Parts) -> str:
        return FLOW_MATCHING

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: LuminaOptions) -> list[str]:
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> LuminaFlowObjective:
        flow = options_of(parts).flow
        if flow is None:
            raise ValueError("Lumina 2 trains by flow matching, but the model was loaded without the objective's "
                             "flags (LuminaOptions.from_args(args, training=True))")  # fmt: skip
        return lumina_objective(self.spec.title, flow, noise, loss)

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        """``--blocks_to_swap``: the main layers (sd-scripts swaps NextDiT's ``layers``)."""
        return [BlockList(denoiser.layers, 1)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return flux_ae.encode(parts.vae, pixels, self.vae_scale, self.vae_shift, generator)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        return flux_ae.decode(parts.vae, latents, self.vae_scale, self.vae_shift)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the transformer under Alpha-VLLM module paths with the fused ``attention.qkv``;
        ``lora_te``: Gemma2Model under its own paths (``layers.0.self_attn.q_proj``)."""
        return [Root("lora_unet", parts.denoiser, K.rename, K.fused_modules(parts.denoiser)),
                Root("lora_te", parts.text_encoders[0], _identity)]  # fmt: skip

    def base_model_version(self, prediction_type: str = FLOW_MATCHING) -> str:
        """``ss_base_model_version``: "lumina2" (sd-scripts' ``MODEL_VERSION_LUMINA_V2``)."""
        return "lumina2"

    def modelspec_architecture(self, kind: str = "", prediction_type: str = FLOW_MATCHING) -> str:
        return with_kind(ARCHITECTURE, kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        """``Lumina2Pipeline`` over ``parts`` (the same modules)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

        if scheduler is None:
            kwargs = {k: v for k, v in parts.scheduler_config.items() if k != "prediction_type"}
            scheduler = FlowMatchEulerDiscreteScheduler(**kwargs)
        return Lumina2Pipeline(transformer=parts.denoiser, scheduler=scheduler, vae=parts.vae,
                               text_encoder=parts.text_encoders[0],
                               tokenizer=parts.tokenizers[0] if parts.tokenizers else None)  # fmt: skip

    def flow_sampling(self, parts: Parts) -> FlowSampling:
        """sd-scripts' Lumina sampling (``lumina_train_util.sample_image_inference``): no embedded guidance, the
        static shift of the scheduler config (6.0), noise drawn unpacked, 36 steps and CFG 3.5 by default, CFG only
        while 1 - σ < 0.25 (``--ctr``) with its norm capped at the conditional one (``--rcfg`` 1.0), negative
        prompts without the system prompt."""
        shift = float(parts.scheduler_config.get("shift", 6.0))
        return FlowSampling(embedded_guidance=False, shift=False, latent_channels=16, static_shift=shift,
                            packed_noise=False, default_steps=36, default_scale=3.5, cfg_trunc_ratio=0.25,
                            renorm_cfg=1.0, plain_negative=True)  # fmt: skip

    def default_resolution(self, prediction_type: str = FLOW_MATCHING) -> int:
        return 1024


def _identity(path: str) -> str:
    return path


def model_configs(parts: Parts) -> dict[str, Any]:
    return {"family": parts.family, "transformer": clean_config(parts.denoiser.config),
            "vae": clean_config(parts.vae.config) if parts.vae is not None else None,
            "text_encoder": clean_config(parts.text_encoders[0].config.to_dict()) if parts.text_encoders else None,
            "scheduler": dict(parts.scheduler_config)}  # fmt: skip


LUMINA2 = LuminaFamily(SPEC)
