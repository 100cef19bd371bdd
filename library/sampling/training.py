"""One sampling round during training: generate every prompt of the file, save PNGs and a grid, log them.

The round leaves training exactly as it found it: every RNG state (torch CPU and CUDA, Python's ``random``) is saved
before and restored after, noise comes from per-image CPU generators seeded from the prompt (or the OS), the models
run in eval mode under ``torch.no_grad`` and each module's train/eval flag is put back. So a run with sampling gives
the same losses as one without (tested).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from library.cli.problems import ConfigError
from library.device.placement import on_device
from library.device.rng import capture_rng, restore_rng
from library.families.base import Parts, module_device
from library.families.protocol import ModelFamily

from .config import SampleConfig
from .flow_generate import encode_prompt_texts, flow_settings, negative_key, prompt_problems, uses_flow_sampler
from .generate import generate_batch, random_seed, resolve
from .images import log_to_trackers, make_grid, png_info, sample_file_name, save_png, timestamp
from .prompts import read_prompt_file
from .vae_tiling import tiled_decoding

log = logging.getLogger(__name__)


def sample_during_training(
    cfg: SampleConfig,
    family: ModelFamily,
    parts: Parts,
    *,
    output_dir: str | Path,
    output_name: str | None,
    step: int,
    epoch: int | None = None,
    accelerator: Any = None,
    trackers: Sequence[Any] | None = None,
    ema_context: contextlib.AbstractContextManager | None = None,
    conds: Mapping[str, Any] | None = None,
    control: Callable[[Any], contextlib.AbstractContextManager] | None = None,
) -> list[Path]:
    """Generate the prompts of ``cfg.prompts_file`` (re-read now, so it may be edited during training) with the
    model as it is (adapters applied at their multiplier; the EMA weights inside ``ema_context`` when given).

    Files: ``<output_dir>/sample/<name>.png`` (:func:`sample_file_name`) and ``<output_name>_<step>_grid_<time>.png`` with all images of
    the round; each PNG carries the prompt and settings as text chunks. Images are logged to ``trackers`` (default:
    ``accelerator.trackers``) as ``sample_<i>`` and ``sample_grid``. A prompt file that became unreadable is reported
    and the round skipped (training goes on). Returns the paths of the images written (grid last; ``[]`` on the
    other processes).

    Where it runs: on the training device (``accelerator.device``, else the denoiser's); parts that training keeps
    on the host (the VAE under ``--cache_latents``, the text encoders under ``--cache_text_encoder_outputs``) come
    to it for the round and go back after. With several processes each generates every n-th prompt (as
    sd-scripts does) and the main process saves them all, so no process waits for one that samples alone.

    Flow-matching models (FLUX) hold one part at a time on the device besides the denoiser: the text encoders while
    prompts are encoded (not at all for texts in ``conds``, the prompts cached with the text-encoder outputs:
    :func:`cache_sample_prompts`), the VAE while decoding. DDPM models bring every part for the round.
    ``cfg.tiled_vae`` (``--sample_vae_tiling``): the VAE decodes in tiles (library/sampling/vae_tiling.py).
    ``control(spec)``: the context a prompt with a conditioning image (``--cn``) samples in (the trained ControlNet
    given that image; the trainable's ``sample_control``).
    """
    try:
        specs = read_prompt_file(cfg.prompts_file, controls=control is not None)
        problems = prompt_problems(family, parts, specs, str(cfg.prompts_file))
        if problems:
            raise ConfigError(problems)
    except (FileNotFoundError, ConfigError) as e:
        log.error("sampling at step %d skipped: %s", step, e)
        return []
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    log.info("generating %d sample image(s) at step %d", len(specs), step)
    device = accelerator.device if accelerator is not None else module_device(parts.denoiser)
    rng = capture_rng()
    modes = _enter_eval(parts)
    autocast = accelerator.autocast if accelerator is not None else None
    flow = uses_flow_sampler(family, parts)
    resident = [parts.denoiser] if flow else _modules(parts)
    stage = (lambda modules: on_device(modules, device)) if flow else None
    tiles = tiled_decoding(parts.vae) if cfg.tiled_vae and parts.vae is not None else contextlib.nullcontext()
    try:
        with ema_context or contextlib.nullcontext(), on_device(resident, device), tiles:
            results = [_one(cfg, family, parts, spec, autocast, stage, conds, control) for spec in specs[rank::world]]
    finally:
        _restore_modes(modes)
        restore_rng(rng)
    if world > 1:
        from accelerate.utils import gather_object

        results = sorted(gather_object(results), key=lambda r: r[0].index)
    if accelerator is not None and not accelerator.is_main_process:
        return []
    return _save_and_log(results, cfg, parts, output_dir, output_name, step, epoch, accelerator, trackers)


def check_sample_prompts(cfg: SampleConfig, family: ModelFamily, parts: Parts) -> None:
    """Before training: ``ConfigError`` listing every prompt of ``cfg.prompts_file`` the loaded model cannot sample
    (flow matching: sizes not multiples of 16; ``SampleConfig.from_args`` checked the rest without the model)."""
    if cfg.prompts_file is None:
        return
    specs = read_prompt_file(cfg.prompts_file, controls=cfg.controls)
    problems = prompt_problems(family, parts, specs, str(cfg.prompts_file))
    if problems:
        raise ConfigError(problems)


def cache_sample_prompts(cfg: SampleConfig, family: ModelFamily, parts: Parts) -> dict[str, Any] | None:
    """The conditioning of every prompt and negative prompt of ``cfg.prompts_file`` (text -> batch-1 conditioning
    on the host), for a flow-matching model whose text encoders are on the device now (the text-encoder caching
    of a run); None when nothing samples, the model is not flow-matching or the file cannot be read (each round
    then encodes, as before). A round reads its prompts again: texts added later are encoded then."""
    if not cfg.enabled or not uses_flow_sampler(family, parts):
        return None
    try:
        specs = read_prompt_file(cfg.prompts_file)
    except (FileNotFoundError, ConfigError):
        return None
    settings = flow_settings(family, parts)
    texts = [t for s in specs for t in (s.prompt, negative_key(settings, s.negative_prompt or ""))]
    return encode_prompt_texts(family, parts, texts)


def _one(
    cfg: SampleConfig,
    family: ModelFamily,
    parts: Parts,
    spec: Any,
    autocast: Any,
    stage: Any = None,
    conds: Any = None,
    control: Any = None,
) -> tuple[Any, int, Any]:
    spec = resolve(spec, family, parts, sampler=cfg.sampler, steps=cfg.default_steps, scale=cfg.default_scale)
    seed = spec.seed if spec.seed is not None else random_seed()
    if spec.network_multipliers:
        log.warning("prompt %d: --am (network multipliers) only applies to gen_img.py; ignored", spec.index)
    uses_control = control is not None and spec.control_image is not None
    with control(spec) if uses_control else contextlib.nullcontext():
        image = _generate(cfg, family, parts, spec, seed, autocast, stage, conds)
    return spec, seed, image


def _generate(cfg: SampleConfig, family: ModelFamily, parts: Parts, spec: Any, seed: int, autocast: Any, stage: Any,
              conds: Any) -> Any:  # fmt: skip
    return generate_batch(
        family,
        parts,
        [spec],
        [torch.Generator("cpu").manual_seed(seed)],
        clip_skip=cfg.clip_skip,
        max_embeddings_multiples=cfg.max_embeddings_multiples,
        zero_terminal_snr=cfg.zero_terminal_snr,
        autocast=autocast,
        stage=stage,
        conds=conds,
    )[0]


def _save_and_log(
    results, cfg, parts: Parts, output_dir, output_name, step, epoch, accelerator, trackers
) -> list[Path]:
    folder = Path(output_dir) / "sample"
    stamp = timestamp()
    paths, tagged = [], {}
    for spec, seed, image in results:
        name = sample_file_name(output_name, step=step, epoch=epoch, index=spec.index, seed=spec.seed, stamp=stamp)
        extra = {"model": parts.source or None, "step": step, "epoch": epoch, "clip-skip": cfg.clip_skip}
        paths.append(save_png(image, folder / name, png_info(spec, seed, **extra)))
        tagged[f"sample_{spec.index}"] = image
    grid = make_grid([image for _, _, image in results])
    grid_path = folder / sample_file_name(output_name, step=step, epoch=epoch, index="grid", seed=None, stamp=stamp)
    grid.save(grid_path)
    paths.append(grid_path)
    tagged["sample_grid"] = grid
    if trackers is None and accelerator is not None:
        trackers = accelerator.trackers
    log_to_trackers(trackers or [], tagged, step)
    return paths


def _modules(parts: Parts) -> list[nn.Module]:
    return [m for m in (parts.denoiser, parts.vae, *parts.text_encoders) if isinstance(m, nn.Module)]


def _enter_eval(parts: Parts) -> dict[nn.Module, bool]:
    """Put every module of ``parts`` in eval mode; returns each submodule's previous ``training`` flag."""
    modes = {m: m.training for root in _modules(parts) for m in root.modules()}
    for root in _modules(parts):
        root.eval()
    return modes


def _restore_modes(modes: dict[nn.Module, bool]) -> None:
    for module, training in modes.items():
        module.training = training
