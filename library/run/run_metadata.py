"""A run's metadata values for the file it saves (what ``metadata_format`` keys it fills, and from what).

The ``ss_*`` and ModelSpec metadata of a trained file (adapter, embedding), as sd-scripts' trainers write it.

The run's keys come from here; the trainable adds its own (``ss_network_*`` for adapters) through ``metadata()``.

A1111 reads ``ss_output_name`` (alias), ``ss_base_model_version`` (SD version filter), ``ss_tag_frequency`` (tags
dialog) and ``sshs_model_hash``; everything else documents the run (sd-scripts' ``train_network.py:
NetworkTrainer.train``, the ``metadata`` dict).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from library.files import metadata as md

_SESSION_ID = str(uuid.uuid4().int & (2**31 - 1))


def _listed(plan: Any, reg: bool) -> list[Any]:
    """The training images, or the regularisation images as listed (each once, its configured repeats)."""
    return [r for ds in plan.datasets for r in (ds.listed_reg if reg else ds.records) if r.is_reg == reg]


def _tag_frequency(plan: Any) -> dict[str, dict[str, int]]:
    """{dataset folder: {tag: count}} over the training and regularisation captions (sd-scripts counts
    comma-separated tags of every subset)."""
    out: dict[str, Counter] = {}
    for rec in _listed(plan, False) + _listed(plan, True):
        tags = [t.strip() for t in rec.caption.replace("\n", ",").split(",") if t.strip()]
        out.setdefault(Path(rec.path).parent.name, Counter()).update(tags)
    return {k: dict(v) for k, v in out.items()}


def _dataset_dirs(plan: Any, reg: bool) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for rec in _listed(plan, reg):
        entry = out.setdefault(Path(rec.path).parent.name, {"n_repeats": rec.num_repeats, "img_count": 0})
        entry["img_count"] += 1
    return out


def _bucket_info(plan: Any) -> dict:
    rows = plan.report.rows
    buckets = {}
    for i, r in enumerate(rows):
        w, h = (int(v) for v in r.bucket.split("x"))
        buckets[str(i)] = {"resolution": [w, h], "count": r.samples}
    return {"buckets": buckets, "mean_img_ar_error": 0.0}


def _training_keys(cfg: Any, run: Any) -> dict[str, Any]:
    opt = cfg.optim
    from library.optim import optimizer_metadata

    report = run.plan.report
    return {
        "ss_session_id": _SESSION_ID,
        "ss_output_name": cfg.save.output_name,
        "ss_learning_rate": opt.learning_rate,
        "ss_text_encoder_lr": json.dumps(list(opt.text_encoder_lr)) if opt.text_encoder_lr else None,
        "ss_unet_lr": opt.unet_lr,
        "ss_num_train_images": report.train_with_repeats,  # sd-scripts counts each repeat (viewers read it so)
        "ss_num_reg_images": report.reg_with_repeats,
        "ss_num_validation_images": run.plan.validation.report.train_with_repeats if run.plan.validation else 0,
        "ss_num_batches_per_epoch": report.batches_per_process,
        "ss_gradient_checkpointing": cfg.run.gradient_checkpointing,
        "ss_gradient_accumulation_steps": cfg.run.gradient_accumulation_steps,
        "ss_lr_warmup_steps": opt.lr_warmup_steps,
        "ss_lr_scheduler": opt.lr_scheduler,
        "ss_mixed_precision": cfg.run.mixed_precision,
        "ss_full_fp16": cfg.run.full_fp16,
        "ss_clip_skip": cfg.model.clip_skip,
        "ss_max_token_length": cfg.model.max_token_length,
        "ss_cache_latents": cfg.data.cache_latents,
        "ss_seed": cfg.run.seed,
        "ss_lowram": cfg.run.lowram,
        "ss_optimizer": optimizer_metadata(opt),
        "ss_max_grad_norm": opt.max_grad_norm,
        "ss_training_comment": cfg.save.training_comment,
        "ss_fp8_base": cfg.run.fp8_base,
        "ss_fp8_base_unet": cfg.run.fp8_base_unet,
        "ss_fp8_scaled": cfg.run.fp8_scaled or None,  # musubi-tuner does not write it; ours only when set
        "ss_prior_loss_weight": cfg.data.prior_loss_weight,
        "ss_caption_dropout_rate": cfg.data.caption_dropout_rate,
        "ss_caption_dropout_every_n_epochs": cfg.data.caption_dropout_every_n_epochs,
        "ss_caption_tag_dropout_rate": cfg.data.caption_tag_dropout_rate,
        "ss_validation_split": cfg.validation.validation_split,
        "ss_validation_seed": cfg.validation.validation_seed,
        "ss_ema": cfg.ema.ema,
        "ss_ema_decay": cfg.ema.ema_decay if cfg.ema.ema else None,
    }


def _noise_loss_keys(run: Any) -> dict[str, Any]:
    n, loss = run.step_models.noise, run.step_models.loss
    return {
        "ss_noise_offset": n.noise_offset,
        "ss_noise_offset_random_strength": n.noise_offset_random_strength,
        "ss_adaptive_noise_scale": n.adaptive_noise_scale,
        "ss_multires_noise_iterations": n.multires_noise_iterations,
        "ss_multires_noise_discount": n.multires_noise_discount,
        "ss_ip_noise_gamma": n.ip_noise_gamma,
        "ss_ip_noise_gamma_random_strength": n.ip_noise_gamma_random_strength,
        "ss_zero_terminal_snr": n.zero_terminal_snr,
        "ss_timestep_sampling": n.timestep_sampling,
        "ss_min_snr_gamma": loss.min_snr_gamma,
        "ss_debiased_estimation": loss.debiased_estimation_loss,
        "ss_loss_type": loss.loss_type,
        "ss_huber_schedule": loss.huber_schedule,
        "ss_huber_c": loss.huber_c,
        "ss_huber_scale": loss.huber_scale,
        "ss_masked_loss": loss.masked_loss,
    }


def _dataset_keys(cfg: Any, run: Any) -> dict[str, Any]:
    plan, d = run.plan, cfg.data
    resolution = trained_resolution(run)
    keys: dict[str, Any] = {
        "ss_tag_frequency": _tag_frequency(plan),
        "ss_dataset_dirs": _dataset_dirs(plan, reg=False),
        "ss_reg_dataset_dirs": _dataset_dirs(plan, reg=True),
        "ss_bucket_info": _bucket_info(plan) if d.enable_bucket else None,  # sd-scripts: null without buckets
        "ss_batch_size_per_device": d.train_batch_size,
        "ss_total_batch_size": d.train_batch_size * run.accelerator.num_processes * cfg.run.gradient_accumulation_steps,
        "ss_resolution": f"({resolution[0]}, {resolution[1]})",
        "ss_enable_bucket": d.enable_bucket,
        "ss_bucket_no_upscale": d.bucket_no_upscale,
        "ss_min_bucket_reso": d.min_bucket_reso if d.enable_bucket else None,
        "ss_max_bucket_reso": d.max_bucket_reso if d.enable_bucket else None,
        "ss_flip_aug": d.flip_aug,
        "ss_color_aug": d.color_aug,
        "ss_random_crop": d.random_crop,
        "ss_shuffle_caption": d.shuffle_caption,
        "ss_keep_tokens": d.keep_tokens,
    }
    return keys


def trained_resolution(run: Any) -> tuple[int, int]:
    """(width, height) of ``--resolution``, or the family's native one the run trained at without it: the datasets'
    settings as the plan holds them (``config.with_native_resolution``), the one source of ss_resolution and
    modelspec.resolution."""
    return tuple(run.plan.args.resolutions[0])


def file_metadata(trainer: Any, *, step: int | None = None, epoch: int | None = None) -> dict[str, str]:
    """The run's metadata for the trained file saved now (``--no_metadata``: the minimal set + ModelSpec); the
    trainable's own keys (``trainable.metadata()``) are added by the saver."""
    run, cfg = trainer.run, trainer.cfg
    family, parts = run.family, run.parts
    prediction = parts.prediction_type
    kind = trainer.trainable.modelspec_kind
    keys: dict[str, Any] = {
        "ss_v2": str(family.ss_v2),
        "ss_base_model_version": family.base_model_version(prediction),
        "ss_training_started_at": trainer.started_at,
        "ss_training_finished_at": time.time(),
        "ss_steps": step if step is not None else trainer.step,
        "ss_epoch": epoch if epoch is not None else trainer.epoch,
        "ss_num_epochs": trainer.num_epochs,
        "ss_max_train_steps": trainer.max_steps,
        **_training_keys(cfg, run),
        **_noise_loss_keys(run),
        **run.step_models.objective.metadata(),  # flow matching: sd-scripts' FLUX objective keys
        **cfg.options.metadata(),  # the family's own keys (e.g. ss_model_type)
        **_dataset_keys(cfg, run),
        **md.model_source_metadata(cfg.model.path),
    }
    if cfg.model.vae:
        keys.update(md.model_source_metadata(cfg.model.vae, prefix="ss_vae"))
    resolution = trained_resolution(run)
    n = run.step_models.noise
    spec = md.modelspec(
        architecture=family.modelspec_architecture(kind, prediction),
        implementation=family.modelspec_implementation(kind),
        title=cfg.save.metadata.get("title") or cfg.save.output_name or _default_title(kind),
        resolution=resolution,
        prediction_type=prediction,
        timestep_range=(n.min_timestep or 0, n.max_timestep or 1000)
        if (n.min_timestep is not None or n.max_timestep is not None)
        else None,
        encoder_layer=cfg.model.clip_skip,
        extra=_modelspec_extras(cfg.save.metadata),
    )
    out = {**md.to_str_values(keys), **spec}
    return md.minimal(out) if cfg.save.no_metadata else out


def _default_title(kind: str) -> str:
    """sd-scripts' fallback title: ``LoRA@<time>`` for adapters, ``TextualInversion@<time>`` for embeddings."""
    names = {"lora": "LoRA", "control-net-lllite": "LoRA", "textual-inversion": "TextualInversion"}  # sd-scripts'
    name = names.get(kind, "Checkpoint")
    return f"{name}@{time.strftime('%Y%m%d%H%M%S')}"


def _modelspec_extras(values: dict[str, str]) -> dict[str, str]:
    extra = {k: v for k, v in values.items() if k != "title"}
    if "thumbnail" in extra:
        extra["thumbnail"] = md.thumbnail_data_url(extra["thumbnail"])
    return extra
