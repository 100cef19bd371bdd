"""What every model family provides, and the containers passed between the family and the rest of the toolkit.

A family (SD1, SD2, SDXL, FLUX.1 dev ...) is one small object that holds everything that differs between the architectures. Code
outside ``library/families/`` asks the family; it never tests ``is_sdxl`` or ``v2`` itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from library.objectives.base import EPSILON, FLOW_MATCHING, OBJECTIVES, V_PREDICTION

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
class ProjectedGuidance:
    """Adaptive projected guidance (APG; Sadat et al. 2024, arXiv:2410.02416) as a flow family samples with it
    (``FlowSampling.apg``; the math is ``library/sampling/guidance.py``). Plain CFG at ``--l`` (with the guidance
    rescale ``rescale``) up to and including step ``start_step`` (``text_start_step`` for a prompt that
    ``renders_text``), APG after it: the guidance difference averaged with ``momentum``, its norm capped at
    ``norm_threshold``, its part parallel to the conditional prediction scaled by ``eta``, applied at ``scale``
    (not ``--l``), then rescaled by ``rescale_apg``. The defaults are sd-scripts' HunyuanImage 2.1 sampler's."""

    start_step: int = 5
    text_start_step: int = 38
    scale: float = 10.0
    eta: float = 0.0
    norm_threshold: float = 10.0
    momentum: float | None = -0.5
    rescale: float = 0.0
    rescale_apg: float = 0.0
    renders_text: Callable[[str], bool] | None = None
    """Whether a prompt asks for rendered text (its start step is then ``text_start_step``); None: never."""


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
    latent patches). ``cfg_trunc_ratio``: true CFG runs only while the model time 1 - σ is below it (None: at every
    step; a prompt's ``--ctr`` sets it); ``renorm_cfg``: the guided velocity's norm is capped at this times the
    conditional one (0: off; a prompt's ``--rcfg``): sd-scripts' Lumina 2 sampling (0.25 and 1.0).
    ``plain_negative``: negative prompts are encoded apart, by ``family.encode_prompt(parts, texts, negative=True)``
    (Lumina 2: without the system prompt, as sd-scripts).
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
    cfg_trunc_ratio: float | None = None
    renorm_cfg: float = 0.0
    plain_negative: bool = False
    linear_shift: bool = False
    """``static_shift`` applied to ``linspace(1, 0, steps + 1)`` (sd-scripts' HunyuanImage ``get_timesteps_sigmas``)
    instead of the discrete scheduler's grid (``flow.shifted_linear_sigmas``)."""
    apg: ProjectedGuidance | None = None
    """True CFG becomes adaptive projected guidance after its start step (:class:`ProjectedGuidance`)."""
    latent_patch: int = 2
    """The denoiser's patch side in latent pixels: sample sizes are multiples of ``latent_patch · latent_downscale``
    (2x2 patches: FLUX, SD3 ...; 1: HunyuanImage 2.1's 32x VAE, sizes in steps of 32)."""
    linear_grid: bool = False
    """With ``static_shift``: the levels are the shifted ``linspace(1, 1/steps, steps)`` (diffusers' ``ZImagePipeline``,
    musubi-tuner's Z-Image sampling) instead of SD3's discrete grid (``flow.linear_flow_sigmas``)."""

    def __post_init__(self) -> None:
        if self.static_shift is not None and (self.shift or self.static_shift <= 0):
            raise ValueError(
                f"FlowSampling: static_shift={self.static_shift} needs shift=False (a schedule has either FLUX's "
                f"resolution-dependent shift or a static one) and a positive value (got shift={self.shift})"
            )
        if self.linear_shift and self.static_shift is None:
            raise ValueError("FlowSampling: linear_shift=True needs a static_shift (the shift it applies)")
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


@dataclass(frozen=True)
class CachingMemoryFlag:
    """One of a family's own flags that lowers the device peak of a caching phase (a family's optional
    ``caching_memory_flags``: these, cheapest first; ``--plan_memory --vram``'s advice, library/measure/advice.py,
    tries them when that phase is over the card). Nothing is read from a family without the attribute."""

    flags: tuple[str, ...]  # what the command gets, e.g. ("--fp8_vl",)
    label: str  # the change in words, e.g. "Qwen2.5-VL in float8"
    phase: str  # the phase it lowers: "text caching" / "latent caching"
    step_slowdown: float | None  # the training step time it adds, a fraction (0.0: none), None: not known
    cost: str  # in words: what it costs outside the steps (the encoding slower / less exact), with its source
    planned: bool = True  # False: the planner cannot plan it (the advice names it when the phase stays over)


@runtime_checkable
class FamilyOptions(Protocol):
    """What a family's options object answers (the class is ``ModelFamily.options``; its ``add_args`` and
    ``from_args`` are classmethods; ``library/families/options.py`` has :class:`NoOptions` and the helpers)."""

    text_encoder_batch_size: int | None
    """Captions per text-encoder call while caching (None: the batch size)."""

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        """The family's flags (sd-scripts' names, types and defaults): its load flags; with ``training`` also its
        objective's flags and the training-only ones. A flag another family already added is left as it is."""
        ...

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> FamilyOptions:
        """The flags of :meth:`add_args` (absent ones keep their defaults); ``ConfigError`` listing every problem."""
        ...

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        """The options against the family read from the weights at ``path`` (its ``spec``: name, title ...), checked
        before anything loads."""
        ...

    def metadata(self) -> dict[str, Any]:
        """The family's ``ss_*`` keys of trained files, beyond the objective's."""
        ...

    def prompt_identity(self) -> str:
        """The settings that change the text encoders' outputs ("" when none), for the text-encoder-output cache."""
        ...


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


HOST_ONLY = "_sdtrain_host_only"


def keep_on_host(module: nn.Module) -> nn.Module:
    """Mark a part that computes where it is (the CPU) for the whole run: the run's placement
    (``library/device/placement.py``, ``library/run/setup.py``) never moves it to the accelerator (sd-scripts'
    ``--text_encoder_cpu``). Returns ``module``."""
    setattr(module, HOST_ONLY, True)
    return module


def stays_on_host(module: nn.Module) -> bool:
    """Whether :func:`keep_on_host` marked ``module``."""
    return bool(getattr(module, HOST_ONLY, False))
