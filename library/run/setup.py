"""Setting a training run up from its :class:`~library.run.config.TrainConfig`: the accelerator and seed, the
datasets (bucket report), the model in its dtypes and on its devices, the caches, and what one step runs.

``start(cfg)`` is what a training recipe calls: :func:`open_run` (logging, accelerator, seed), :func:`build_plan`,
:func:`load_model`, :func:`define_step` (the family's objective and the step's inputs), the caches
(:func:`fill_caches`), the placement for training. The caching tools call :func:`prepare_caches` (the same set-up
without a step, then the caches their flags ask for).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from library import data, sampling
from library.cli.console import console_logging
from library.cli.problems import ConfigError, problems_of
from library.device.fp8 import store_in_fp8
from library.device.host import choose_cpu_threads, pins_host_memory, return_freed_memory, reuse_heap_for_small_models
from library.device.placement import on_device_when_used, to_device
from library.families.base import PartDtypes, Parts, stays_on_host
from library.families.protocol import ModelFamily
from library.files.weights import without_mmap
from library.run import load_memory, memory_watch
from library.run.block_swap import BlockSwap, BlockSwapConfig, enable_offloaded_checkpointing, swap_problems
from library.run.config import TrainConfig, with_native_resolution
from library.run.runtime import (
    allow_fp16_gradients,
    make_accelerator,
    num_workers,
    seed_everything,
    set_attention,
    shared_seed,
    total_steps,
)
from library.run.train_step import StepModels, encode_captions, text_cache_entry

logger = logging.getLogger("sdtrain")


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
    watch: Any = None  # library/run/memory_watch.py: slow steps, a full card, a host short of memory

    def make_loader(self, validation: bool = False) -> data.Loader:
        acc = self.accelerator
        return data.make_loader(
            self.plan.validation if validation else self.plan,
            rank=acc.process_index,
            world_size=acc.num_processes,
            num_workers=num_workers(self.cfg.run),
            persistent_workers=self.cfg.run.persistent_data_loader_workers,
            pin_memory=pins_host_memory(acc.device),
            latent_cache=self.validation_latent_cache if validation else self.latent_cache,
            text_cache=self.validation_text_cache if validation else self.text_cache,
            max_train_steps=self.cfg.run.max_train_steps,
        )

    def step_budget(self, loader: data.Loader) -> tuple[int, int]:
        """(max_train_steps, num_epochs) from --max_train_steps / --max_train_epochs and the batches per epoch."""
        return total_steps(self.cfg.run, loader.num_batches(0), 1)


def start(cfg: TrainConfig) -> Run:
    """Accelerator, seed, datasets (bucket report), model in the right precision, the step, caches, parts on their
    devices."""
    cfg, accelerator = open_run(cfg, trackers=True)
    plan = build_plan(cfg, accelerator)
    notes = cfg.method.check_plan(plan)  # textual inversion: the captions that hold the token
    for note in notes if accelerator.is_main_process else []:
        logger.warning(note)
    host_note = load_memory.check_before_load(cfg, accelerator, vars(part_dtypes(cfg)).values())  # before any weight
    parts = load_model(cfg, accelerator)
    if cfg.sample.enabled:  # what only the loaded model can tell (a flow model's patch multiple), before training
        sampling.check_sample_prompts(cfg.sample, cfg.family, parts)
    tune_host(cfg, accelerator, parts, plan)
    run = Run(cfg, accelerator, cfg.family, parts, plan, define_step(cfg, parts, accelerator))
    run.watch = memory_watch.for_run(cfg, accelerator.device)  # the host's memory now, the steps' in the loop
    run.watch.report(host_note)  # to the trackers with the first step
    run.watch.check_host("before caching")
    fill_caches(run)  # the VAE, then the text encoders, alone on the device
    run.watch.check_host("after caching")
    place_for_training(run)  # the denoiser and what the step still runs
    if plan.validation is not None:
        run.validation_loader = run.make_loader(validation=True)
    return run


def prepare_caches(cfg: TrainConfig) -> Run:
    """The caching tools' run (tools/cache_latents.py, tools/cache_text_encoder_outputs.py): the set-up of
    :func:`start` without a training step, then the caches ``cfg.data`` asks for (``--cache_latents(_to_disk)``,
    ``--cache_text_encoder_outputs(_to_disk)``), each filled as training would fill it. Returns the run (plan,
    ``latent_cache``, ``text_cache``) for inspection."""
    cfg, accelerator = open_run(cfg, trackers=False)
    plan = build_plan(cfg, accelerator)
    load_memory.check_before_load(cfg, accelerator, vars(part_dtypes(cfg)).values())
    run = Run(cfg, accelerator, cfg.family, load_model(cfg, accelerator), plan, step_models=None)
    fill_caches(run)
    accelerator.wait_for_everyone()
    return run


def open_run(cfg: TrainConfig, trackers: bool) -> tuple[TrainConfig, Any]:
    """Logging, the accelerator (with the trackers when ``trackers``) and the seed every process shares; returns the
    config with that seed and the accelerator."""
    setup_logging(cfg)
    if cfg.model.disable_mmap_load_safetensors:
        logger.info(
            "--disable_mmap_load_safetensors: sdtrain reads .safetensors tensor by tensor with safe_open; the weights "
            "are the same either way (sd-scripts' flag only changes how files on slow drives are read)"
        )
    if not trackers:
        return cfg, make_accelerator(cfg.run)
    engine = cfg.method.deepspeed_plugin(cfg)  # full models: --deepspeed (library/run/engines.py); else None
    accelerator = make_accelerator(
        cfg.run, log_with=cfg.trackers.trackers, logging_dir=cfg.trackers.logging_dir, deepspeed_plugin=engine
    )
    allow_fp16_gradients(accelerator)  # --full_fp16: the GradScaler unscales fp16 gradients
    seed = shared_seed(cfg.run.seed, accelerator)  # without --seed: rank 0's draw on every process
    if seed != cfg.run.seed:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed))
    seed_everything(seed)
    return cfg, accelerator


def tune_host(cfg: TrainConfig, accelerator: Any, parts: Parts, plan: data.Plan) -> None:
    """The resolution note (no --resolution given and the model's native one differs from the one chosen before it
    loaded), the CPU threads and, with ``--lowram`` on the CPU, the heap settings for the model's size."""
    native = cfg.family.default_resolution(parts.prediction_type)
    if not cfg.data.resolutions and plan.args.resolutions[0] != (native, native):
        logger.warning("no --resolution: training at %s, chosen before the model was loaded; this %s model's native "
                       "resolution is %d: pass --resolution %d", plan.args.resolutions[0], parts.prediction_type,
                       native, native)  # fmt: skip
    unet_params = sum(p.numel() for p in parts.denoiser.parameters())
    logger.info(choose_cpu_threads(accelerator.device, unet_params, accelerator.num_processes))
    # --lowram on CPU: freed activations leave the process at once (a lower peak RSS, a slower step; docs/training.md)
    if cfg.run.lowram and return_freed_memory(accelerator.device):
        reuse_heap_for_small_models(accelerator.device, unet_params)  # a tiny model's blocks: faster from the heap


def define_step(cfg: TrainConfig, parts: Parts, accelerator: Any) -> StepModels:
    """What one training step runs: the family's objective (noising, target, loss weighting) on the run's noise and
    loss settings, and the step's inputs."""
    loss = dataclasses.replace(cfg.loss, masked_loss=cfg.data.masked_loss)
    try:
        objective = cfg.family.training_objective(parts, cfg.noise, loss).to(accelerator.device)
    except ValueError as e:
        raise ConfigError(problems_of(e)) from e
    return StepModels(
        family=cfg.family,
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
                    options=cfg.options,
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
        store_in_fp8(parts.denoiser, run.weight_dtype, skip=cfg.family.fp8_skip, scaled=run.fp8_scaled)
        stored.append(name)
    # a family whose trainer reads --fp8_base for its denoiser only (musubi-tuner's) says so
    if run.fp8_base and not run.fp8_base_unet and getattr(cfg.family, "fp8_base_text_encoders", True):
        if "text_encoders" in trained:
            logger.warning("--fp8_base: this script trains the text encoders, which stay in %s",
                           str(run.train_dtype).replace("torch.", ""))  # fmt: skip
        else:
            for te in parts.text_encoders:
                store_in_fp8(te, run.weight_dtype, scaled=run.fp8_scaled)
            stored.append("text encoders")
    if stored:
        logger.info("stored the frozen %s weights in float8%s (computed in %s)", " and ".join(stored),
                    " with a scale per weight" if run.fp8_scaled else "",
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
            if not stays_on_host(te):  # --text_encoder_cpu
                te.to(device)
    elif cfg.train_text_encoder:  # over a cache: what the family recomputes (FLUX.1: CLIP-L; T5 stays on the host)
        live = cfg.family.partial_text_cache
        for i, te in enumerate(parts.text_encoders):
            if (live is None or i in live) and not stays_on_host(te):
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
    split = getattr(family, "block_swap_split", "even")  # how N is shared between the lists (swap_split.py)
    problems = swap_problems(cfg.blocks_to_swap, lists, family.spec.title, split)
    if problems:
        raise ConfigError(problems)
    swap = BlockSwap(lists, cfg.blocks_to_swap, device, split)
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


def latent_cache_id(family: ModelFamily, vae: torch.nn.Module) -> str:
    """The VAE's part of every latent cache key: its weights, its dtype and the family (a separate caching step
    computes the same to write entries training finds)."""
    return module_identity(vae, f"{family.name}/{next(vae.parameters()).dtype}")


def text_cache_id(parts: Parts, clip_skip: int | None, max_token_length: int | None, weighted: bool) -> str:
    """The text encoders' part of every text cache key: their weights and the settings that change their outputs
    (--no_token_padding gives the same padded outputs; the family's options add theirs, e.g. a T5 length)."""
    te_id = "+".join(module_identity(te) for te in parts.text_encoders)
    te_id += f"/clip_skip={clip_skip}/max_len={max_token_length}"
    te_id += "/weighted" if weighted else ""
    return te_id + (parts.options.prompt_identity() if parts.options is not None else "")


def fill_caches(run: Run) -> None:
    """``--cache_latents(_to_disk)`` with the VAE alone on the device, then ``--cache_text_encoder_outputs(_to_disk)``
    with the text encoders alone on it; each goes back to where it was after (sd-scripts' order)."""
    if run.cfg.data.cache_latents:
        fill_latent_cache(run)
    if run.cfg.data.cache_text_encoder_outputs:
        fill_text_cache(run, run.cfg.options.text_encoder_batch_size)


def fill_latent_cache(run: Run) -> None:
    """Every image's latents (and the held-out images'), encoded with the VAE on the device (moved there only when
    an entry is missing)."""
    cfg, acc, parts, family = run.cfg, run.accelerator, run.parts, run.family
    gen = torch.Generator().manual_seed(cfg.run.seed)
    vae_dtype = next(parts.vae.parameters()).dtype
    vae_id = latent_cache_id(family, parts.vae)
    downscale = getattr(family, "latent_downscale", 8)  # the VAE's spatial factor (a family with another states it)
    with on_device_when_used([parts.vae], acc.device) as use:

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            use()
            with torch.no_grad():
                return family.encode_latents(parts, to_device(pixels, acc.device, vae_dtype), gen).float().cpu()

        run.latent_cache = data.cache_latents(run.plan, encode, vae_id, rank=acc.process_index,
                                              world_size=acc.num_processes, downscale=downscale)  # fmt: skip
        if run.plan.validation is not None:
            run.validation_latent_cache = data.cache_latents(
                run.plan.validation,
                encode,
                vae_id,
                rank=acc.process_index,
                world_size=acc.num_processes,
                downscale=downscale,
            )
    acc.wait_for_everyone()


def fill_text_cache(run: Run, batch_size: int | None = None) -> None:
    """Every caption's text-encoder outputs (and the held-out images'), with the encoders on the device (moved there
    only when an entry is missing or sample prompts are encoded); ``batch_size`` captions per call (default: the
    first dataset's batch size)."""
    cfg, acc, parts, family = run.cfg, run.accelerator, run.parts, run.family
    te_id = text_cache_id(parts, cfg.model.clip_skip, cfg.model.max_token_length, cfg.data.weighted_captions)
    with on_device_when_used(parts.text_encoders, acc.device) as use:

        def encode_text(captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
            use()
            with torch.no_grad():
                cond = encode_captions(family, parts, captions, cfg.model.clip_skip, cfg.model.max_token_length,
                                       cfg.data.weighted_captions, controls=controls)  # fmt: skip
            return {k: v.float().cpu() for k, v in text_cache_entry(cond).items()}

        seen = getattr(parts.options, "prompt_control_images", False)  # the edit models' prompts see the controls
        run.text_cache = data.cache_text_encoder_outputs(run.plan, encode_text, te_id, batch_size=batch_size,
                                                         with_controls=seen)  # fmt: skip
        if cfg.sample.enabled:
            use()
        run.sample_conds = sampling.cache_sample_prompts(cfg.sample, family, parts)  # FLUX: no T5 on the device later
        if run.plan.validation is not None:
            run.validation_text_cache = data.cache_text_encoder_outputs(run.plan.validation, encode_text, te_id,
                                                                        batch_size=batch_size, with_controls=seen)  # fmt: skip


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
