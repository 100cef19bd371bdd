"""The model-family protocol: what every family provides (``ModelFamily``) and its tiny model (``TinyModel``).

A family (``library.families.sd.SD1``, ``flux.FLUX_DEV`` ... or one a plug-in registers) is one small object that
holds everything that differs between architectures; code outside ``library/families/`` uses only these members and
the containers of ``base.py`` (``Parts``, ``Cond``, ``FamilySpec`` ...). ``tests/test_family_contract.py`` checks every
registered family against this list, signatures included.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from library.objectives.base import Objective
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from .adapters import AdapterRules
from .base import (
    BlockList,
    Cond,
    FamilyOptions,
    FamilySpec,
    FlowSampling,
    Parts,
    Root,
    TargetClasses,
)
from .blocks import BlockLayout
from .full_training import FullTraining


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
        """The objective a training step asks (:class:`library.objectives.base.Objective`, named :meth:`objective`):
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
