"""Every dataset's plan: its records, regularisation balance, validation split and bucket assignment.

:func:`plan_datasets`: validate the configuration, read every image header and caption once, hold out validation
images, balance regularisation images and assign buckets for every training resolution. The bucket report is made
from these plans (``report.py``); ``plan.py`` puts both together for training.

Everything that can be wrong with the user's input is found here, before a model is loaded, and reported at once.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, replace

from library.cli.problems import Problems

from . import control_images
from .buckets import Assignment, predefined_buckets, select_bucket
from .conditioning import conditioning_images_in, match_conditioning, unpaired
from .data_args import DataArgs
from .dataset_config import DatasetConfig, SubsetConfig, load_dataset_configs
from .sources import (
    IMAGE_EXTENSIONS,
    ImageRecord,
    dreambooth_items,
    face_box,
    find_mask,
    finetune_items,
    read_image_size,
)


@dataclass(frozen=True)
class DatasetPlan:
    """One dataset ready for batching: its records and, per training resolution, each record's bucket."""

    config: DatasetConfig
    records: tuple[ImageRecord, ...]
    assignments: tuple[tuple[Assignment, ...], ...]  # [resolution index][record index]
    unused: tuple[str, ...] = ()  # images never trained (e.g. regularisation images beyond the training count)
    listed_reg: tuple[ImageRecord, ...] = ()  # the regularisation images as listed, with their configured repeats

    def subset(self, record: ImageRecord) -> SubsetConfig:
        return self.config.subsets[record.subset_index]


@dataclass(frozen=True)
class DatasetPlans:
    """What :func:`plan_datasets` found: the datasets to train on, the held-out ones, and the warnings."""

    train: tuple[DatasetPlan, ...]
    held_out: tuple[DatasetPlan, ...]  # only the datasets with held-out images (``validation_split``)
    warnings: tuple[str, ...]


def split_validation(records: list[ImageRecord], fraction: float, seed: int) -> tuple[list, list]:
    """Hold out ``fraction`` of each subset's training images (never regularisation images) for validation.

    Leak-free and deterministic: an image's place is decided by a hash of (seed, its path relative to the subset's
    common folder), so the two sets never overlap and the same seed always gives the same split, whatever the file
    order and wherever the dataset folder lies (a run resumed on another machine, or from a moved copy, holds out the
    same images). Subsets with one image keep it for training. Validation images are used once each (no repeats).
    """
    train, val = [], []
    by_subset: dict[int, list[ImageRecord]] = {}
    for r in records:
        (train.append(r) if r.is_reg else by_subset.setdefault(r.subset_index, []).append(r))
    for group in by_subset.values():
        base = os.path.commonpath([os.path.abspath(r.path) for r in group]) if len(group) > 1 else ""

        def rank(r: ImageRecord, base: str = base) -> str:
            where = os.path.relpath(os.path.abspath(r.path), base) if base else r.path
            return hashlib.sha256(f"{seed}:{where}".encode()).hexdigest()

        ranked = sorted(group, key=rank)
        n_val = min(len(group) - 1, math.ceil(len(group) * fraction)) if fraction > 0 else 0
        val += [replace(r, num_repeats=1) for r in ranked[:n_val]]
        held = {r.path for r in ranked[:n_val]}
        train += [r for r in group if r.path not in held]
    return train, val


def _read_sizes(paths: list[str]) -> list[tuple[int, int] | ValueError]:
    """:func:`read_image_size` of every path (each image is decoded once to find damage), on a few threads: Pillow
    decodes without holding the GIL. A problem comes back as its ``ValueError``, in the paths' order."""

    def read(path: str) -> tuple[int, int] | ValueError:
        try:
            return read_image_size(path)
        except ValueError as e:
            return e

    workers = min(8, os.cpu_count() or 1)
    if workers == 1 or len(paths) < 16:
        return [read(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(read, paths))


def _scan_subset(subset: SubsetConfig, index: int, args: DataArgs, problems: Problems, corrupt: list[str]):
    items = finetune_items(subset, problems) if subset.kind == "finetune" else dreambooth_items(subset, problems)
    records, no_caption = [], []
    cond_dir = subset.conditioning_data_dir if args.conditioning_images else None
    cond_images = conditioning_images_in(cond_dir) if cond_dir and os.path.isdir(cond_dir) else None
    for (path, text), size in zip(items, _read_sizes([path for path, _ in items])):
        if isinstance(size, ValueError):
            corrupt.append(str(size))
            continue
        if text is None or not text.strip():
            no_caption.append(path)
            text = subset.class_tokens or ""
        mask_dir = None if args.conditioning_images else subset.conditioning_data_dir
        mask = find_mask(path, mask_dir, args.masked_loss, problems) if args.masked_loss or mask_dir else None
        face = face_box(path) if subset.face_crop_aug_range else None
        cond = None
        if cond_images is not None:
            cond = match_conditioning(path, size, cond_images, subset.conditioning_data_dir, problems)
        records.append(ImageRecord(path, size, text, index, subset.is_reg, subset.num_repeats, mask, face, cond))
    if cond_images is not None:
        unpaired(
            subset.conditioning_data_dir, cond_images, {r.conditioning_path for r in records}, problems, subset.where
        )
    records = control_images.attach(records, subset.control, subset.where, problems)
    if no_caption:
        fallback = f'class tokens "{subset.class_tokens}"' if subset.class_tokens else "an empty caption"
        shown = ", ".join(os.path.basename(p) for p in no_caption[:3]) + (" ..." if len(no_caption) > 3 else "")
        problems.warn(
            subset.where,
            f"{len(no_caption)} of {len(items)} images have no (or an empty) {subset.caption_extension} caption and "
            f"use {fallback} ({shown})",
        )
    if not items:
        problems.warn(subset.where, "no images found in this subset")
    return records


def balance_regularisation(records: list[ImageRecord]) -> tuple[list[ImageRecord], list[str]]:
    """sd-scripts' rule (DreamBoothDataset): regularisation images are registered round-robin, their repeat counts
    raised one by one, until the regularisation samples equal the training samples (repeats included). Returns the
    kept records and the paths of regularisation images that are never used."""
    train = [r for r in records if not r.is_reg]
    reg = [r for r in records if r.is_reg]
    target = sum(r.num_repeats for r in train)
    if not reg or target == 0:
        return train, [r.path for r in reg]
    repeats: dict[int, int] = {}
    n, first = 0, True
    while n < target:
        for i, r in enumerate(reg):
            if first:
                repeats[i] = r.num_repeats
                n += r.num_repeats
            else:
                repeats[i] += 1
                n += 1
            if n >= target:
                break
        first = False
    kept = [replace(reg[i], num_repeats=k) for i, k in sorted(repeats.items())]
    unused = [r.path for i, r in enumerate(reg) if i not in repeats]
    return train + kept, unused


def _assign(config: DatasetConfig, records: list[ImageRecord], problems: Problems):
    per_res, upscaled = [], []
    for k in range(len(config.resolutions)):
        spec = config.bucket_spec(k)
        buckets = predefined_buckets(spec)
        row = []
        for r in records:
            a = select_bucket(r.size[0], r.size[1], spec, buckets)
            if min(a.bucket) < 8:
                problems.error(
                    r.path,
                    f"image {r.size[0]}x{r.size[1]} is too small: its bucket would be {a.bucket[0]}x{a.bucket[1]} "
                    f"with bucket_no_upscale and bucket_reso_steps {config.bucket_reso_steps}; remove it or upscale "
                    f"it to at least {config.bucket_reso_steps} px per side",
                )
            elif a.resized[0] > r.size[0] and a.resized[1] > r.size[1]:
                upscaled.append((r, a))
            row.append(a)
        per_res.append(tuple(row))
    if upscaled:
        r, a = min(upscaled, key=lambda ra: ra[0].size[0] * ra[0].size[1])
        problems.warn(
            config.where,
            f"{len(upscaled)} image-resolution pairs are upscaled to fill their bucket (smallest: {r.path} "
            f"{r.size[0]}x{r.size[1]} -> {a.resized[0]}x{a.resized[1]}); {_upscale_advice(config)}",
        )
    return tuple(per_res)


def _upscale_advice(config: DatasetConfig) -> str:
    if config.enable_bucket:
        return "use bucket_no_upscale (buckets from each image's own size) or larger images"
    return "use larger images or a smaller resolution (or enable_bucket with bucket_no_upscale)"


def _skip_small(config: DatasetConfig, records: list[ImageRecord], problems: Problems) -> list[ImageRecord]:
    if config.skip_image_resolution is None:
        return records
    limit = config.skip_image_resolution[0] * config.skip_image_resolution[1]
    kept = [r for r in records if r.size[0] * r.size[1] > limit]
    if len(kept) < len(records):
        problems.warn(config.where, f"{len(records) - len(kept)} images at or below skip_image_resolution skipped")
    return kept


def _check_caching(config: DatasetConfig, args: DataArgs, problems: Problems) -> None:
    """Settings that contradict caching are errors up front (a cached latent / text embedding is fixed)."""
    for s in config.subsets:
        if args.cache_latents:
            for name in ("random_crop", "color_aug", "face_crop_aug_range"):
                if getattr(s, name):
                    problems.error(
                        s.where,
                        f"{name} changes the image every step, but --cache_latents stores one latent per image; "
                        f"turn {name} off or drop latent caching",
                    )
        if args.cache_text_encoder_outputs:
            for name in s.captions.varies_per_step():
                problems.error(
                    s.where,
                    f"{name} changes the caption every step, but --cache_text_encoder_outputs stores fixed "
                    f"embeddings; turn {name} off or drop text-encoder caching",
                )


def _plan_dataset(
    config: DatasetConfig, args: DataArgs, problems: Problems, corrupt: list[str], split: tuple[float, int]
) -> tuple[DatasetPlan, DatasetPlan]:
    records: list[ImageRecord] = []
    for i, subset in enumerate(config.subsets):
        records += _scan_subset(subset, i, args, problems, corrupt)
    records = _skip_small(config, records, problems)
    records, held_out = split_validation(records, *split)
    if records and all(r.is_reg for r in records):
        problems.error(config.where, "has only regularisation images; add training images (is_reg = false)")
    listed_reg = tuple(r for r in records if r.is_reg)
    records, unused = balance_regularisation(records)
    if unused:
        problems.warn(
            config.where,
            f"{len(unused)} regularisation images are never used: there are more of them than training samples",
        )
    masked = args.masked_loss and any(not (r.mask_path or config.subsets[r.subset_index].alpha_mask) for r in records)
    if masked:
        problems.warn(
            config.where,
            "some images have no mask (-masklabel.png / conditioning image / alpha); they train with a full mask",
        )
    train = DatasetPlan(config, tuple(records), _assign(config, records, problems), tuple(unused), listed_reg)
    return train, DatasetPlan(config, tuple(held_out), _assign(config, held_out, problems))


def plan_datasets(
    args: DataArgs,
    *,
    seed: int = 0,
    size_multiple: int = 64,
    validation_split: float = 0.0,
    validation_seed: int | None = None,
) -> DatasetPlans:
    """Validate and read the datasets into their plans (no report, nothing printed).

    ``size_multiple``: image sides must be multiples of it (SD1/SD2 64, SDXL 32; from the model family).
    Raises one ValueError listing every problem: configuration errors first, then unreadable images (unless
    ``--skip_corrupt_images``), bad captions, images too small, an empty dataset. ``validation_split``: fraction of
    each subset's training images held out (see :func:`split_validation`); ``validation_seed`` defaults to ``seed``.
    """
    configs, config_warnings = load_dataset_configs(args, size_multiple=size_multiple)
    problems = Problems("dataset configuration")
    problems.warnings += config_warnings
    for config in configs:
        _check_caching(config, args, problems)
    problems.raise_if_any()
    corrupt: list[str] = []
    split = (validation_split, seed if validation_seed is None else validation_seed)
    pairs = [_plan_dataset(c, args, problems, corrupt, split) for c in configs]
    datasets = tuple(train for train, _ in pairs)
    if corrupt:
        if args.skip_corrupt_images:
            problems.warn("--skip_corrupt_images", f"{len(corrupt)} unreadable images left out: " + "; ".join(corrupt))
        else:
            problems.errors += [f"{c} (pass --skip_corrupt_images to leave such files out)" for c in corrupt]
    if not any(d.records for d in datasets):
        folders = [s.image_dir or s.metadata_file for c in configs for s in c.subsets if not s.is_reg]
        problems.error("dataset", f"no training images found in {', '.join(map(str, folders)) or 'the datasets'}; "
                       f"put images ({', '.join(IMAGE_EXTENSIONS)}) there; captions are optional")  # fmt: skip
    problems.raise_if_any("dataset")
    held_out = tuple(val for _, val in pairs if val.records)
    return DatasetPlans(datasets, held_out, tuple(problems.warnings))
