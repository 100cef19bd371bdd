"""What a training run reads: the flags, every group's reader and every cross-check, into one frozen
:class:`TrainConfig` (:func:`read_config`; all problems reported together, before anything heavy happens).

The family's own flags are read by the family (``family.options``: its load flags, its objective's and the
training-only ones; ``library/families/options.py``), checked against the weights (``options.problems``) and its
objective (``family.objective_problems``). The set-up the config drives is ``library/run/setup.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from library import data
from library.cli.parse import from_namespace
from library.cli.problems import ConfigError, Problems
from library.families import default_families, flagged_family, get_family, select_family
from library.families.base import FamilyOptions
from library.families.options import NoOptions
from library.families.protocol import ModelFamily
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig
from library.optim import OptimConfig
from library.optim.optimizers import full_fp16_problem
from library.run import resume
from library.run.block_swap import BlockSwapConfig, swap_problems
from library.run.ema import EMAConfig
from library.run.memory_watch import WatchConfig
from library.run.method import MethodConfig, NothingTrained
from library.run.run_files import SaveConfig
from library.run.runtime import (
    RunConfig,
)
from library.run.trackers import TrackerConfig
from library.sampling import SampleConfig

logger = logging.getLogger("sdtrain")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument(
        "--pretrained_model_name_or_path",
        type=str,
        default=None,
        help="base model: a diffusers folder or a single-file checkpoint (.safetensors / .ckpt)",
    )
    g.add_argument("--v2", action="store_true", help="the base model is Stable Diffusion 2.x")
    g.add_argument("--v_parameterization", action="store_true", help="train with v-prediction (v-prediction models)")
    g.add_argument("--vae", type=str, default=None, help="replace the model's VAE (diffusers folder or VAE file)")
    g.add_argument("--tokenizer_cache_dir", type=str, default=None, help="folder with tokenizers (offline use)")
    g.add_argument(
        "--disable_mmap_load_safetensors",
        action="store_true",
        help="read model safetensors files into memory whole instead of memory-mapping them",
    )
    g.add_argument("--clip_skip", type=int, default=None, help="use the n-th last text-encoder layer (n >= 1)")
    g.add_argument(
        "--max_token_length", type=int, default=None, choices=[None, 150, 225], help="75 (default), 150 or 225 tokens"
    )
    g.add_argument("--no_half_vae", action="store_true", help="keep the VAE in fp32 under mixed precision")
    g.add_argument("--lowram", action="store_true", help="load each weight straight onto the GPU as it is read "
                   "(for machines with more VRAM than RAM); training on the CPU: give freed memory back to the "
                   "system at once (lower peak RAM, slower steps)")  # fmt: skip
    g.add_argument(
        "--highvram",
        action="store_true",
        help="accepted for sd-scripts: sdtrain never empties the CUDA cache between caching batches (always on)",
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str
    v_parameterization: bool = False
    vae: str | None = None
    tokenizer_cache_dir: str | None = None
    clip_skip: int | None = None
    max_token_length: int | None = None
    disable_mmap_load_safetensors: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelConfig:
        """Read the flags of :func:`add_model_args` (``--lowram`` / ``--no_half_vae``: ``RunConfig``)."""
        problems, path = [], args.pretrained_model_name_or_path
        if not path:
            problems.append("--pretrained_model_name_or_path is required: a diffusers folder or a .safetensors/.ckpt "
                            "file")  # fmt: skip
        elif not Path(path).exists():
            problems.append(f"--pretrained_model_name_or_path {path}: no such file or folder (models are never "
                            "downloaded: give a local diffusers folder or a .safetensors/.ckpt file)")  # fmt: skip
        if args.clip_skip is not None and args.clip_skip < 1:
            problems.append(f"--clip_skip must be >= 1, got {args.clip_skip}")
        if problems:
            raise ConfigError(problems)
        if getattr(args, "highvram", False):
            logger.info("--highvram: sdtrain never empties the CUDA cache between caching batches (always 'high VRAM')")
        return from_namespace(cls, args, path=path)


def add_validation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("validation")
    g.add_argument("--validation_split", type=float, default=0.0, help="fraction of training images held out")
    g.add_argument("--validation_seed", type=int, default=None, help="seed of the split and of the fixed noise")
    g.add_argument("--validate_every_n_steps", type=int, default=None)
    g.add_argument("--validate_every_n_epochs", type=int, default=None)
    g.add_argument("--max_validation_steps", type=int, default=None)


@dataclass(frozen=True)
class ValidationConfig:
    validation_split: float = 0.0
    validation_seed: int | None = None
    validate_every_n_steps: int | None = None
    validate_every_n_epochs: int | None = None
    max_validation_steps: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ValidationConfig:
        if args.validation_split and not 0 < args.validation_split < 1:
            raise ConfigError([f"--validation_split must be in (0, 1), got {args.validation_split}"])
        return from_namespace(cls, args)


@dataclass(frozen=True)
class TrainConfig:
    family: ModelFamily
    model: ModelConfig
    run: RunConfig
    data: data.DataArgs
    noise: NoiseConfig
    loss: LossConfig
    optim: OptimConfig
    method: MethodConfig  # what the recipe trains, read by its own reader (library/run/method.py)
    save: SaveConfig
    sample: SampleConfig
    trackers: TrackerConfig
    validation: ValidationConfig
    ema: EMAConfig
    block_swap: BlockSwapConfig = BlockSwapConfig()  # --blocks_to_swap / --cpu_offload_checkpointing
    memory_watch: WatchConfig = WatchConfig()  # --no_memory_watch (library/run/memory_watch.py)
    # the family's own flags, read by the family (``family.options.from_args``): ``family.load(..., options=)`` takes
    # them; the run asks for ``metadata()`` (ss_* keys of trained files) and ``text_encoder_batch_size``
    options: FamilyOptions = NoOptions()
    console_log_level: str | None = None
    console_log_file: str | None = None
    console_log_simple: bool = False
    args: dict = field(default_factory=dict)  # the arguments as given: what --log_config sends, read nowhere else

    @property
    def train_text_encoder(self) -> bool:
        """Whether the text encoders run with autograd (the method config's ``trains_text_encoder``)."""
        return self.method.trains_text_encoder

    @property
    def trained_parts(self) -> tuple[str, ...]:
        """The parts whose own weights the recipe trains ("denoiser", "text_encoders"): the method config's
        ``trained_parts`` (full fine-tuning); none for adapters and embeddings, which train tensors of their own."""
        return tuple(self.method.trained_parts)


def choose_family(args: argparse.Namespace, family_names: tuple[str, ...], training: str = "network") -> ModelFamily:
    """The family this script trains, from the model file, a family flag (sd-scripts' ``--v2``) and the families the
    script allows (a model of another family names that family's script of the same ``training`` type)."""
    try:
        path, flagged = args.pretrained_model_name_or_path, flagged_family(args)
        return select_family(path, family_names, flagged=flagged, training=training)
    except ValueError as e:
        raise ConfigError([str(e)]) from e


def read_config(
    args: argparse.Namespace,
    family_names: tuple[str, ...] | None = None,
    method: Callable | None = None,
    save_formats: tuple[str, ...] = ("safetensors", "ckpt", "pt"),
    training: str = "network",
) -> TrainConfig:
    """Every group's reader and every cross-check; raises one :class:`ConfigError` listing all problems.

    ``method(args)`` reads what the recipe trains (e.g. ``NetworkConfig.from_args``); its problems are reported
    with the others. Its result is ``cfg.method``; its ``trains_text_encoder`` says whether the text encoders run
    with autograd. ``save_formats``: the ``--save_model_as`` values the recipe writes (the first is the default).
    ``training``: the recipe's training type ("network", "fine_tune", "dreambooth", "textual_inversion"), for the
    script a model of another family is sent to. The family's own flags are read by the script's families'
    options class (``family.options.from_args(args, training=True)``), checked against the family read from the
    weights and against its objective.
    """
    family_names = tuple(family_names or default_families())
    problems = Problems()
    read = problems.read  # each reader raises a ConfigError; its problems join the others
    model = read(ModelConfig.from_args, args)
    family = read(choose_family, args, tuple(family_names), training)
    values = dict(
        model=model,
        run=read(RunConfig.from_args, args),
        data=read(data.DataArgs.from_args, args),
        noise=read(NoiseConfig.from_args, args),
        loss=read(LossConfig.from_args, args),
        optim=read(OptimConfig.from_args, args),
        method=read(method, args) if method is not None else NothingTrained(),
        save=read(SaveConfig.from_args, args, save_formats),
        sample=read(SampleConfig.from_args, args),
        trackers=read(TrackerConfig.from_args, args),
        validation=read(ValidationConfig.from_args, args),
        ema=read(EMAConfig.from_args, args),
        block_swap=read(BlockSwapConfig.from_args, args),
        memory_watch=read(WatchConfig.from_args, args),
        options=read(script_options(family_names).from_args, args, training=True),
    )
    if family is not None and values["options"] is not None:  # e.g. --model_type against the weights
        problems.extend(values["options"].problems(family.spec, args.pretrained_model_name_or_path))
    if family is not None and None not in (values["noise"], values["loss"], values["options"]):
        problems.extend(family.objective_problems(values["noise"], values["loss"], values["options"]))
    if values["data"] is not None and getattr(values["options"], "takes_control_images", False):  # edit models
        values["data"] = dataclasses.replace(values["data"], control_images=True)  # their control_directory is read
        cached = values["data"].cache_text_encoder_outputs or values["data"].cache_text_encoder_outputs_to_disk
        if getattr(values["options"], "prompt_control_images", False) and not cached:
            problems.error("the edit model's prompts are encoded with their control images when cached: add "
                           "--cache_text_encoder_outputs (musubi-tuner caches them before training)")  # fmt: skip
    given = args.dataset_config or args.train_data_dir or args.in_json  # (none given: a cross-check says so)
    if values["data"] is not None and family is not None and given:  # the dataset file and folders, same round
        data_args = with_native_resolution(values["data"], family, args.v_parameterization)
        read(data.load_dataset_configs, data_args, size_multiple=family.size_multiple)
    problems.extend(_cross_checks(args, values))
    cache_flag = "--cache_text_encoder_outputs" + ("" if args.cache_text_encoder_outputs else "_to_disk")
    values["method"] = method_with_text_cache(family, values["data"], values["method"], cache_flag)
    problems.extend(text_cache_problems(family, values["data"], values["method"], cache_flag))
    if family is not None and values["block_swap"] is not None:
        problems.extend(block_swap_problems(family, values["block_swap"]))
    problems.raise_if_any()
    return TrainConfig(
        family=family,
        console_log_level=args.console_log_level,
        console_log_file=args.console_log_file,
        console_log_simple=args.console_log_simple,
        args={k: v for k, v in vars(args).items() if v is not None},
        **values,
    )


def script_options(family_names: tuple[str, ...]) -> type[FamilyOptions]:
    """The options class of the families a script trains (they share one: the script adds its flags once)."""
    classes = {get_family(name).options for name in family_names}
    if len(classes) != 1:
        raise ValueError(f"the families {', '.join(family_names)} have different options classes; one script trains "
                         "families that share their flags")  # fmt: skip
    return classes.pop()


def block_swap_problems(family: ModelFamily, cfg: BlockSwapConfig) -> list[str]:
    """``--blocks_to_swap`` against the family's block lists of the released architecture (built on meta by
    ``reference_parts``), before anything loads: a family without lists (the SD UNets) or an N above the limit."""
    if not cfg.swaps:
        return []
    lists = family.swap_blocks(family.reference_parts().denoiser)
    return swap_problems(cfg.blocks_to_swap, lists, family.spec.title, getattr(family, "block_swap_split", "even"))


def method_with_text_cache(family: ModelFamily | None, data_args: Any, method: Any, flag: str) -> Any:
    """``flag`` (a text-encoder cache) while a family's text encoders would train adapters by default only: the
    method without them, with one warning (sd-scripts stops with an assertion); else ``method`` as it is (what
    cannot train over the cache is :func:`text_cache_problems`')."""
    if family is None or data_args is None or method is None or family.partial_text_cache is not None:
        return method
    if not (data_args.cache_text_encoder_outputs and method.trains_text_encoder):
        return method
    cached = method.with_text_cached()
    if cached is None:
        return method
    logger.warning("%s: the text-encoder outputs are cached, so %s's text encoders cannot train: only the "
                   "denoiser's adapters train (as with --network_train_unet_only; sd-scripts stops here)",
                   flag, family.spec.title)  # fmt: skip
    return cached


def text_cache_problems(
    family: ModelFamily | None, data_args: Any, method: Any, flag: str = "--cache_text_encoder_outputs"
) -> list[str]:
    """``--cache_text_encoder_outputs`` (``flag``: the one given) while text-encoder weights train (adapters, new
    tokens): only where the family recomputes the trained encoders' outputs over the cache (``partial_text_cache``:
    FLUX.1's CLIP-L, as sd-scripts)."""
    if family is None or data_args is None or method is None or family.partial_text_cache is not None:
        return []
    if data_args.cache_text_encoder_outputs and method.trains_text_encoder:
        return [f"{flag}: cached text-encoder outputs cannot train {family.spec.title}'s text encoders (adapters or "
                f"new tokens); add --network_train_unet_only for adapters, or drop {flag}"]  # fmt: skip
    return []


def _cross_checks(args: argparse.Namespace, values: dict) -> list[str]:
    problems = []
    if not (args.dataset_config or args.train_data_dir or args.in_json):
        problems.append("no dataset given; pass --dataset_config (a dataset TOML), --train_data_dir (the parent of "
                        "<repeats>_<class tokens> image folders) or --in_json (a metadata file)")  # fmt: skip
    save, optim, method = values.get("save"), values.get("optim"), values.get("method")
    if getattr(args, "fused_backward_pass", False) and method is not None and not method.fused_backward_pass:
        problems.append("--fused_backward_pass steps the optimizer inside the backward pass of the model's own weights: "
                        "it works for full fine-tuning (fine_tune.py and the other whole-model scripts), not for "
                        "adapters or embeddings; remove it")  # fmt: skip
    run = values.get("run")
    if run is not None and run.full_fp16 and optim is not None:
        problems += [p for p in [full_fp16_problem(optim.optimizer_type)] if p]
    if save is not None and save.resume and method is not None and optim is not None:  # before any model loads
        settings = resume.settings_of(method, optim.optimizer_type)
        problems += resume.setting_problems(Path(save.resume), resume.read_counters(Path(save.resume)), settings)
    return problems


# ---------------------------------------------------------------------------------------------------------------
# The run


def with_native_resolution(data_args: data.DataArgs, family: ModelFamily, v_parameterization: bool) -> data.DataArgs:
    """The family's native resolution when no --resolution is given."""
    if data_args.resolutions:
        return data_args
    native = family.default_resolution("v_prediction" if v_parameterization else "epsilon")
    return dataclasses.replace(data_args, resolutions=((native, native),))
