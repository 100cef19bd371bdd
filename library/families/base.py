"""What every model family provides, and the containers passed between the family and the rest of the toolkit.

A family (SD1, SD2, SDXL, FLUX.1 dev ...) is one small object that holds everything that differs between the architectures. Code
outside ``library/families/`` asks the family; it never tests ``is_sdxl`` or ``v2`` itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from library.objectives.base import EPSILON, FLOW_MATCHING, OBJECTIVES, V_PREDICTION, Objective
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from .blocks import BlockLayout
from .full_training import FullTraining
from .options import FamilyOptions

if TYPE_CHECKING:  # adapters.py builds on this module's containers
    from .adapters import AdapterRules

__all__ = ["EPSILON", "FLOW_MATCHING", "OBJECTIVES", "V_PREDICTION"]  # the objective names, for the families


@dataclass
class Parts:
    """The loaded modules of one Stable Diffusion model.

    ``text_encoders`` and ``tokenizers`` are lists: one entry for SD1/SD2, two for SDXL (CLIP-L, then OpenCLIP-bigG).
    ``scheduler_config`` is the noise schedule (diffusers scheduler config dict: betas, num_train_timesteps,
    prediction_type "epsilon" | "v_prediction", and ``rescale_betas_zero_snr: True`` for zero-terminal-SNR models).
    ``options``: the family's options the model was loaded with (``ModelFamily.options``, the defaults filled in:
    prompt lengths, masks, guidance, dropouts; None for a family without options of its own), read by the family's
    prompts, objective and files. ``text_encoder_extras``: per text encoder, OpenCLIP tensors of the source file that
    the HF model does not hold (SD2's 24th block, ``logit_scale``...), written back unchanged when the model is saved
    as a single file. ``token_expansions``: per tokenizer, {first token id: [all vector ids]} of the multi-vector
    textual-inversion tokens added to it (``library.text.textual_inversion``).
    """

    denoiser: nn.Module
    vae: nn.Module
    text_encoders: list[nn.Module]
    tokenizers: list[Any]
    scheduler_config: dict
    family: str
    source: str = ""
    options: FamilyOptions | None = None
    text_encoder_extras: list[dict] = field(default_factory=list)
    token_expansions: list[dict] = field(default_factory=list)

    @property
    def prediction_type(self) -> str:
        return self.scheduler_config.get("prediction_type", "epsilon")


@dataclass(frozen=True)
class PartDtypes:
    """The dtype each part is loaded in (``ModelFamily.load(dtype=...)`` takes one of these or one dtype for all).

    A training run loads what it trains in the training dtype and what stays frozen in the mixed-precision dtype,
    each straight from the file's values (never through a half-precision copy first)."""

    denoiser: torch.dtype = torch.float32
    vae: torch.dtype = torch.float32
    text_encoders: torch.dtype = torch.float32

    @classmethod
    def of(cls, dtype: torch.dtype | PartDtypes | None) -> PartDtypes:
        if isinstance(dtype, PartDtypes):
            return dtype
        dtype = dtype or torch.float32
        return cls(dtype, dtype, dtype)


@dataclass
class Cond:
    """Prompt conditioning for the UNet.

    ``hidden_states``: (B, 77, D) cross-attention context, or (B, 75·k + 2, D) for ``--max_token_length`` 150/225
    (k = 2 or 3 chunks of 75 tokens, laid out as sd-scripts does: BOS, the chunks' tokens, the last EOS/PAD).
    Unpadded (train_db.py's ``--no_token_padding``): (B, L, D), L = 2 + the batch's longest caption (at most 77).
    ``pooled``: (B, P) pooled text embedding (SDXL: the second encoder's projected pooled output), else None.
    ``mask``: (B, L) attention mask of ``hidden_states`` (1: a token, 0: padding; FLUX's T5 mask with
    ``--apply_t5_attn_mask``, always for Chroma), else None. :meth:`to` moves it but keeps its dtype.
    """

    hidden_states: Tensor
    pooled: Tensor | None = None
    mask: Tensor | None = None

    def to(self, *args, **kwargs) -> Cond:
        hidden = self.hidden_states.to(*args, **kwargs)
        pooled = self.pooled.to(*args, **kwargs) if self.pooled is not None else None
        mask = self.mask.to(hidden.device) if self.mask is not None else None
        return Cond(hidden, pooled, mask)


@dataclass(frozen=True)
class TextEncoderSpec:
    """How one text encoder of a family is stored and tokenized.

    ``prefix``: its key prefix in a single-file checkpoint. ``layout``: "clip" (HF names under ``text_model.``) or
    "open_clip" (OpenCLIP names, stacked in_proj). ``with_projection``: a ``CLIPTextModelWithProjection`` (SDXL TE2).
    ``pad_token``: "<|endoftext|>" (CLIP-L) or "!" (OpenCLIP). ``tokenizer_id``: the hub id sd-scripts loads, looked
    up as ``<--tokenizer_cache_dir>/<id with / replaced by _>``. ``final_block_after``: when the HF model has this many
    layers, single files get one more (dummy) OpenCLIP block (SD2: OpenCLIP-H has 24 blocks, SD uses 23).
    """

    prefix: str
    layout: str
    with_projection: bool
    pad_token: str
    tokenizer_id: str
    ti_key: str
    final_block_after: int | None = None


@dataclass(frozen=True)
class FamilySpec:
    """The data a family hands to the shared loading / saving code.

    ``configs``: prediction type -> shipped config file stem (``configs/<stem>.json``). ``guess_prediction``: a
    last-resort detector of the prediction type from single-file weights (returns None when it cannot tell).
    ``training_script``: the sd-scripts script that trains it (families with the same one are trained together,
    e.g. SD1 and SD2 by train_network.py). ``scripts``: the script for each training type ("network",
    "fine_tune", "dreambooth", "textual_inversion"), named when a script of that type is given another family's
    model (a type missing here names ``training_script``). ``load_hint``: how a user loads it, for "wrong family"
    errors.
    ``flag``: the sd-scripts flag that names it where tools take one (``--v1`` / ``--v2`` / ``--sdxl``), without
    the dashes. ``detect``: whether a single-file state dict (keys -> tensors, or objects with ``.shape``) and its
    metadata are this family's, for files without our ``sdtrain.family`` metadata; None: only that metadata tells.
    ``refuse``: for a single file no family detects, why it cannot be loaded when it is almost this family's (SDXL:
    "an SDXL refiner, which is not supported"), named in detection errors; else None.
    """

    name: str
    title: str
    text_encoders: tuple[TextEncoderSpec, ...]
    configs: Mapping[str, str]
    pipeline_class: str
    guess_prediction: Callable[[Mapping[str, Tensor]], str | None] | None = None
    training_script: str = "train_network.py"
    scripts: Mapping[str, str] = field(default_factory=dict)
    load_hint: str = ""
    flag: str = ""
    detect: Callable[[Mapping[str, Any], Mapping[str, str]], bool] | None = None
    detect_folder: Callable[[Path], bool] | None = None
    """Whether a diffusers folder is this family's model."""
    refuse: Callable[[Mapping[str, Any], Mapping[str, str]], str | None] | None = None
    group: str = ""
    """The name of the family group its training script trains, for messages that list groups ("FLUX" for
    FLUX.1 dev / schnell and Chroma); "" : the title."""
    block_swap: bool = False
    """Whether ``--blocks_to_swap`` applies (the denoiser has transformer block lists: ``ModelFamily.swap_blocks``)."""
    tool_flag: str = ""
    """The flag (without dashes) sd-scripts' model-agnostic tools take to name this family where ``flag`` is none
    (tools/cache_text_encoder_outputs.py's ``--flux``); accepted there, the family being read from the model."""

    @property
    def group_title(self) -> str:
        return self.group or self.title


@dataclass(frozen=True)
class FlowSampling:
    """How a flow-matching family samples (:meth:`ModelFamily.flow_sampling`; used by ``library/sampling/flow.py``).

    ``embedded_guidance``: the denoiser takes a guidance value (FLUX.1 dev's distilled guidance: ``predict(...,
    guidance=g)`` with a prompt's ``--g``); False for FLUX.1 schnell and Chroma (diffusers' Chroma fixes its guidance
    input at 0, what sd-scripts' docs require with ``--g 0``). ``shift``: the schedule gets FLUX's resolution-dependent
    shift μ = linear in the packed image sequence length, ``base_shift`` at 256 tokens and ``max_shift`` at 4096
    (FLUX.1 dev and Chroma); schnell samples unshifted (BFL's reference, diffusers' schnell scheduler config and
    sd-scripts' flux_minimal_inference.py). ``latent_channels``: channels of the latents ``predict`` takes (16 for
    FLUX's AE).

    ``static_shift``: a resolution-independent shift s instead (SD3 / SD3.5: 3.0, its scheduler config's ``shift``;
    needs ``shift=False``): the schedule of diffusers' ``FlowMatchEulerDiscreteScheduler`` without dynamic shifting
    and of sd-scripts' ``sd3_train_utils.get_all_sigmas`` (``flow.discrete_flow_sigmas``). ``packed_noise``: the
    initial noise is drawn per image in FLUX's packed 2x2 layout (sd-scripts' FLUX sampling); False: drawn as
    (1, C, h, w) per image (sd-scripts' SD3 ``do_sample``, diffusers' ``StableDiffusion3Pipeline``).
    ``default_steps`` / ``default_scale``: a sample prompt's steps / true-CFG scale when it sets none (sd-scripts'
    FLUX sampling 20 / 1.0 = no CFG; SD3 ``sample_image_inference`` 30 / 7.5). ``latent_downscale``: the VAE's
    spatial factor (8): the latents of an H x W image are H/f x W/f, and sample sizes are multiples of 2f (two
    latent patches).
    """

    embedded_guidance: bool
    shift: bool = True
    base_shift: float = 0.5
    max_shift: float = 1.15
    latent_channels: int = 16
    static_shift: float | None = None
    packed_noise: bool = True
    default_steps: int = 20
    default_scale: float = 1.0
    latent_downscale: int = 8

    def __post_init__(self) -> None:
        if self.static_shift is not None and (self.shift or self.static_shift <= 0):
            raise ValueError(
                f"FlowSampling: static_shift={self.static_shift} needs shift=False (a schedule has either FLUX's "
                f"resolution-dependent shift or a static one) and a positive value (got shift={self.shift})"
            )
        if self.default_steps < 1:
            raise ValueError(f"FlowSampling: default_steps must be >= 1, got {self.default_steps}")
        if self.latent_downscale < 1:
            raise ValueError(f"FlowSampling: latent_downscale must be >= 1, got {self.latent_downscale}")


@dataclass(frozen=True)
class Segment:
    """Rows ``[start:stop)`` (``stop`` None: to the end) of the weight of the Linear at ``path`` in an adapter root."""

    path: str
    start: int = 0
    stop: int | None = None


@dataclass(frozen=True)
class Fused:
    """One adapter module over several Linear leaves that take the same input, as the file's layout fuses them (FLUX's
    ``double_blocks.0.img_attn.qkv`` = diffusers' ``to_q | to_k | to_v``; ``single_blocks.0.linear1`` = ``to_q | to_k |
    to_v | proj_mlp``; ``final_layer.adaLN_modulation.1`` = ``norm_out.linear`` with its halves swapped).

    ``name``: the fused module's path in the file's layout (its kohya name is ``prefix + "_" + name`` with dots as
    underscores, and the rename is not applied to it). ``segments``: the fused weight's rows, in order; the adapter's
    ΔW is over the whole fused weight (exact for LoRA, LoHa, LoKr and DoRA), each leaf's output gets its rows of it.
    """

    name: str
    segments: tuple[Segment, ...]


class Root(NamedTuple):
    """One adaptable module tree of a model (see :meth:`ModelFamily.adapter_roots`).

    ``prefix``: the kohya prefix of its modules (``lora_unet``, ``lora_te1``...). ``module``: the tree. ``rename``:
    module path -> the path the file's layout names it by (the kohya name is ``prefix + "_" + rename(path)`` with dots
    as underscores; raises KeyError for paths it has no name for). ``fused``: modules of the file's layout that are
    several leaves here (empty for the UNet families).
    """

    prefix: str
    module: nn.Module
    rename: Callable[[str], str]
    fused: tuple[Fused, ...] = ()


class BlockList(NamedTuple):
    """One list of a denoiser's transformer blocks that ``--blocks_to_swap`` may keep on the host
    (:meth:`ModelFamily.swap_blocks`, library/run/block_swap.py).

    ``blocks``: the model's own ``nn.ModuleList`` (diffusers FLUX: ``transformer_blocks``, 19 double blocks, and
    ``single_transformer_blocks``, 38 single blocks). ``per_unit``: how many of these blocks one unit of
    ``--blocks_to_swap`` stands for in sd-scripts' split of N between the lists (FLUX: 1 double block, 2 single
    blocks: a double block weighs about two single blocks).
    """

    blocks: nn.ModuleList
    per_unit: int = 1


@dataclass(frozen=True)
class TargetClasses:
    """The module classes adapter presets select in this family's denoiser and text encoders (LyCORIS preset
    semantics: every Linear / Conv inside a module of a target class is adapted).

    ``transformer``: the attention/MLP blocks (sd-scripts' ``networks.lora`` default targets); ``conv_blocks``: the
    ResNet / resampling blocks (added with ``conv_dim``); ``attention``: attention modules only (``attn-only``);
    ``text_encoder``: per text-encoder prefix, or ``"*"`` for all of them; ``text_encoder_attention``: the same for
    the text encoders' attention modules only (``attn-only``).
    The built-in presets (``networks.targets.PRESETS``) are written in these groups, so a family's presets select its
    own classes; each text encoder gets the classes under its prefix (``"*"``: every prefix not named).
    """

    transformer: tuple[str, ...]
    conv_blocks: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    text_encoder: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    full_names: tuple[str, ...] = ()
    """Module paths the ``full`` presets add beyond the classes (SD's conv_in / conv_out / time embedding)."""
    text_encoder_attention: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@runtime_checkable
class TinyModel(Protocol):
    """A family's tiny model (``ModelFamily.tiny``): the released architecture's module layout, names and tokenizers
    with tiny widths and seeded random weights, built in well under a second, for the tests, ``--demo`` and
    ``tools/make_tiny_model.py`` (which asks every registered family's tiny model and never names a family)."""

    by_default: bool
    """Whether ``tools/make_tiny_model.py`` writes it when ``--family`` is not given."""

    def build(self, seed: int = 0, **options: Any) -> Parts:
        """The tiny model (fp32, CPU, eval mode, frozen) with weights drawn after ``torch.manual_seed(seed)``;
        ``options``: the family's own (what :meth:`tool_options` returns, e.g. block counts)."""
        ...

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        """``parts`` as the diffusers folder the demo and the tests train on; returns ``folder``."""
        ...

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """The files sd-scripts takes beside the model's single file ``<out>/<name>.safetensors``, written into
        ``out`` as ``<name>_<part>.safetensors`` (FLUX.1: ``clip_l``, ``t5xxl``, ``ae``); returns part -> path, {}
        when the single file is the whole model."""
        ...

    def add_tool_args(self, parser: argparse.ArgumentParser) -> None:
        """Add the tiny model's own flags to ``tools/make_tiny_model.py``'s parser. Families that share flags share
        this function object (a ``staticmethod``): the tool calls each distinct one once."""
        ...

    def tool_options(self, args: argparse.Namespace) -> dict[str, Any]:
        """:meth:`build`'s ``options`` from the tool's parsed flags (its flags' defaults included)."""
        ...


@runtime_checkable
class ModelFamily(Protocol):
    """What every family (``library.families.sd.SD1 / SD2 / SDXL``, ``library.families.flux.FLUX_DEV`` ..., or one
    registered with ``register_family``) provides. Families satisfy it by composition, with no shared base class;
    code outside ``library/families/`` uses only these members (tests/test_families.py checks each family against this list, signatures included).
    """

    name: str
    """Registry key and ``sdtrain.family`` metadata value: "sd1" | "sd2" | "sdxl"."""
    spec: FamilySpec
    """The data the shared loading / saving code reads (text encoders, shipped configs, pipeline class...)."""
    vae_scale: float
    """Latents = VAE sample times this (0.18215 for SD1/SD2, 0.13025 for SDXL)."""
    size_multiple: int
    """Image sides (buckets) are multiples of this (sd-scripts' ``bucket_reso_steps`` rule)."""
    num_text_encoders: int
    ti_embedding_keys: tuple[str, ...]
    """Textual-inversion file keys, one per text encoder (from ``spec.text_encoders[i].ti_key``)."""
    ss_v2: bool
    """What sd-scripts' ``ss_v2`` metadata says for this family (True for SD 2.x only)."""
    adapter_prefixes: tuple[str, ...]
    """The kohya prefixes of ``adapter_roots``, known without a model (which family an adapter file is for)."""
    blocks: BlockLayout
    """sd-scripts' UNet block numbering for ``block_dims`` / ``*_lr_weight`` of adapters on this family."""
    denoiser_name: str
    """What the denoiser (``Parts.denoiser``) is called in messages: "UNet" (a transformer for DiT families)."""
    partial_text_cache: tuple[int, ...] | None
    """Whether :meth:`cond_with_trained_encoders` can run, and which text encoders (indices into
    ``Parts.text_encoders``) it runs: text-encoder outputs may be cached while the encoders' adapters train, the
    frozen encoders' outputs read from the cache (FLUX.1: ``(0,)``, CLIP-L recomputed over the T5 cache, as
    sd-scripts; Chroma ``()``); None for SD / SDXL, whose every output comes from a trained encoder."""
    fp8_skip: tuple[str, ...]
    """``--fp8_base``: denoiser Linear / Conv2d layers whose module path contains one of these stay in the compute
    dtype (``library.device.fp8.store_in_fp8``'s ``skip``): ("norm",) for the SD UNets (diffusers' rule); () for FLUX, whose
    "norm" Linears are the adaLN modulations (3.2 B parameters, stored in float8 by sd-scripts too)."""
    target_classes: TargetClasses
    """The module classes adapter presets select in this family's denoiser and text encoders (``networks.targets``
    resolves the built-in presets through them)."""
    options: type[FamilyOptions]
    """The family's own flags and their reader (``library/families/options.py``; :class:`~.options.NoOptions` when
    every flag it reads is a shared one). The families one script trains share one options class."""
    full_training: FullTraining
    """Its full fine-tuning rules: its own flags, the trained parts and their learning rates, what stays frozen, how
    the trained model is written (``library/families/full_training.py``)."""
    tiny: TinyModel | None
    """The family's tiny model (:class:`TinyModel`); None for a family without one (the demo and
    ``tools/make_tiny_model.py`` cannot build it)."""
    adapter_rules: Mapping[str, AdapterRules]
    """sd-scripts' own network modules for this family (``"networks.lora_flux"``) -> their rules
    (``library.families.adapters.AdapterRules``); empty where only the generic modules (networks.lora...) apply."""

    def load(self, path: str | Path, **options: Any) -> Parts:
        """A diffusers folder or a single file -> frozen modules in eval mode (options: dtype (one dtype, or
        :class:`PartDtypes` per part), vae, v_parameterization, tokenizer_cache_dir, device: where each weight goes
        as it is read; ``options``: an instance of :attr:`options`, kept as ``Parts.options``)."""
        ...

    def save(self, parts: Parts, path: str | Path, **options: Any) -> Path:
        """The full model as a single file (``*.safetensors`` / ``*.ckpt``) or a diffusers folder (options: dtype,
        metadata, safetensors: the folder's weights as .safetensors, else .bin); returns the path written."""
        ...

    def reference_parts(self) -> Parts:
        """The released architecture (denoiser and text encoders from the shipped configs) on the meta device:
        module names and shapes without weights; ``vae`` is None."""
        ...

    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """One (B, 77·k) id tensor per text encoder (k = 1, 2, 3 for ``--max_token_length`` None/75, 150, 225)."""
        ...

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Ids from :meth:`tokenize` -> the conditioning the denoiser takes."""
        ...

    def encode_prompt(
        self, parts: Parts, captions: list[str], clip_skip: int | None = None, max_token_length: int | None = None
    ) -> Cond:
        """:meth:`tokenize` then :meth:`encode_tokens`."""
        ...

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> Tensor | None:
        """Per-sample size/crop conditioning for :meth:`predict` (``time_ids``), or None when the family has none."""
        ...

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        """``--cache_text_encoder_outputs`` while text-encoder adapters train (sd-scripts' partial cache): ``cached``
        with the outputs of the encoders adapters train recomputed from ``captions`` (with autograd). ValueError
        where every output comes from a trained encoder (``partial_text_cache`` None)."""
        ...

    def predict(self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, **options: Any) -> Tensor:
        """The denoiser's output for noisy latents at timesteps t (options: ``time_ids`` from
        :meth:`size_conditioning`); what it predicts is :meth:`objective`."""
        ...

    def objective(self, parts: Parts) -> str:
        """What the loaded model is trained to predict: one of :data:`OBJECTIVES` (the loss target follows it)."""
        ...

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: FamilyOptions) -> list[str]:
        """The run's noise / loss settings (and the family's own ``options``) this family's objective cannot train
        with, one line each, checked before anything loads."""
        ...

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> Objective:
        """The objective a training step asks (:class:`library.objectives.Objective`, named :meth:`objective`):
        timestep / σ draws, noisy input, target, prediction type and loss weighting from the run's noise and loss
        settings; ValueError for settings this family's objective cannot train with."""
        ...

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(B, 3, H, W) pixels in [-1, 1] -> scaled latents."""
        ...

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        """Scaled latents -> (B, 3, H, W) pixels in [-1, 1]."""
        ...

    def adapter_roots(self, parts: Parts) -> list[Root]:
        """One :class:`Root` (kohya prefix, module, rename, fused modules) per adaptable module tree, the denoiser
        first: how adapter keys name the modules."""
        ...

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        """The denoiser's block lists that ``--blocks_to_swap`` moves between host and device, in the order the
        forward runs them; [] for a denoiser without such lists (the SD UNets: sd-scripts swaps FLUX and SD3 only)."""
        ...

    def base_model_version(self, prediction_type: str = "epsilon") -> str:
        """``ss_base_model_version`` metadata."""
        ...

    def modelspec_architecture(self, kind: str = "", prediction_type: str = "epsilon") -> str:
        """``modelspec.architecture`` for a checkpoint (``kind`` "") or an adapter ("lora", "textual-inversion")."""
        ...

    def modelspec_implementation(self, kind: str = "") -> str:
        """``modelspec.implementation`` metadata."""
        ...

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        """A diffusers pipeline over ``parts`` (the same modules) with ``scheduler``, for sampling."""
        ...

    def flow_sampling(self, parts: Parts) -> FlowSampling | None:
        """How the loaded model samples when :meth:`objective` is "flow_matching" (embedded guidance, schedule shift);
        None for the DDPM families (SD1/SD2/SDXL sample with diffusers' schedulers)."""
        ...

    def default_resolution(self, prediction_type: str = "epsilon") -> int:
        """The native resolution of the released model with this prediction type (the training default without
        ``--resolution``, ``modelspec.resolution``, the sampling default)."""
        ...


def family_members() -> tuple[str, ...]:
    """The names of every :class:`ModelFamily` member (attributes, then methods), in declaration order."""
    methods = [k for k, v in vars(ModelFamily).items() if callable(v) and not k.startswith("_")]
    return (*ModelFamily.__annotations__, *methods)


def missing_members(family: object) -> list[str]:
    """The :class:`ModelFamily` members ``family`` lacks (empty: it satisfies the Protocol's member list)."""
    return [m for m in family_members() if not hasattr(family, m)]


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device
