"""Filling the latent and text-encoder caches before training, and reading them back during it.

The caching step: encode every (image, bucket, flip) once with the caller's VAE, and every possible caption once
with the caller's text encoders, before training.

The encoders are plain callables, so this module does not depend on the model-family code:

* ``encode_fn(pixels)``: (B, 3, H, W) float in [-1, 1] -> (B, C, H/8, W/8) latents, already scaled by the VAE's
  scaling factor (e.g. ``vae.encode(x).latent_dist.sample() * vae.config.scaling_factor``);
* ``encode_text_fn(captions)``: list of B strings -> dict of tensors with a leading batch dimension B.

Each comes with an identity string (e.g. a hash of the encoder weights and dtype) that is part of every cache key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from . import control_images
from .cache_store import CacheStore, Tensors, file_digest, latent_key, text_key
from .captions import possible_captions
from .images import render_sample
from .plan import Plan

logger = logging.getLogger(__name__)

EncodeFn = Callable[[torch.Tensor], torch.Tensor]
EncodeTextFn = Callable[[list[str]], Tensors]
LatentSlot = tuple[int, int, int, bool]  # (dataset, record, resolution index, flipped)


@dataclass
class LatentCache:
    """Cached latents (and masks) of a plan; ``get`` returns ``{"latents": (C, h, w), "mask"?: (1, H, W)}``."""

    store: CacheStore
    keys: dict[LatentSlot, str] = field(default_factory=dict)
    anchors: dict[LatentSlot, str] = field(default_factory=dict)
    # (dataset, record, resolution) -> the (key, anchor) of each control image's latents (control_images.py)
    controls: dict[tuple[int, int, int], list[tuple[str, str]]] = field(default_factory=dict)

    def get(self, dataset: int, record: int, resolution: int, flip: bool) -> Tensors:
        slot = (dataset, record, resolution, flip)
        return self.store.load(self.keys[slot], self.anchors[slot])


@dataclass
class TextCache:
    """Cached text-encoder outputs; ``get(caption)`` returns the encoder's dict without the batch dimension.
    ``with_controls``: entries are per (caption, the sample's control images as (path, (width, height) trained at),
    ``control_images.sized``), for prompt encoders that see them (the Qwen-Image edit models); ``get(caption,
    controls)``, with ``controls[(dataset, record, resolution)]`` the sample's pairs (found once, while caching)."""

    store: CacheStore
    keys: dict[str | tuple, str] = field(default_factory=dict)
    anchors: dict[str | tuple, str] = field(default_factory=dict)
    with_controls: bool = False
    controls: dict[tuple[int, int, int], tuple] = field(default_factory=dict)

    def slot(self, caption: str, controls: tuple = ()) -> str | tuple:
        return (caption, tuple(controls)) if self.with_controls and controls else caption

    def get(self, caption: str, controls: tuple = ()) -> Tensors:
        slot = self.slot(caption, controls)
        if slot not in self.keys:
            raise KeyError(
                f"caption not cached: {caption!r}" + (f" with control images {controls}" if controls else "")
            )
        return self.store.load(self.keys[slot], self.anchors[slot])


def _store(plan: Plan, kind: str, to_disk: bool) -> CacheStore:
    folder = plan.args.cache_dir if to_disk or plan.args.cache_dir else None
    return CacheStore(kind, folder=folder, next_to_images=to_disk and folder is None)


def _slots(plan: Plan, encoder_id: str) -> list[tuple[LatentSlot, str, object]]:
    """(slot, key, assignment) for every latent the plan can ask for."""
    out = []
    for d, ds in enumerate(plan.datasets):
        for i, rec in enumerate(ds.records):
            sub = ds.subset(rec)
            digest = file_digest(rec.path)
            mask_digest = file_digest(rec.mask_path) if rec.mask_path else None
            for k in range(len(ds.config.resolutions)):
                a = ds.assignments[k][i]
                crop = ((a.resized[0] - a.bucket[0]) // 2, (a.resized[1] - a.bucket[1]) // 2)
                for flip in (False, True) if sub.flip_aug else (False,):
                    key = latent_key(
                        image_digest=digest,
                        encoder_id=encoder_id,
                        bucket=a.bucket,
                        resized=a.resized,
                        crop=crop,
                        flip=flip,
                        interpolation=sub.resize_interpolation,
                        mask_digest=mask_digest,
                        alpha_mask=sub.alpha_mask and rec.mask_path is None,
                    )
                    out.append(((d, i, k, flip), key, a))
    return out


def _shape_ok(bucket: tuple[int, int], downscale: int = 8) -> Callable[[dict], bool]:
    expected = (bucket[1] // downscale, bucket[0] // downscale)
    return lambda shapes: "latents" in shapes and tuple(shapes["latents"][-2:]) == expected


def _encode_latents(plan: Plan, todo: list, store: CacheStore, encode_fn: EncodeFn, show_progress: bool,
                    downscale: int = 8) -> None:  # fmt: skip
    todo = sorted(todo, key=lambda t: t[2].bucket)
    bs = plan.args.vae_batch_size
    bar = tqdm(total=len(todo), desc="caching latents", unit="img", disable=not show_progress)
    start = 0
    while start < len(todo):
        bucket = todo[start][2].bucket
        chunk = [t for t in todo[start : start + bs] if t[2].bucket == bucket]
        rendered = []
        for (d, i, _k, flip), _key, a in chunk:
            ds = plan.datasets[d]
            rec, sub = ds.records[i], ds.subset(ds.records[i])
            rendered.append(
                render_sample(
                    rec.path,
                    a,
                    flip=flip,
                    mask_path=rec.mask_path,
                    alpha_mask=sub.alpha_mask,
                    interpolation=sub.resize_interpolation,
                )
            )
        with torch.no_grad():
            latents = encode_fn(torch.stack([r[0] for r in rendered]))
        expected = (bucket[1] // downscale, bucket[0] // downscale)
        if tuple(latents.shape[-2:]) != expected or latents.shape[0] != len(chunk):
            raise ValueError(f"encode_fn returned {tuple(latents.shape)} for {len(chunk)} images at {bucket}")
        for (slot, key, _a), lat, (_px, mask, _off, _rs) in zip(chunk, latents, rendered):
            entry = {"latents": lat} | ({"mask": mask} if mask is not None else {})
            store.save(key, plan.datasets[slot[0]].records[slot[1]].path, entry)
        bar.update(len(chunk))
        start += len(chunk)
    bar.close()


def cache_latents(
    plan: Plan,
    encode_fn: EncodeFn,
    encoder_id: str,
    *,
    rank: int = 0,
    world_size: int = 1,
    show_progress: bool = True,
    downscale: int = 8,
) -> LatentCache:
    """Encode every latent the plan can use that is not cached yet, ``--vae_batch_size`` images at a time.
    ``downscale``: the VAE's spatial factor (8, or the family's ``latent_downscale``): the latents' size checked
    against the bucket's.

    With ``world_size > 1`` and a disk cache, each process encodes its share; call a barrier afterwards (e.g.
    ``accelerator.wait_for_everyone()``) before training. In-memory caches are filled completely on each process.
    """
    store = _store(plan, "latent", plan.args.cache_latents_to_disk)
    slots = _slots(plan, encoder_id)
    cache = LatentCache(store)
    todo, seen = [], set()
    for slot, key, a in slots:
        anchor = plan.datasets[slot[0]].records[slot[1]].path
        cache.keys[slot], cache.anchors[slot] = key, anchor
        if key in seen:
            continue
        seen.add(key)
        check = None if plan.args.skip_cache_check else _shape_ok(a.bucket, downscale)
        if not store.has(key, anchor, check):
            todo.append((slot, key, a))
    if store.on_disk and world_size > 1:
        todo = todo[rank::world_size]
    logger.info("latent cache: %d of %d entries to encode", len(todo), len(seen))
    _encode_latents(plan, todo, store, encode_fn, show_progress, downscale)
    control_images.cache_controls(plan, cache, encode_fn, encoder_id, plan.args.vae_batch_size, downscale)
    return cache


def cache_text_encoder_outputs(
    plan: Plan,
    encode_text_fn: EncodeTextFn,
    encoder_id: str,
    *,
    batch_size: int | None = None,
    show_progress: bool = True,
    with_controls: bool = False,
) -> TextCache:
    """Encode every caption a sample can take (each line of a multi-line caption; "" when captions can be
    dropped) that is not cached yet. ``batch_size`` defaults to the first dataset's batch size. ``with_controls``:
    one entry per caption and sample's control images at each size a resolution trains them at (keyed on their
    bytes and sizes), ``encode_text_fn(captions, controls)`` given each caption's (control image path, (width,
    height)) pairs."""
    store = _store(plan, "text", plan.args.cache_text_encoder_outputs_to_disk)
    cache = TextCache(store, with_controls=with_controls)
    digests: dict[str, str] = {}
    for d, ds in enumerate(plan.datasets):
        for i, rec in enumerate(ds.records):
            resolutions = range(len(ds.config.resolutions)) if with_controls and rec.controls else ()
            for k in resolutions:
                cache.controls[(d, i, k)] = control_images.sized(ds, i, k)
            for controls in dict.fromkeys(cache.controls[(d, i, k)] for k in resolutions) or [()]:
                for caption in possible_captions(rec.caption, ds.subset(rec).captions):
                    slot = cache.slot(caption, controls)
                    if slot not in cache.keys:
                        seen = [(digests.setdefault(p, file_digest(p)), size) for p, size in controls]
                        cache.keys[slot] = text_key(caption=caption, encoder_id=encoder_id, controls=seen)
                        cache.anchors[slot] = rec.path
    todo = [c for c in cache.keys if not store.has(cache.keys[c], cache.anchors[c])]
    bs = batch_size or plan.datasets[0].config.batch_size
    logger.info("text-encoder cache: %d of %d captions to encode", len(todo), len(cache.keys))
    for start in tqdm(range(0, len(todo), bs), desc="caching text", unit="batch", disable=not show_progress):
        chunk = todo[start : start + bs]
        captions = [s if isinstance(s, str) else s[0] for s in chunk]
        with torch.no_grad():
            if with_controls:
                out = encode_text_fn(captions, [() if isinstance(s, str) else s[1] for s in chunk])
            else:
                out = encode_text_fn(captions)
        for j, slot in enumerate(chunk):
            store.save(cache.keys[slot], cache.anchors[slot], {k: v[j] for k, v in out.items()})
    return cache
