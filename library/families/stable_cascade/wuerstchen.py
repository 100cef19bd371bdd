"""Würstchen 2 (``WUERSTCHEN``, "wuerstchen"): Stable Cascade's predecessor, the second variant of this folder.

The prior (diffusers ``WuerstchenPrior``: ``projection`` 1x1 conv, ``cond_mapper``, a flat ``blocks`` list of
ResBlock / TimestepBlock / AttnBlock, ``out``) denoises the same 16-channel EfficientNetV2-S latents as stage C
(``effnet.py``; Würstchen 2's encoder has an affine mapper BatchNorm, as ``model_v2_stage_b.pt``'s
``effnet_state_dict`` and sd-scripts' wuerstchen branch), scaled as ``(x + 1) / 42`` (the branch, OneTrainer, and
the prior pipeline's ``latent_mean`` 42 / ``latent_std`` 1 undo it), conditioned on CLIP-bigG's last hidden state
after its final norm with the attention mask (``CLIPTextModel.last_hidden_state``, no pooled output).

Objective (OneTrainer's ``BaseWuerstchenSetup.predict`` for ``WUERSTCHEN_2``): t = clamp(1.08 (1 − u) + 0.001, 0.001,
1), u ~ U[0, 1); ᾱ(t) the cosine of ``objective.alpha_cumprod`` (``DDPMWuerstchenScheduler``); noisy = sqrt(ᾱ) x0 +
sqrt(1 − ᾱ) ε; the prior reads t itself; the loss is the plain mean squared error against ε (no P2 weight: both
OneTrainer and the branch's ``wuerstchen_train.py``).

Files: a diffusers ``WuerstchenPriorPipeline`` folder (warp-ai/wuerstchen-prior: ``prior/``, ``text_encoder/``,
``tokenizer/``, ``scheduler/``) with ``--effnet_checkpoint_path`` (or the ``effnet/`` sdtrain writes beside them);
saves are folders of that layout. Adapter names: ``lora_unet_`` + the diffusers module path of every Linear and 1x1
convolution of the prior; ``lora_te_`` for the text model.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from library.objectives.base import Example
from library.objectives.losses import LossConfig, check_shapes, weighted_loss_per_sample
from library.objectives.noising import NoiseConfig, draw_device, make_noise

from ..base import EPSILON, Cond, FamilySpec, PartDtypes, Parts, Root, TargetClasses, TextEncoderSpec
from ..blocks import BlockLayout
from ..convert import hf_state_dict
from ..encoders import clip
from ..loading import META_FAMILY, _tf_dtype, instantiate
from ..options import add_once
from ..saving import _save_weights, atomic_dir
from ..tokenizers import PAD_OPEN_CLIP, load_clip_tokenizer
from .effnet import EfficientNetEncoder, tiny_stages
from .family import StableCascadeFamily
from .loading import EFFNET_FILE, EFFNET_FOLDER, effnet_stages, read_effnet
from .objective import T_MIN, CascadeObjective, alpha_cumprod, cascade_problems
from .options import CascadeOptions
from .wuerstchen_decoder import DECODER_GUIDANCE, DECODER_STEPS, decoder_problems, sample_size_problems

NAME = "wuerstchen"
PIPELINE = "WuerstchenPriorPipeline"
LATENT_MEAN, LATENT_STD = 42.0, 1.0  # latents / 42 + 1 / 42: the pipeline's `latents * 42 - 1` undone
T_SCALE = 1.08
PRIOR = dict(c_in=16, c=1536, c_cond=1280, c_r=64, depth=32, nhead=24, dropout=0.1)  # warp-ai/wuerstchen-prior
TINY_PRIOR = dict(c_in=16, c=32, c_cond=48, c_r=64, depth=2, nhead=2, dropout=0.1)
IMPLEMENTATION = "https://github.com/dome272/Wuerstchen"
DECODER_DEFAULTS = (DECODER_STEPS, DECODER_GUIDANCE)
TE_SPEC = TextEncoderSpec("text_encoders.clip_g.transformer.", "clip", False, "!",
                          "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k", "clip_g")  # fmt: skip
SCRIPTS = {"network": "wuerstchen_train_network.py", "fine_tune": "wuerstchen_train.py",
           "dreambooth": "wuerstchen_train.py"}  # fmt: skip
TARGETS = TargetClasses(
    transformer=("Linear", "Conv2d"),
    attention=("AttnBlock",),
    text_encoder={"*": ("CLIPAttention", "CLIPMLP")},
    text_encoder_attention={"*": ("CLIPAttention",)},
)
_RE_BLOCK = re.compile(r"lora_unet_blocks_(\d+)_")


def prior_class() -> type[nn.Module]:
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior

    return WuerstchenPrior


def is_prior_folder(folder: Path) -> bool:
    index = Path(folder) / "model_index.json"
    return index.is_file() and json.loads(index.read_text()).get("_class_name") == PIPELINE


def detect(state: Mapping[str, Any], metadata: Mapping[str, str]) -> bool:
    return metadata.get(META_FAMILY) == NAME


@dataclass(frozen=True)
class WuerstchenBlocks(BlockLayout):
    """Index = the position in the prior's flat ``blocks`` list (no down / up halves)."""

    def names_match(self, name: str) -> bool:
        return bool(_RE_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _RE_BLOCK.match(name)
        return int(m.group(1)) if m else -1


# --------------------------------------------------------------------------------------------------- objective
def draw_times(batch: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """t = clamp(1.08 (1 − u) + 0.001, 0.001, 1) (B,) float32, u ~ U[0, 1) (OneTrainer's Würstchen 2 draw)."""
    u = torch.rand((batch,), generator=generator, device=draw_device(generator, device))
    return (1 - u).mul(T_SCALE).add(T_MIN).clamp(T_MIN, 1.0).to(device)


@dataclass(frozen=True, eq=False)
class WuerstchenObjective(CascadeObjective):
    """Würstchen 2's objective (module docstring); ``Example.timesteps`` is t, ``Example.sigmas`` ᾱ(t)."""

    def example(self, latents: Tensor, generator: torch.Generator | None = None, *,
                timesteps: Tensor | None = None) -> Example:  # fmt: skip
        noise = make_noise(self.noise, latents, generator)
        b = latents.shape[0]
        t = draw_times(b, generator, latents.device) if timesteps is None else timesteps.to(latents.device).float()
        alpha = alpha_cumprod(t.to(torch.float32)).view(b, 1, 1, 1)
        noisy = (alpha.sqrt() * latents.float() + (1 - alpha).sqrt() * noise).to(latents.dtype)
        return Example(noisy, noise, t, noise, alpha.view(b))

    def loss_per_sample(self, pred: Tensor, example: Example, *, loss_weights: Tensor | None = None,
                        mask: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
        """``--loss_type`` l2 / l1 with the mask and prior weights, no timestep weight (OneTrainer, the branch)."""
        target = example.target.to(pred.device)
        check_shapes(pred, target, example.timesteps)
        return weighted_loss_per_sample(pred, target, self.loss, loss_weights=loss_weights, mask=mask,
                                        generator=generator)  # fmt: skip

    def metadata(self) -> dict[str, Any]:
        return {"ss_noise_schedule": "cosine_continuous", "ss_timestep_scale": str(T_SCALE)}

    def to(self, device: torch.device | str) -> WuerstchenObjective:
        return dataclasses.replace(self)


def wuerstchen_problems(noise: NoiseConfig, loss: LossConfig) -> list[str]:
    problems = [p.replace("Stable Cascade", "Würstchen 2") for p in cascade_problems(noise, loss)]
    if loss.loss_type in ("huber", "smooth_l1"):
        problems.append(f"--loss_type {loss.loss_type} is not supported for Würstchen 2 (its objective is the plain "
                        "mean squared error of OneTrainer and the wuerstchen branch); use l2 or l1")  # fmt: skip
    return [p.replace("GDF's P2 weight 1 / (1 + SNR)", "OneTrainer's unweighted loss") for p in problems]


# --------------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class WuerstchenOptions(CascadeOptions):
    """The folder's flags (``options.py``) read for Würstchen 2: the text model comes from the folder; training adds
    ``--decoder`` (a ``WuerstchenDecoderPipeline`` folder: what the samples during training need) and its steps and
    guidance (``wuerstchen_decoder.py``)."""

    decoder: str | None = None
    decoder_steps: int = DECODER_STEPS
    decoder_guidance_scale: float = DECODER_GUIDANCE

    @classmethod
    def add_args(cls, parser: Any, *, training: bool) -> Any:
        super().add_args(parser, training=training)
        if training:
            g = parser.add_argument_group("Würstchen 2 decoder", "samples during training (--sample_prompts)")
            add_once(g, parser, "--decoder", type=str, default=None,
                     help="a diffusers WuerstchenDecoderPipeline folder (warp-ai/wuerstchen): turns the prior's "
                          "latents into the sample images")  # fmt: skip
            add_once(g, parser, "--decoder_steps", type=int, default=DECODER_STEPS,
                     help=f"the decoder's steps (default {DECODER_STEPS}, diffusers')")  # fmt: skip
            add_once(g, parser, "--decoder_guidance_scale", type=float, default=DECODER_GUIDANCE,
                     help="the decoder's classifier-free guidance (default 0: none, diffusers')")  # fmt: skip
        return parser

    @classmethod
    def from_args(cls, args: Any, *, training: bool) -> CascadeOptions:
        """The folder's checks, their messages naming Würstchen 2, and ``--decoder``'s (samples need it)."""
        from library.cli.parse import from_namespace, positive_count_problems
        from library.cli.problems import ConfigError

        own = []
        if getattr(args, "previewer_checkpoint_path", None):
            own.append("--previewer_checkpoint_path is not supported for Würstchen 2: Stability's previewer reads "
                       "Stable Cascade stage C latents; drop the flag (samples: --decoder)")  # fmt: skip
        decoder = getattr(args, "decoder", None)
        steps = getattr(args, "decoder_steps", DECODER_STEPS)
        if not decoder and (steps, getattr(args, "decoder_guidance_scale", DECODER_GUIDANCE)) != DECODER_DEFAULTS:
            own.append("--decoder_steps / --decoder_guidance_scale set the --decoder of the samples during training; "
                       "give --decoder or drop them")  # fmt: skip
        if decoder and not getattr(args, "sample_prompts", None):
            own.append("--decoder is read by the samples during training only; give --sample_prompts (with "
                       "--sample_every_n_steps / _epochs or --sample_at_first) or drop it")  # fmt: skip
        if decoder:
            own += decoder_problems(decoder) or sample_size_problems(decoder, getattr(args, "sample_prompts", None))
            own += positive_count_problems(args, ("decoder_steps",))
        try:
            options = super().from_args(args, training=training)
        except ConfigError as e:
            sample = ("--sample_prompts needs --decoder for Würstchen 2 training: a diffusers WuerstchenDecoderPipeline "
                      "folder (warp-ai/wuerstchen) turns the prior's latents into the sample images")  # fmt: skip
            lines = [p.replace("Stable Cascade", "Würstchen 2") for p in e.problems
                     if not p.startswith("--sample_prompts")]  # fmt: skip
            if not decoder and any(p.startswith("--sample_prompts") for p in e.problems):
                lines.append(sample)
            if own or lines:
                raise ConfigError(own + lines) from None
            options = from_namespace(cls, args)
        if own:
            raise ConfigError(own)
        return options

    def prompt_identity(self) -> str:
        return "encoder=clip_bigG_last_normed_masked"

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        problems = []
        if spec.name != NAME:
            problems.append(f"--pretrained_model_name_or_path {path}: a {spec.title} model; the Würstchen scripts "
                            "train a Würstchen 2 prior (a diffusers WuerstchenPriorPipeline folder)")  # fmt: skip
        if self.text_model_checkpoint_path or self.save_text_model:
            problems.append("--text_model_checkpoint_path / --save_text_model: Würstchen 2's text model is the "
                            "prior folder's text_encoder/; drop the flags")  # fmt: skip
        return problems


def prior_flag(parser: Any) -> Any:
    """The wuerstchen branch's ``--pretrained_prior_model_name_or_path`` as a second name of
    ``--pretrained_model_name_or_path``."""
    action = parser._option_string_actions["--pretrained_model_name_or_path"]
    if "--pretrained_prior_model_name_or_path" not in parser._option_string_actions:
        action.option_strings.append("--pretrained_prior_model_name_or_path")
        parser._option_string_actions["--pretrained_prior_model_name_or_path"] = action
    return parser


# --------------------------------------------------------------------------------------------------- the family
def read_encoder(path: Path, dtype: Any, device: Any) -> nn.Module:
    """``--effnet_checkpoint_path``: a safetensors encoder (``loading.read_effnet``), or the wuerstchen branch's
    ``model_v2_stage_b.pt``, whose ``effnet_state_dict`` entry is the encoder (read with ``weights_only=True``)."""
    if path.suffix.lower() not in (".pt", ".pth", ".ckpt", ".bin"):
        return read_effnet(path, dtype, device)
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"--effnet_checkpoint_path {path}: could not be read with weights_only=True ({e}); save its "
                         "effnet_state_dict once as a .safetensors and pass that") from e  # fmt: skip
    state = obj.get("effnet_state_dict", obj) if isinstance(obj, dict) else {}
    if "backbone.0.0.weight" not in state or "mapper.0.weight" not in state:
        raise ValueError(f"--effnet_checkpoint_path {path}: no EfficientNet encoder (effnet_state_dict with "
                         "backbone.*, mapper.*)")  # fmt: skip
    stages, head, latent = effnet_stages(state)
    affine = "mapper.1.weight" in state
    return instantiate(lambda: EfficientNetEncoder(latent, stages, head, affine), state, "EfficientNet encoder", path,
                       "EfficientNetV2-S", dtype, device=device)  # fmt: skip


def load_wuerstchen(path: str | Path, *, dtype: Any = torch.float32, device: Any = "cpu",
                    effnet: str | Path | None = None) -> Parts:  # fmt: skip
    """Frozen parts of a ``WuerstchenPriorPipeline`` folder; ``vae`` is the EfficientNet encoder (``effnet`` or the
    folder's ``effnet/``; None without either: generation only)."""
    from transformers import CLIPTextModel, CLIPTokenizer

    folder = Path(path)
    if not is_prior_folder(folder):
        raise ValueError(f"--pretrained_model_name_or_path {folder}: not a diffusers Würstchen 2 prior folder (no "
                         "model_index.json of WuerstchenPriorPipeline: prior/, text_encoder/, tokenizer/, scheduler/, "
                         "as warp-ai/wuerstchen-prior)")  # fmt: skip
    dtypes = PartDtypes.of(dtype)
    prior = prior_class().from_pretrained(folder / "prior", torch_dtype=dtypes.denoiser)
    encoder = CLIPTextModel.from_pretrained(folder / "text_encoder", **_tf_dtype(dtypes.text_encoders))
    if (folder / "tokenizer" / "tokenizer_config.json").is_file():
        tokenizer = CLIPTokenizer.from_pretrained(str(folder / "tokenizer"))
    else:
        tokenizer = load_clip_tokenizer(PAD_OPEN_CLIP)
    if effnet is None and (folder / EFFNET_FOLDER / EFFNET_FILE).is_file():
        effnet = folder / EFFNET_FOLDER / EFFNET_FILE
    effnet_module = read_encoder(Path(effnet), dtypes.vae, device) if effnet is not None else None
    for module in (prior, effnet_module, encoder):
        if module is not None:
            module.to(device).eval().requires_grad_(False)
    return Parts(prior, effnet_module, [encoder], [tokenizer], {"scaler": 1.0, "s": 0.008}, NAME, str(folder),
                 text_encoder_extras=[{}])  # fmt: skip


def build_tiny(seed: int = 0) -> Parts:
    """A tiny Würstchen 2 (fp32, CPU, eval, frozen): the prior of ``TINY_PRIOR`` (zero-initialised weights drawn too),
    the shared tiny CLIP-G without projection, the tiny EfficientNet with the affine mapper BatchNorm."""
    torch.manual_seed(seed)
    prior = prior_class()(**TINY_PRIOR)
    for p in prior.parameters():
        if p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():  # the output is (x − a) / |1 − b|: keep b small, as trained priors do
        prior.out[1].weight.normal_(0, 0.01)
        prior.out[1].bias.zero_()
    encoder = clip.factory(dict(clip.TINY_COMMON, **clip.TINY_CLIP_G))()
    effnet = EfficientNetEncoder(16, tiny_stages(), 32, affine=True)
    with torch.no_grad():
        for m in effnet.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    for module in (prior, effnet, encoder):
        module.eval().requires_grad_(False)
    return Parts(prior, effnet, [encoder], [load_clip_tokenizer(PAD_OPEN_CLIP)], {"scaler": 1.0, "s": 0.008}, NAME,
                 "tiny-wuerstchen", text_encoder_extras=[{}])  # fmt: skip


class WuerstchenTiny:
    """The tiny model (``protocol.TinyModel``): a prior folder with the encoder in ``effnet/``."""

    by_default = False

    def __init__(self, family: Any) -> None:
        self.family = family

    def build(self, seed: int = 0) -> Parts:
        return build_tiny(seed)

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """``--effnet_checkpoint_path`` (the folder holds the rest) and a tiny ``--decoder`` folder."""
        from library.files.weights import save_state_dict

        from .wuerstchen_decoder import write_tiny_decoder

        Path(out).mkdir(parents=True, exist_ok=True)
        return {"effnet": save_state_dict(parts.vae.state_dict(), Path(out) / f"{name}_effnet.safetensors", {}, None),
                "decoder": write_tiny_decoder(Path(out) / f"{name}_decoder")}  # fmt: skip

    def add_tool_args(self, parser: Any) -> None:
        return None

    def tool_options(self, args: Any) -> dict[str, Any]:
        return {}

    def part_configs(self) -> dict[str, Any]:
        return {"prior": dict(TINY_PRIOR), "text_encoder": dict(clip.TINY_COMMON, **clip.TINY_CLIP_G)}


class WuerstchenFamily(StableCascadeFamily):
    """Würstchen 2 (module docstring): stage C's family with its own prior, text states, latents and objective."""

    name = NAME
    blocks = WuerstchenBlocks(NAME, 0, 0, 0, 0)
    target_classes = TARGETS
    options = WuerstchenOptions

    def __init__(self) -> None:
        self.spec = FamilySpec(
            name=NAME, title="Würstchen 2", text_encoders=(TE_SPEC,), configs={}, pipeline_class=PIPELINE,
            training_script=SCRIPTS["network"], scripts=SCRIPTS, load_hint="wuerstchen_train_network.py (a "
            "WuerstchenPriorPipeline folder with --effnet_checkpoint_path)", detect=detect,
            detect_folder=is_prior_folder, group="Stable Cascade", block_swap=False,
        )  # fmt: skip
        self.tiny = WuerstchenTiny(self)

    def load(self, path: str | Path, *, dtype: torch.dtype | PartDtypes = torch.float32, vae: str | Path | None = None,
             v_parameterization: bool | None = None, tokenizer_cache_dir: str | None = None, device: Any = "cpu",
             options: CascadeOptions | None = None) -> Parts:  # fmt: skip
        options = options or WuerstchenOptions()
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to Würstchen 2: the prior predicts ε")
        parts = load_wuerstchen(path, dtype=dtype, device=device, effnet=options.effnet_checkpoint_path or vae)
        parts.options = options
        return parts

    def save(self, parts: Parts, path: str | Path, *, dtype: torch.dtype | None = None,
             metadata: Mapping[str, str] | None = None, safetensors: bool = True) -> Path:  # fmt: skip
        """A ``WuerstchenPriorPipeline`` folder (``effnet/`` beside its parts); a file suffix is refused."""
        from library.files.weights import save_state_dict

        path = Path(path)
        if path.suffix.lower() in (".safetensors", ".ckpt", ".pt", ".pth", ".bin"):
            raise ValueError(f"{path}: Würstchen 2 models are saved as a diffusers folder (--save_model_as "
                             "diffusers_safetensors)")  # fmt: skip
        suffix = ".safetensors" if safetensors else ".bin"
        with atomic_dir(path) as tmp:
            self.prior_pipeline(parts).save_config(tmp)
            parts.denoiser.save_config(tmp / "prior")
            _save_weights(parts.denoiser.state_dict(), tmp / "prior" / ("diffusion_pytorch_model" + suffix), dtype)
            encoder = parts.text_encoders[0]
            encoder.config.save_pretrained(tmp / "text_encoder")
            name = ("model" if safetensors else "pytorch_model") + suffix
            _save_weights(hf_state_dict(encoder), tmp / "text_encoder" / name, dtype)  # text_model.*: as released
            parts.tokenizers[0].save_pretrained(tmp / "tokenizer")
            self._scheduler(parts).save_pretrained(tmp / "scheduler")
            if parts.vae is not None:
                (tmp / EFFNET_FOLDER).mkdir()
                save_state_dict(parts.vae.state_dict(), tmp / EFFNET_FOLDER / EFFNET_FILE, {}, dtype)
        return path

    def save_text_model(self, parts: Parts, path: Path, dtype: torch.dtype | None) -> Path:
        raise ValueError("Würstchen 2 keeps its text model in the saved folder's text_encoder/")

    def reference_parts(self) -> Parts:
        from accelerate import init_empty_weights

        from .model import CLIP_BIG_G

        with init_empty_weights():
            denoiser = prior_class()(**PRIOR)
            encoder = clip.factory(CLIP_BIG_G)()
        return Parts(denoiser, None, [encoder], [], {}, self.name)

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(CLIP-bigG's last hidden state after the final norm (B, 77, 1280), no pooled): the prior pipeline's
        ``text_encoder(ids, attention_mask).last_hidden_state``, the mask covering BOS .. the first EOS."""
        encoder = parts.text_encoders[0]
        device = next(encoder.parameters()).device
        ids = tokens[0].to(device)
        eos = encoder.config.eos_token_id
        first = (ids == eos).int().argmax(dim=1, keepdim=True)
        first = torch.where((ids == eos).any(dim=1, keepdim=True), first, torch.full_like(first, ids.shape[1] - 1))
        mask = (torch.arange(ids.shape[1], device=device)[None] <= first).long()
        return Cond(encoder(ids, attention_mask=mask, return_dict=True).last_hidden_state)

    def predict(self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *,
                time_ids: Tensor | None = None) -> Tensor:  # fmt: skip
        """ε (B, 16, h, w) at times t (B,) in [0, 1] from the text states: ``WuerstchenPrior(x, r, c)``."""
        if time_ids is not None:
            raise ValueError("Würstchen 2 takes no SDXL size/crop time_ids")
        b, dtype = noisy.shape[0], noisy.dtype
        r = t.to(noisy.device, dtype).reshape(-1).expand(b) if t.numel() == 1 else t.to(noisy.device, dtype)
        return denoiser(noisy, r, cond.hidden_states.to(noisy.device, dtype))

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: CascadeOptions) -> list[str]:
        return wuerstchen_problems(noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> WuerstchenObjective:
        return WuerstchenObjective(noise, loss)

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Images in [-1, 1] -> (EfficientNet latents + 1) / 42 (B, 16, H/32, W/32)."""
        return super().encode_latents(parts, pixels, generator).add(LATENT_STD).div(LATENT_MEAN)

    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the prior under diffusers' module paths; ``lora_te``: CLIP-bigG."""
        return [Root("lora_unet", parts.denoiser, str), Root("lora_te", parts.text_encoders[0], str)]

    def base_model_version(self, prediction_type: str = EPSILON) -> str:
        return NAME

    def modelspec_architecture(self, kind: str = "", prediction_type: str = EPSILON) -> str:
        from ..saving import with_kind

        return with_kind("wuerstchen-v2-prior", kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def prior_pipeline(self, parts: Parts, scheduler: Any = None) -> Any:
        """``WuerstchenPriorPipeline`` over ``parts``: its latents are ``x * 42 - 1`` of the prior's."""
        from diffusers import WuerstchenPriorPipeline

        return WuerstchenPriorPipeline(tokenizer=parts.tokenizers[0] if parts.tokenizers else None,
                                       text_encoder=parts.text_encoders[0], prior=parts.denoiser,
                                       scheduler=scheduler or self._scheduler(parts))  # fmt: skip

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        """The shared samplers' pipeline: with ``--decoder`` the prior's sampler, then the decoder
        (``wuerstchen_decoder.WuerstchenPipeline``; ``scheduler`` unused); refused otherwise."""
        options = parts.options if isinstance(parts.options, WuerstchenOptions) else WuerstchenOptions()
        if options.decoder:
            from .wuerstchen_decoder import WuerstchenPipeline

            return WuerstchenPipeline(self, parts.denoiser, options.decoder, options.decoder_steps,
                                      options.decoder_guidance_scale)  # fmt: skip
        raise ValueError("Würstchen 2 images need its decoder after the prior: generate with stable_cascade_gen_img.py "
                         "--decoder <a diffusers WuerstchenDecoderPipeline folder> (training's samples: --decoder)")  # fmt: skip


WUERSTCHEN = WuerstchenFamily()
