"""Setting up a training run: the flags read into one TrainConfig (``read_config``), then the Run (``start``).

A training session: every configuration group read and cross-checked at once, then the run set up.

``read_config(args)`` turns the parsed flags into one frozen :class:`TrainConfig` (all problems reported together,
before anything heavy happens); ``start(cfg)`` creates the accelerator, reads the datasets (bucket report), loads
the model, places it on the device in the right precision and fills the caches. The entry scripts compose these
with the loop in view.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from library import data, sampling
from library.cli.console import console_logging
from library.cli.parse import from_namespace
from library.cli.problems import ConfigError, Problems
from library.device.fp8 import store_in_fp8
from library.device.host import choose_cpu_threads, return_freed_memory, reuse_heap_for_small_models
from library.device.placement import on_device, to_device
from library.families import select_family
from library.families.base import ModelFamily, PartDtypes, Parts
from library.files.weights import without_mmap
from library.losses import LossConfig
from library.noising import NoiseConfig
from library.optim import OptimConfig
from library.optim.optimizers import full_fp16_problem
from library.run import resume
from library.run.block_swap import BlockSwap, BlockSwapConfig, enable_offloaded_checkpointing, swap_problems
from library.run.ema import EMAConfig
from library.run.method import MethodConfig, NothingTrained
from library.run.run_files import SaveConfig
from library.run.runtime import (
    RunConfig,
    allow_fp16_gradients,
    make_accelerator,
    num_workers,
    seed_everything,
    set_attention,
    shared_seed,
    total_steps,
)
from library.run.trackers import TrackerConfig
from library.run.train_step import StepModels, encode_captions, text_cache_entry
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
    g.add_argument("--v_parameterization", action="store_true", help="train with v-prediction (SD2 768-v, v-pred SDXL)")
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
    v2: bool = False
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
    block_swap: BlockSwapConfig = BlockSwapConfig()  # --blocks_to_swap / --cpu_offload_checkpointing (FLUX, SD3)
    # a family's own model flags (flux_train_network.py: library/families/flux/options.py FluxOptions), or None; it
    # gives ``load_kwargs()`` (extra arguments of family.load), ``family_problems(family, path)`` (checked against
    # the weights), ``metadata()`` (ss_* keys of trained files) and ``text_encoder_batch_size`` (captions per call
    # while caching, None: the batch size)
    model_options: Any = None
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
    """The family this script trains, from the model file, ``--v2`` and the families the script allows (a model of
    another family names that family's script of the same ``training`` type)."""
    try:
        return select_family(args.pretrained_model_name_or_path, family_names, v2=args.v2, training=training)
    except ValueError as e:
        raise ConfigError([str(e)]) from e


def read_config(
    args: argparse.Namespace,
    family_names: tuple[str, ...] = ("sd1", "sd2"),
    method: Callable | None = None,
    save_formats: tuple[str, ...] = ("safetensors", "ckpt", "pt"),
    training: str = "network",
    model_options: Callable | None = None,
) -> TrainConfig:
    """Every group's reader and every cross-check; raises one :class:`ConfigError` listing all problems.

    ``method(args)`` reads what the recipe trains (e.g. ``NetworkConfig.from_args``); its problems are reported
    with the others. Its result is ``cfg.method``; its ``trains_text_encoder`` says whether the text encoders run
    with autograd. ``save_formats``: the ``--save_model_as`` values the recipe writes (the first is the default).
    ``training``: the recipe's training type ("network", "fine_tune", "dreambooth", "textual_inversion"), for the
    script a model of another family is sent to. ``model_options(args)``: the reader of the script's family model
    flags (e.g. ``FluxOptions.from_args``), its result ``cfg.model_options``, checked against the detected family.
    """
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
        model_options=read(model_options, args) if model_options is not None else None,
    )
    if family is not None and values["model_options"] is not None:  # e.g. --model_type against the weights
        problems.extend(values["model_options"].family_problems(family, args.pretrained_model_name_or_path))
    given = args.dataset_config or args.train_data_dir or args.in_json  # (none given: a cross-check says so)
    if values["data"] is not None and family is not None and given:  # the dataset file and folders, same round
        data_args = with_native_resolution(values["data"], family, args.v_parameterization)
        read(data.load_dataset_configs, data_args, size_multiple=family.size_multiple)
    problems.extend(_cross_checks(args, values))
    cache_flag = "--cache_text_encoder_outputs" + ("" if args.cache_text_encoder_outputs else "_to_disk")
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


def block_swap_problems(family: ModelFamily, cfg: BlockSwapConfig) -> list[str]:
    """``--blocks_to_swap`` against the family's block lists of the released architecture (built on meta by
    ``reference_parts``), before anything loads: a family without lists (the SD UNets) or an N above the limit."""
    if not cfg.swaps:
        return []
    lists = family.swap_blocks(family.reference_parts().denoiser)
    return swap_problems(cfg.blocks_to_swap, lists, family.spec.title)


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
                        "it works for full fine-tuning (fine_tune.py, sdxl_train.py, train_db.py), not for adapters "
                        "or embeddings; remove it")  # fmt: skip
    run = values.get("run")
    if run is not None and run.full_fp16 and optim is not None:
        problems += [p for p in [full_fp16_problem(optim.optimizer_type)] if p]
    if save is not None and save.resume and method is not None and optim is not None:  # before any model loads
        settings = resume.settings_of(method, optim.optimizer_type)
        problems += resume.setting_problems(Path(save.resume), resume.read_counters(Path(save.resume)), settings)
    return problems


# ---------------------------------------------------------------------------------------------------------------
# The run


@dataclass
class Run:
    """The set-up run: accelerator, model parts on their devices, datasets, caches and the step inputs."""

    cfg: TrainConfig
    accelerator: Any
    family: ModelFamily
    parts: Parts
    plan: Any
    step_models: StepModels
    latent_cache: Any = None
    text_cache: Any = None
    sample_conds: Any = None  # flow models: the sample prompts' conditioning, cached with the text-encoder outputs
    validation_loader: Any = None  # batches of the held-out images (--validation_split), or None
    validation_latent_cache: Any = None
    validation_text_cache: Any = None
    block_swap: BlockSwap | None = None  # --blocks_to_swap: the blocks kept on the host (place_for_training)

    def make_loader(self, validation: bool = False) -> data.Loader:
        acc = self.accelerator
        return data.make_loader(
            self.plan.validation if validation else self.plan,
            rank=acc.process_index,
            world_size=acc.num_processes,
            num_workers=num_workers(self.cfg.run),
            persistent_workers=self.cfg.run.persistent_data_loader_workers,
            pin_memory=acc.device.type == "cuda",
            latent_cache=self.validation_latent_cache if validation else self.latent_cache,
            text_cache=self.validation_text_cache if validation else self.text_cache,
            max_train_steps=self.cfg.run.max_train_steps,
        )

    def step_budget(self, loader: data.Loader) -> tuple[int, int]:
        """(max_train_steps, num_epochs) from --max_train_steps / --max_train_epochs and the batches per epoch."""
        return total_steps(self.cfg.run, loader.num_batches(0), 1)


def start(cfg: TrainConfig) -> Run:
    """Accelerator, seed, datasets (bucket report), model in the right precision, caches, parts on their devices."""
    setup_logging(cfg)
    if cfg.model.disable_mmap_load_safetensors:
        logger.info(
            "--disable_mmap_load_safetensors: sdtrain reads .safetensors tensor by tensor with safe_open; the weights "
            "are the same either way (sd-scripts' flag only changes how files on slow drives are read)"
        )
    trackers = cfg.trackers
    engine = cfg.method.deepspeed_plugin(cfg)  # full models: --deepspeed (library/run/engines.py); else None
    accelerator = make_accelerator(
        cfg.run,
        log_with=trackers.trackers,
        logging_dir=trackers.logging_dir,
        deepspeed_plugin=engine,
    )
    allow_fp16_gradients(accelerator)  # --full_fp16: the GradScaler unscales fp16 gradients
    seed = shared_seed(cfg.run.seed, accelerator)  # without --seed: rank 0's draw on every process
    if seed != cfg.run.seed:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed))
    seed_everything(seed)
    # --lowram on CPU: freed activations leave the process at once (a lower peak RSS, a slower step; docs/training.md)
    freeing = cfg.run.lowram and return_freed_memory(accelerator.device)
    family = cfg.family
    data_args = cfg.data
    plan = build_plan(cfg, accelerator)
    notes = cfg.method.check_plan(plan)  # textual inversion: the captions that hold the token
    for note in notes if accelerator.is_main_process else []:
        logger.warning(note)
    parts = load_model(cfg, accelerator)
    native = family.default_resolution(parts.prediction_type)
    if not data_args.resolutions and plan.args.resolutions[0] != (native, native):
        logger.warning("no --resolution: training at %s, chosen before the model was loaded; this %s model's native "
                       "resolution is %d: pass --resolution %d", plan.args.resolutions[0], parts.prediction_type,
                       native, native)  # fmt: skip
    unet_params = sum(p.numel() for p in parts.denoiser.parameters())
    logger.info(choose_cpu_threads(accelerator.device, unet_params, accelerator.num_processes))
    if freeing:
        reuse_heap_for_small_models(accelerator.device, unet_params)  # a tiny model's blocks: faster from the heap
    loss = dataclasses.replace(cfg.loss, masked_loss=data_args.masked_loss)
    try:  # the noising, target and loss weighting are the family's objective's
        objective = family.training_objective(parts, cfg.noise, loss).to(accelerator.device)
    except ValueError as e:
        raise ConfigError([str(e)]) from e
    step_models = StepModels(
        family=family,
        parts=parts,
        objective=objective,
        noise=cfg.noise,
        loss=loss,
        denoiser=parts.denoiser,
        clip_skip=cfg.model.clip_skip,
        max_token_length=cfg.model.max_token_length,
        pad_tokens=not cfg.method.no_token_padding,  # train_db.py's --no_token_padding
        train_text_encoder=cfg.train_text_encoder,
        weighted_captions=cfg.data.weighted_captions,
        device=accelerator.device,
        weight_dtype=cfg.run.weight_dtype,
    )
    run = Run(cfg, accelerator, family, parts, plan, step_models)
    fill_caches(run)  # the VAE, then the text encoders, alone on the device
    place_for_training(run)  # the denoiser and what the step still runs
    if plan.validation is not None:
        run.validation_loader = run.make_loader(validation=True)
    return run


def with_native_resolution(data_args: data.DataArgs, family: ModelFamily, v_parameterization: bool) -> data.DataArgs:
    """The family's native resolution when no --resolution is given."""
    if data_args.resolutions:
        return data_args
    native = family.default_resolution("v_prediction" if v_parameterization else "epsilon")
    return dataclasses.replace(data_args, resolutions=((native, native),))


def build_plan(cfg: TrainConfig, accelerator: Any) -> data.Plan:
    """The datasets (records, buckets, bucket report) as training reads them; the family's native resolution when
    none is given."""
    data_args = with_native_resolution(cfg.data, cfg.family, cfg.model.v_parameterization)
    return data.build_datasets(
        data_args,
        grad_accum=cfg.run.gradient_accumulation_steps,
        num_processes=accelerator.num_processes,
        seed=cfg.run.seed,
        size_multiple=cfg.family.size_multiple,
        is_main_process=accelerator.is_main_process,
        validation_split=cfg.validation.validation_split,
        validation_seed=cfg.validation.validation_seed,
    )


def setup_logging(cfg: TrainConfig) -> None:
    """--console_log_level / --console_log_file / --console_log_simple, as sd-scripts."""
    console_logging(cfg.console_log_level, cfg.console_log_file, cfg.console_log_simple)


def part_dtypes(cfg: TrainConfig) -> PartDtypes:
    """What each part is loaded in: trained parts in the training dtype (fp32 unless --full_fp16 / --full_bf16),
    frozen ones in the mixed-precision dtype, the VAE in fp32 with --no_half_vae; each straight from the file."""
    run, trained = cfg.run, cfg.trained_parts
    return PartDtypes(
        denoiser=run.train_dtype if "denoiser" in trained else run.weight_dtype,
        vae=torch.float32 if run.no_half_vae else run.weight_dtype,
        text_encoders=run.train_dtype if "text_encoders" in trained else run.weight_dtype,
    )


def load_model(cfg: TrainConfig, accelerator: Any) -> Parts:
    """Load the base model onto the host (``--lowram``: each weight straight onto the device, as sd-scripts' help
    says), every part in its own precision (:func:`part_dtypes`); frozen weights asked for in float8 are cast there,
    before anything reaches the device. The processes of one machine load one after another, as sd-scripts does,
    so the host never holds several half-built copies at once. Nothing else goes to the device here: the caches
    and :func:`place_for_training` move each part when it is needed."""
    run = cfg.run
    device = accelerator.device if run.lowram else torch.device("cpu")
    parts = None
    for turn in range(accelerator.num_processes):
        if turn == accelerator.local_process_index:
            if accelerator.num_processes > 1:
                logger.info("loading the model for process %d", accelerator.process_index)
            with without_mmap(cfg.model.disable_mmap_load_safetensors):
                parts = cfg.family.load(
                    cfg.model.path,
                    dtype=part_dtypes(cfg),
                    vae=cfg.model.vae,
                    v_parameterization=True if cfg.model.v_parameterization else None,
                    tokenizer_cache_dir=cfg.model.tokenizer_cache_dir,
                    device=device,
                    **(cfg.model_options.load_kwargs() if cfg.model_options is not None else {}),
                )
        if accelerator.num_processes > 1:
            accelerator.wait_for_everyone()
    set_attention([parts.denoiser, parts.vae], run.attention)
    own_storage([parts.denoiser] if "denoiser" in cfg.trained_parts else [])
    if "text_encoders" in cfg.trained_parts:
        own_storage(parts.text_encoders)
    store_frozen_in_fp8(cfg, parts)
    offload = cfg.block_swap.cpu_offload_checkpointing  # implies checkpointing (BlockSwapConfig.from_args says so)
    if run.gradient_checkpointing or offload:
        enable_checkpointing(parts.denoiser, parts.text_encoders if cfg.train_text_encoder else [], offload)
    return parts


def own_storage(modules: list[torch.nn.Module]) -> int:
    """Give every parameter of the trained ``modules`` that shares its storage with another (a single-file loader
    splits a fused tensor, e.g. FLUX's ``qkv`` into ``to_q`` / ``to_k`` / ``to_v``) a storage of its own: such
    tensors share one autograd version counter, so an optimizer step inside backward (``--fused_backward_pass``) on
    one of them would invalidate what the others saved for their backward. The module gets new Parameter objects (a
    fresh counter; nothing holds the old ones yet). Returns how many were copied."""
    seen: dict[int, int] = {}  # storage -> the first Parameter on it (a tied Parameter, met twice, stays tied)
    copied = 0
    with torch.no_grad():
        for module in modules:
            for sub in module.modules():
                for name, p in list(sub._parameters.items()):
                    if p is None or p.device.type == "meta":
                        continue
                    ptr = p.untyped_storage().data_ptr()
                    if seen.setdefault(ptr, id(p)) != id(p):
                        sub._parameters[name] = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                        copied += 1
    return copied


def store_frozen_in_fp8(cfg: TrainConfig, parts: Parts) -> list[str]:
    """``--fp8_base`` (denoiser and text encoders) / ``--fp8_base_unet`` (denoiser only): frozen weights only.

    A part this script trains keeps its training dtype (fine_tune.py's UNet; sd-scripts reads --fp8_base only in
    its adapter scripts), and says so. Returns what was stored in float8."""
    run = cfg.run
    if not (run.fp8_base or run.fp8_base_unet):
        return []
    trained, stored = cfg.trained_parts, []
    name = cfg.family.denoiser_name
    if "denoiser" in trained:
        logger.warning("--fp8_base%s: this script trains the %s, which stays in %s (float8 stores frozen weights "
                       "only)", "_unet" if run.fp8_base_unet else "", name, str(run.train_dtype).replace("torch.", ""))  # fmt: skip
    else:
        store_in_fp8(parts.denoiser, run.weight_dtype, skip=cfg.family.fp8_skip)
        stored.append(name)
    if run.fp8_base and not run.fp8_base_unet:
        if "text_encoders" in trained:
            logger.warning("--fp8_base: this script trains the text encoders, which stay in %s",
                           str(run.train_dtype).replace("torch.", ""))  # fmt: skip
        else:
            for te in parts.text_encoders:
                store_in_fp8(te, run.weight_dtype)
            stored.append("text encoders")
    if stored:
        logger.info("stored the frozen %s weights in float8 (computed in %s)", " and ".join(stored),
                    str(run.weight_dtype).replace("torch.", ""))  # fmt: skip
    return stored


def enable_checkpointing(
    unet: torch.nn.Module, text_encoders: list[torch.nn.Module], cpu_offload: bool = False
) -> None:
    """--gradient_checkpointing on the UNet and the given (trained) text encoders; ``cpu_offload``
    (``--cpu_offload_checkpointing``): the denoiser's checkpointed blocks keep their saved inputs on the host
    (library/run/block_swap.py ``offloaded_checkpoint``).

    transformers checkpoints an encoder's layers only in training mode, so the trained encoders are put in it
    (their dropout rates are 0 in every released SD text encoder; sd-scripts does the same); sampling and
    validation switch them to eval mode and back.
    """
    kwargs = {"use_reentrant": False}
    if cpu_offload:
        enable_offloaded_checkpointing(unet)
    else:
        unet.enable_gradient_checkpointing()
    for te in text_encoders:
        if hasattr(te, "activation_checkpointing_enable"):  # transformers >= 5.24 (the older name warns there)
            te.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            te.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        te.train()


def place_for_training(run: Run) -> None:
    """Put on the device what the training step runs: the denoiser, the VAE unless every latent is cached, the text
    encoders unless their outputs are cached (with a cache and trained adapters: the encoders the family recomputes,
    ``ModelFamily.partial_text_cache``). The rest stays on the host; a sampling round
    brings it in for the round (library/sampling/training.py). With ``--blocks_to_swap`` the swapped blocks' frozen
    weights stay on the host (:func:`place_denoiser`)."""
    cfg, parts, device = run.cfg, run.parts, run.accelerator.device
    run.block_swap = place_denoiser(parts.denoiser, cfg.family, cfg.block_swap, device)
    if not cfg.data.cache_latents:
        parts.vae.to(device)
    if not cfg.data.cache_text_encoder_outputs:
        for te in parts.text_encoders:
            te.to(device)
    elif cfg.train_text_encoder:  # over a cache: what the family recomputes (FLUX.1: CLIP-L; T5 stays on the host)
        live = cfg.family.partial_text_cache
        for i, te in enumerate(parts.text_encoders):
            if live is None or i in live:
                te.to(device)


def place_denoiser(
    denoiser: torch.nn.Module, family: ModelFamily, cfg: BlockSwapConfig, device: torch.device
) -> BlockSwap | None:
    """The denoiser onto ``device``; with ``--blocks_to_swap`` N all but the frozen weights of the last blocks of the
    family's block lists (:meth:`ModelFamily.swap_blocks`), which then move in for each block's forward and backward
    (library/run/block_swap.py). Returns the :class:`BlockSwap`, or None without swapping."""
    if not cfg.swaps:
        denoiser.to(device)
        return None
    lists = family.swap_blocks(denoiser)
    problems = swap_problems(cfg.blocks_to_swap, lists, family.spec.title)
    if problems:
        raise ConfigError(problems)
    swap = BlockSwap(lists, cfg.blocks_to_swap, device)
    swap.place(denoiser)
    return swap


def module_identity(module: torch.nn.Module, extra: str = "") -> str:
    """A short fingerprint of a module's weights and dtype (cache keys change when the encoder changes)."""
    h = hashlib.sha256(extra.encode())
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        flat = t.detach().reshape(-1)
        h.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def fill_caches(run: Run) -> None:
    """``--cache_latents(_to_disk)`` with the VAE alone on the device, then ``--cache_text_encoder_outputs(_to_disk)``
    with the text encoders alone on it; each goes back to where it was after (sd-scripts' order)."""
    if run.cfg.data.cache_latents:
        fill_latent_cache(run)
    if run.cfg.data.cache_text_encoder_outputs:
        options = run.cfg.model_options
        fill_text_cache(run, None if options is None else options.text_encoder_batch_size)


def fill_latent_cache(run: Run) -> None:
    """Every image's latents (and the held-out images'), encoded with the VAE on the device."""
    cfg, acc, parts, family = run.cfg, run.accelerator, run.parts, run.family
    gen = torch.Generator().manual_seed(cfg.run.seed)
    vae_dtype = next(parts.vae.parameters()).dtype

    def encode(pixels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return family.encode_latents(parts, to_device(pixels, acc.device, vae_dtype), gen).float().cpu()

    vae_id = module_identity(parts.vae, f"{family.name}/{vae_dtype}")
    with on_device([parts.vae], acc.device):
        run.latent_cache = data.cache_latents(run.plan, encode, vae_id, rank=acc.process_index,
                                              world_size=acc.num_processes)  # fmt: skip
        if run.plan.validation is not None:
            run.validation_latent_cache = data.cache_latents(
                run.plan.validation, encode, vae_id, rank=acc.process_index, world_size=acc.num_processes
            )
    acc.wait_for_everyone()


def fill_text_cache(run: Run, batch_size: int | None = None) -> None:
    """Every caption's text-encoder outputs (and the held-out images'), with the encoders on the device;
    ``batch_size`` captions per call (default: the first dataset's batch size)."""
    cfg, acc, parts, family = run.cfg, run.accelerator, run.parts, run.family

    def encode_text(captions: list[str]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            cond = encode_captions(family, parts, captions, cfg.model.clip_skip, cfg.model.max_token_length,
                                   cfg.data.weighted_captions)  # fmt: skip
        return {k: v.float().cpu() for k, v in text_cache_entry(cond).items()}

    te_id = "+".join(module_identity(te) for te in parts.text_encoders)
    te_id += f"/clip_skip={cfg.model.clip_skip}/max_len={cfg.model.max_token_length}"
    te_id += "/weighted" if cfg.data.weighted_captions else ""  # --no_token_padding: the same padded outputs
    te_id += "".join(f"/{k}={v}" for k, v in sorted(parts.extra.get("prompt_settings", {}).items()))  # e.g. FLUX's T5
    with on_device(parts.text_encoders, acc.device):
        run.text_cache = data.cache_text_encoder_outputs(run.plan, encode_text, te_id, batch_size=batch_size)
        run.sample_conds = sampling.cache_sample_prompts(cfg.sample, family, parts)  # FLUX: no T5 on the device later
        if run.plan.validation is not None:
            run.validation_text_cache = data.cache_text_encoder_outputs(run.plan.validation, encode_text, te_id,
                                                                        batch_size=batch_size)  # fmt: skip


def release_unused_parts(run: Run) -> list[str]:
    """Free the frozen weights no later step reads; returns what was freed (for the log).

    The VAE once every latent is cached; the text encoders once every caption's outputs are cached (they are not
    trained then). Both stay when training samples images. For recipes that train adapters or embeddings: a
    recipe that saves the whole model (fine-tuning) keeps every part. A freed module keeps its structure (its
    weights become meta tensors) and refuses to run, with a message that says why.
    """
    cfg, parts = run.cfg, run.parts
    if cfg.sample.enabled:
        return []
    freed = []
    if cfg.data.cache_latents:
        _release(parts.vae, "the VAE", "--cache_latents")
        freed.append("VAE")
    if cfg.data.cache_text_encoder_outputs and not cfg.train_text_encoder:
        for te in parts.text_encoders:
            _release(te, "the text encoder", "--cache_text_encoder_outputs")
        freed.append("text encoders")
    if freed:
        import gc

        gc.collect()
        logger.info("freed the %s: cached outputs replace them and nothing samples images", " and ".join(freed))
    return freed


def _release(module: torch.nn.Module, what: str, flag: str) -> None:
    module.to("meta")  # the weights' memory is given back; names and shapes stay

    def refuse(*_: Any) -> None:
        raise RuntimeError(f"{what} was freed after {flag} cached its outputs (training needs only the cache); "
                           "nothing should run it afterwards")  # fmt: skip

    module.register_forward_pre_hook(refuse)
