"""Stable Cascade stage C (``STABLE_CASCADE``, "stable_cascade"): the Würstchen v3 prior (diffusers
``StableCascadeUNet``, 3.6B or lite 1B) over 16-channel EfficientNetV2-S latents (1/32 of the image; ``effnet.py``),
conditioned on CLIP-bigG's last hidden states and projected pooled output (and a zero CLIP image embedding, as the
trainers), trained on the continuous cosine DDPM ε objective with P2 weighting (``objective.py``). Trained by
``stable_cascade_train_c_network.py`` / ``stable_cascade_train_stage_c.py`` (the names of sd-scripts' stable-cascade
branch, whose flags they take).

Files (``loading.py``): Stability's stage C single file with ``--text_model_checkpoint_path`` and
``--effnet_checkpoint_path``, or a diffusers ``StableCascadePriorPipeline`` folder. Saving a ``.safetensors`` writes
stage C under Stability's names (what the branch writes and ComfyUI, diffusers' ``from_single_file`` and the branch
read); any other path a diffusers prior folder (with the EfficientNet encoder in ``effnet/``, read back from there). Adapter names: ``lora_unet_`` + the module path in Stability's /
ComfyUI's model (``attention.attn.to_q``, ``attention.attn.out_proj``), every Linear and 1x1 convolution of stage C as
the branch's ``networks.lora`` ("replace all modules for Stable Cascade Stage C"): ComfyUI's ``lora_unet_`` rule.
"""

from __future__ import annotations

import json
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

from ..base import EPSILON, BlockList, Cond, FamilySpec, PartDtypes, Parts, Root, TargetClasses, TextEncoderSpec
from ..blocks import BlockLayout
from ..encoders import clip
from ..loading import META_CONFIGS, META_FAMILY
from ..saving import _save_weights, atomic_dir, clean_config, with_kind
from .effnet import EfficientNetEncoder
from .full_training import CascadeFullTraining
from .loading import EFFNET_FILE, EFFNET_FOLDER, NAME, detect, is_prior_folder, load_cascade
from .model import CLIP_IMAGE_WIDTH, PRIOR, diffusers_to_stability, module_to_stability, prior_factory
from .objective import CascadeObjective, cascade_objective, cascade_problems
from .options import CascadeOptions
from .tiny import CascadeTiny

IMPLEMENTATION = "https://github.com/Stability-AI/StableCascade"
TE_SPEC = TextEncoderSpec("text_encoders.clip_g.transformer.", "clip", True, "!",
                          "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k", "clip_g")  # fmt: skip
SCRIPTS = {"network": "stable_cascade_train_c_network.py", "fine_tune": "stable_cascade_train_stage_c.py",
           "dreambooth": "stable_cascade_train_stage_c.py"}  # fmt: skip
TARGETS = TargetClasses(
    transformer=("Linear", "Conv2d"),  # every Linear and 1x1 conv: the branch's networks.lora for StageC
    attention=("SDCascadeAttnBlock",),
    text_encoder={"*": ("CLIPAttention", "CLIPMLP")},
    text_encoder_attention={"*": ("CLIPAttention",)},
)
_RE_BLOCK = re.compile(r"lora_unet_(down|up)_blocks_(\d+)_")


@dataclass(frozen=True)
class CascadeBlocks(BlockLayout):
    """Index = the level: the down levels 0 .. L-1, then the up levels L .. 2L-1; the mappers have none."""

    def names_match(self, name: str) -> bool:
        return bool(_RE_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _RE_BLOCK.match(name)
        if not m:
            return -1
        level = int(m.group(2))
        return level if m.group(1) == "down" else self.num_blocks // 2 + level


def _spec() -> FamilySpec:
    return FamilySpec(
        name=NAME, title="Stable Cascade stage C", text_encoders=(TE_SPEC,), configs={},
        pipeline_class="StableCascadePriorPipeline", training_script="stable_cascade_train_c_network.py",
        scripts=SCRIPTS, load_hint="stable_cascade_train_c_network.py (with --text_model_checkpoint_path and "
        "--effnet_checkpoint_path beside stage_c.safetensors)", detect=detect, detect_folder=is_prior_folder,
        group="Stable Cascade", block_swap=False,
    )  # fmt: skip


def options_of(parts: Parts) -> CascadeOptions:
    return parts.options if isinstance(parts.options, CascadeOptions) else CascadeOptions()


class StableCascadeFamily:
    """Stable Cascade stage C (module docstring; ``library.families.protocol.ModelFamily``)."""

    name = NAME
    vae_scale = 1.0  # the EfficientNet latents are used as they come (normalised by the mapper's BatchNorm)
    size_multiple = 32
    latent_downscale = 32  # EfficientNetV2-S: 1/32 of the image
    num_text_encoders = 1
    ss_v2 = False
    adapter_prefixes = ("lora_unet", "lora_te")
    blocks = CascadeBlocks("stable_cascade", 4, 0, 0, 0)
    denoiser_name = "prior"
    partial_text_cache = None
    fp8_skip = ()
    target_classes = TARGETS
    options = CascadeOptions
    # read for sample previews, not by the load (library/run/load_memory.py)
    options_read_later = ("previewer_checkpoint_path",)
    full_training = CascadeFullTraining()
    adapter_rules = MappingProxyType({})
    ti_embedding_keys = (TE_SPEC.ti_key,)

    def __init__(self) -> None:
        self.spec = _spec()
        self.tiny = CascadeTiny(self)

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # ------------------------------------------------------------------------------------------- files
    def load(self, path: str | Path, *, dtype: torch.dtype | PartDtypes = torch.float32, vae: str | Path | None = None,
             v_parameterization: bool | None = None, tokenizer_cache_dir: str | None = None, device: Any = "cpu",
             options: CascadeOptions | None = None) -> Parts:  # fmt: skip
        """Stage C + ``--text_model_checkpoint_path`` + ``--effnet_checkpoint_path`` (or ``vae``), or a folder."""
        options = options or CascadeOptions()
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to Stable Cascade: stage C predicts ε")
        parts = load_cascade(path, dtype=dtype, device=device, effnet=options.effnet_checkpoint_path or vae,
                             text_model=options.text_model_checkpoint_path, save_text_model=options.save_text_model,
                             tokenizer_cache_dir=tokenizer_cache_dir, tiny=self.tiny.part_configs())  # fmt: skip
        parts.options = options
        return parts

    def save(self, parts: Parts, path: str | Path, *, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None, safetensors: bool = True) -> Path:  # fmt: skip
        """``*.safetensors``: stage C under Stability's names (the text model and EfficientNet stay the user's
        files); a pickle suffix is refused; any other path: a diffusers ``StableCascadePriorPipeline`` folder."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".ckpt", ".pt", ".pth", ".bin"):
            raise ValueError(f"{path}: Stable Cascade models are saved as .safetensors or a diffusers folder")
        if suffix == ".safetensors":
            state = diffusers_to_stability(parts.denoiser.state_dict())
            meta = {META_FAMILY: self.name, META_CONFIGS: json.dumps(model_configs(parts)), **self._modelspec(path.stem),
                    **(metadata or {})}  # fmt: skip
            return save_state_dict(state, path, meta, dtype)
        suffix = ".safetensors" if safetensors else ".bin"
        with atomic_dir(path) as tmp:
            self.prior_pipeline(parts).save_config(tmp)
            parts.denoiser.save_config(tmp / "prior")
            _save_weights(parts.denoiser.state_dict(), tmp / "prior" / ("diffusion_pytorch_model" + suffix), dtype)
            encoder = parts.text_encoders[0]
            encoder.config.save_pretrained(tmp / "text_encoder")
            _save_weights(encoder.state_dict(), tmp / "text_encoder" / (("model" if safetensors else "pytorch_model")
                                                                        + suffix), dtype)  # fmt: skip
            parts.tokenizers[0].save_pretrained(tmp / "tokenizer")
            self._scheduler(parts).save_pretrained(tmp / "scheduler")
            if isinstance(
                parts.vae, EfficientNetEncoder
            ):  # ours beside the pipeline's parts (diffusers' prior folders have none)
                (tmp / EFFNET_FOLDER).mkdir()
                save_state_dict(parts.vae.state_dict(), tmp / EFFNET_FOLDER / EFFNET_FILE, {}, dtype)
        return path

    def save_text_model(self, parts: Parts, path: Path, dtype: torch.dtype | None) -> Path:
        """The text encoder under transformers names at ``<stem>_text_model.safetensors`` (the branch's layout)."""
        target = path.with_name(path.stem + "_text_model.safetensors")
        return save_state_dict(parts.text_encoders[0].state_dict(), target, {}, dtype)

    def _modelspec(self, title: str) -> dict[str, str]:
        from library.files.metadata import modelspec

        return modelspec(architecture=self.modelspec_architecture(), implementation=IMPLEMENTATION, title=title,
                         resolution=self.default_resolution())  # fmt: skip

    def reference_parts(self) -> Parts:
        """The released 3.6B stage C and CLIP-bigG on the meta device; ``vae`` None."""
        from accelerate import init_empty_weights

        from .model import CLIP_BIG_G

        with init_empty_weights():
            denoiser = prior_factory(PRIOR)()
            encoder = clip.factory(CLIP_BIG_G, with_projection=True)()
        return Parts(denoiser, None, [encoder], [], {}, self.name)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """``[ids (B, 77)]`` padded to 77 (``--max_token_length`` is not read)."""
        ids, _ = clip.tokenize(parts.tokenizers[0], captions)
        return [ids]

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(CLIP-bigG's last hidden state (B, 77, 1280) before the final norm, its projected pooled output
        (B, 1280)): the branch's ``get_hidden_states_stable_cascade`` (no attention mask)."""
        encoder = parts.text_encoders[0]
        device = next(encoder.parameters()).device
        out = encoder(tokens[0].to(device), output_hidden_states=True, return_dict=True)
        return Cond(out.hidden_states[-1], out.text_embeds)

    def encode_prompt(self, parts: Parts, captions: list[str], clip_skip: int | None = None,
                      max_token_length: int | None = None) -> Cond:  # fmt: skip
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length), clip_skip)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        return self.encode_prompt(parts, captions)

    # ------------------------------------------------------------------------------------------- denoising
    def predict(self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *,
                time_ids: Tensor | None = None) -> Tensor:  # fmt: skip
        """ε (B, 16, h, w) at timestep ratios t (B,) in [0, 1], with the text states, the pooled output as one token
        and a zero CLIP image embedding (B, 1, 768)."""
        if time_ids is not None:
            raise ValueError("Stable Cascade takes no SDXL size/crop time_ids")
        b, dtype = noisy.shape[0], noisy.dtype
        ratio = t.to(noisy.device, dtype).reshape(-1).expand(b) if t.numel() == 1 else t.to(noisy.device, dtype)
        pooled = cond.pooled.to(noisy.device, dtype)
        pooled = pooled.unsqueeze(1) if pooled.ndim == 2 else pooled
        image = torch.zeros(b, 1, CLIP_IMAGE_WIDTH, device=noisy.device, dtype=dtype)
        return denoiser(noisy, ratio, clip_text_pooled=pooled, clip_text=cond.hidden_states.to(noisy.device, dtype),
                        clip_img=image, return_dict=False)[0]  # fmt: skip

    def objective(self, parts: Parts) -> str:
        return EPSILON

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: CascadeOptions) -> list[str]:
        return cascade_problems(noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> CascadeObjective:
        return cascade_objective(noise, loss)

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        return []

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Images in [-1, 1] (B, 3, H, W) -> (B, 16, H/32, W/32) through the EfficientNet encoder."""
        return parts.vae.encode(pixels)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        """With ``--previewer_checkpoint_path``: the Previewer's RGB preview (8x the latents' size) in [-1, 1]."""
        path = options_of(parts).previewer_checkpoint_path
        if path:
            from .previewer import load_previewer, preview

            return preview(load_previewer(path, latents.device), latents) * 2 - 1
        raise ValueError("stage C latents have no decoder of their own: images come from stage B and A "
                         "(stable_cascade_gen_img.py with the decoder)")  # fmt: skip

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: stage C under Stability's / ComfyUI's module paths; ``lora_te``: CLIP-bigG."""
        return [Root("lora_unet", parts.denoiser, module_to_stability), Root("lora_te", parts.text_encoders[0], str)]

    def base_model_version(self, prediction_type: str = EPSILON) -> str:
        return "stable_cascade"

    def modelspec_architecture(self, kind: str = "", prediction_type: str = EPSILON) -> str:
        return with_kind("stable-cascade-v1-prior", kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def _scheduler(self, parts: Parts) -> Any:
        from diffusers import DDPMWuerstchenScheduler

        return DDPMWuerstchenScheduler()

    def prior_pipeline(self, parts: Parts, scheduler: Any = None) -> Any:
        """``StableCascadePriorPipeline`` over ``parts`` (the same modules): stage C latents, not images."""
        from diffusers import StableCascadePriorPipeline

        return StableCascadePriorPipeline(tokenizer=parts.tokenizers[0] if parts.tokenizers else None,
                                          text_encoder=parts.text_encoders[0], prior=parts.denoiser,
                                          scheduler=scheduler or self._scheduler(parts))  # fmt: skip

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        """The shared samplers' pipeline: with ``--previewer_checkpoint_path`` stage C's own sampler (``scheduler``
        unused), whose latents :meth:`decode_latents` previews; refused otherwise (images need stage B / A)."""
        if options_of(parts).previewer_checkpoint_path:
            from .sampling import StageCPipeline

            return StageCPipeline(self, parts.denoiser)
        raise ValueError("Stable Cascade images need stage B / A after stage C: generate with "
                         "stable_cascade_gen_img.py --decoder <a diffusers StableCascadeDecoderPipeline folder>")  # fmt: skip

    def flow_sampling(self, parts: Parts) -> None:
        return None

    def default_resolution(self, prediction_type: str = EPSILON) -> int:
        return 1024


def model_configs(parts: Parts) -> dict[str, Any]:
    return {"family": parts.family, "prior": clean_config(parts.denoiser.config),
            "text_encoder": clean_config(parts.text_encoders[0].config.to_dict()) if parts.text_encoders else None}  # fmt: skip


STABLE_CASCADE = StableCascadeFamily()
