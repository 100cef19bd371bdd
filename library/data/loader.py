"""Batches for the training loop: ``make_loader(plan)`` -> ``Loader``; ``loader.epoch(e, skip=k)`` -> ``Batch``es.

Every random choice (batch order, bucket contents, resolution draw, caption line / shuffle / dropout / wildcard,
flip, crop, colour) is a pure function of (seed, epoch, sample) through ``seeding.rng_for``. So DataLoader workers
give the same batches as the main process, and ``epoch(e, skip=k)`` after a resume yields exactly the batches an
uninterrupted run would have yielded from step k on, without loading the skipped ones.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from . import control_images
from .batching import BatchSpec, epoch_batches, shard
from .captions import compose_caption, resolve_warmup_steps
from .conditioning import render_conditioning
from .images import render_sample
from .plan import Plan
from .precompute import LatentCache, TextCache
from .seeding import rng_for


def ignore_interrupts(worker_id: int) -> None:
    """DataLoader workers ignore Ctrl-C: the training process handles it (saves a state, then stops the workers);
    otherwise every worker would also report the interrupt, or die with a traceback mid-batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass
class Batch:
    """One batch from one bucket (all samples share the size).

    ``latents`` (B, C, H/8, W/8), cached and already scaled, or ``pixels`` (B, 3, H, W) in [-1, 1];
    ``captions`` (B strings, composed for this step) and, with cached text-encoder outputs,
    ``text_encoder_outputs`` (dict of (B, ...) tensors); ``loss_weights`` (B,) float: 1.0, or
    ``--prior_loss_weight`` for regularisation images; ``masks`` (B, 1, H, W) in [0, 1] or None;
    ``original_sizes``, ``crop_top_lefts``, ``target_sizes`` (B, 2) int64 in **(h, w) order** — (top, left) for the
    crop — as SDXL's size conditioning ``add_time_ids = original + crop + target`` expects; the crop is the one
    actually applied, in pixels of the resized image, mirrored for flipped samples. ``is_reg`` (B,) bool.
    """

    latents: torch.Tensor | None
    pixels: torch.Tensor | None
    captions: list[str]
    text_encoder_outputs: dict[str, torch.Tensor] | None
    loss_weights: torch.Tensor
    masks: torch.Tensor | None
    original_sizes: torch.Tensor
    crop_top_lefts: torch.Tensor
    target_sizes: torch.Tensor
    image_paths: list[str]
    is_reg: torch.Tensor
    flipped: torch.Tensor
    custom_attributes: list[dict] = field(default_factory=list)
    # (B, 3, H, W) float in [-1, 1]: each sample's conditioning image, cut like it (library/data/conditioning.py)
    conditioning_images: torch.Tensor | None = None
    controls: list[torch.Tensor] | None = None  # the edit models' control images: (B, C, h, w) per index
    epoch: int = 0
    index: int = 0  # position of this batch in this process's epoch
    step: int = 0  # optimizer step this batch belongs to (index over epochs // grad_accum)

    def _map(self, fn) -> Batch:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = fn(v)
            elif isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values()):
                v = {k: fn(t) for k, t in v.items()}
            elif isinstance(v, list) and v and all(isinstance(t, torch.Tensor) for t in v):
                v = [fn(t) for t in v]
            out[f.name] = v
        return Batch(**out)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
        """Move tensors to ``device``; floating tensors (not the integer size fields) also to ``dtype``."""
        return self._map(lambda t: t.to(device, dtype) if dtype is not None and t.is_floating_point() else t.to(device))

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def __len__(self) -> int:
        return len(self.image_paths)


class _Epochs:
    """Per-process batch lists, memoised (pure functions of the plan, seed and epoch)."""

    def __init__(self, plan: Plan, rank: int, world_size: int) -> None:
        self.plan, self.rank, self.world_size = plan, rank, world_size
        self._specs: dict[int, list[BatchSpec]] = {}
        self._counts: dict[int, int] = {}

    def specs(self, epoch: int) -> list[BatchSpec]:
        if epoch not in self._specs:
            if len(self._specs) > 2:
                self._specs.pop(min(self._specs))
            batches = epoch_batches(self.plan.datasets, self.plan.seed, epoch)
            self._specs[epoch] = shard(batches, self.rank, self.world_size)
        return self._specs[epoch]

    def count(self, epoch: int) -> int:
        if epoch not in self._counts:
            self._counts[epoch] = len(self.specs(epoch))
        return self._counts[epoch]

    def batches_before(self, epoch: int) -> int:
        return sum(self.count(e) for e in range(epoch))


class _EpochDataset(Dataset):
    """Map-style dataset indexed by (epoch, position); used with ``batch_size=None``."""

    def __init__(self, loader: Loader) -> None:
        self.plan = loader.plan
        self.epochs = _Epochs(loader.plan, loader.rank, loader.world_size)
        self.latents, self.text = loader.latent_cache, loader.text_cache
        self.warmup = [
            [resolve_warmup_steps(s.captions, loader.max_train_steps) for s in ds.config.subsets]
            for ds in loader.plan.datasets
        ]
        self.any_warmup = any(any(w) for w in self.warmup)

    def __len__(self) -> int:
        return self.epochs.count(0)

    def _sample(self, spec: BatchSpec, i: int, r: int, epoch: int, step: int) -> dict:
        d, k = spec.dataset, spec.resolution
        ds = self.plan.datasets[d]
        rec = ds.records[i]
        sub = ds.subset(rec)
        a = ds.assignments[k][i]
        key = (self.plan.seed, epoch, d, i, r)
        caption = compose_caption(
            rec.caption,
            sub.captions,
            rng_for(*key, "caption"),
            epoch=epoch,
            step=step,
            warmup_steps=self.warmup[d][rec.subset_index],
        )
        flip = sub.flip_aug and rng_for(*key, "flip").random() < 0.5
        out = {"caption": caption, "flip": flip, "record": rec, "subset": sub, "bucket": a.bucket}
        if self.latents is not None:
            entry = self.latents.get(d, i, k, flip)
            left, top = (a.resized[0] - a.bucket[0]) // 2, (a.resized[1] - a.bucket[1]) // 2
            if flip:
                left = a.resized[0] - left - a.bucket[0]
            out.update(latents=entry["latents"], mask=entry.get("mask"), crop=(left, top))
            out["controls"] = control_images.cached(self.latents, (d, i, k))
        else:
            pixels, mask, crop, _ = render_sample(
                rec.path,
                a,
                flip=flip,
                mask_path=rec.mask_path,
                alpha_mask=sub.alpha_mask,
                crop_rng=rng_for(*key, "crop") if sub.random_crop else None,
                color_rng=rng_for(*key, "color") if sub.color_aug else None,
                face=rec.face,
                face_range=sub.face_crop_aug_range,
                face_rng=rng_for(*key, "face"),
                interpolation=sub.resize_interpolation,
            )
            out.update(pixels=pixels, mask=mask, crop=crop, controls=control_images.rendered(ds, i, k))
        if rec.conditioning_path is not None:
            out["conditioning"] = render_conditioning(
                rec.conditioning_path, a, flip=flip, interpolation=sub.resize_interpolation
            )
        if self.text is not None:
            out["text"] = self.text.get(caption, self.text.controls.get((d, i, k), ()))
        return out

    def __getitem__(self, index: tuple[int, int]) -> Batch:
        epoch, j = index
        spec = self.epochs.specs(epoch)[j]
        step = (self.epochs.batches_before(epoch) + j) // self.plan.grad_accum if self.any_warmup else 0
        samples = [self._sample(spec, i, r, epoch, step) for i, r in spec.samples]
        return _collate(samples, self.plan.args.prior_loss_weight, epoch, j, step)


def _stack_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack``, the tensors first zero-padded along their first axis to the longest when their lengths
    differ (encoders whose outputs are as long as each caption, e.g. Qwen-Image's: zero states, mask 0)."""
    longest = max(t.shape[0] if t.ndim else 0 for t in tensors)
    if all(t.ndim == 0 or t.shape[0] == longest for t in tensors):
        return torch.stack(tensors)
    padded = []
    for t in tensors:
        fill = t.new_zeros((longest - t.shape[0], *t.shape[1:]))
        padded.append(torch.cat([t, fill]))
    return torch.stack(padded)


def _collate(samples: list[dict], prior_loss_weight: float, epoch: int, index: int, step: int) -> Batch:
    masks = None
    if any(s["mask"] is not None for s in samples):
        w, h = samples[0]["bucket"]
        masks = torch.stack([s["mask"] if s["mask"] is not None else torch.ones(1, h, w) for s in samples])
    text = None
    if "text" in samples[0]:
        text = {k: _stack_padded([s["text"][k] for s in samples]) for k in samples[0]["text"]}
    recs = [s["record"] for s in samples]
    return Batch(
        latents=torch.stack([s["latents"] for s in samples]) if "latents" in samples[0] else None,
        pixels=torch.stack([s["pixels"] for s in samples]) if "pixels" in samples[0] else None,
        captions=[s["caption"] for s in samples],
        text_encoder_outputs=text,
        loss_weights=torch.tensor([prior_loss_weight if r.is_reg else 1.0 for r in recs], dtype=torch.float32),
        masks=masks,
        original_sizes=torch.tensor([(r.size[1], r.size[0]) for r in recs], dtype=torch.int64),
        crop_top_lefts=torch.tensor([(s["crop"][1], s["crop"][0]) for s in samples], dtype=torch.int64),
        target_sizes=torch.tensor([(s["bucket"][1], s["bucket"][0]) for s in samples], dtype=torch.int64),
        image_paths=[r.path for r in recs],
        is_reg=torch.tensor([r.is_reg for r in recs], dtype=torch.bool),
        flipped=torch.tensor([s["flip"] for s in samples], dtype=torch.bool),
        custom_attributes=[dict(s["subset"].custom_attributes) for s in samples],
        conditioning_images=torch.stack([s["conditioning"] for s in samples]) if "conditioning" in samples[0] else None,
        controls=control_images.stack([s["controls"] for s in samples], [r.path for r in recs]),
        epoch=epoch,
        index=index,
        step=step,
    )


class _EpochSampler(Sampler):
    """Yields (epoch, position) for the current epoch from ``skip`` on; set before each epoch."""

    def __init__(self, epochs: _Epochs) -> None:
        self.epochs, self.epoch, self.skip = epochs, 0, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, j) for j in range(self.skip, self.epochs.count(self.epoch)))

    def __len__(self) -> int:
        return max(0, self.epochs.count(self.epoch) - self.skip)


@dataclass
class Loader:
    """Batches of a ``Plan`` for one process. Build with ``make_loader``."""

    plan: Plan
    rank: int = 0
    world_size: int = 1
    num_workers: int = 0
    persistent_workers: bool = False
    pin_memory: bool = False
    latent_cache: LatentCache | None = None
    text_cache: TextCache | None = None
    max_train_steps: int | None = None

    def __post_init__(self) -> None:
        self._dataset = _EpochDataset(self)
        self._sampler = _EpochSampler(self._dataset.epochs)
        # torch's loader pins only where an accelerator exists; the simulated device (a plan) pins here instead
        self._pins_itself = self.pin_memory and not torch.accelerator.is_available()
        self._loader = DataLoader(
            self._dataset,
            batch_size=None,
            sampler=self._sampler,
            num_workers=self.num_workers,
            persistent_workers=self.persistent_workers and self.num_workers > 0,
            pin_memory=self.pin_memory and not self._pins_itself,
            # its own generator: creating an iterator must not draw from the global RNG, which the training step
            # uses (dropout), or a resumed run would drift from the uninterrupted one
            generator=torch.Generator().manual_seed(self.plan.seed),
            worker_init_fn=ignore_interrupts,
        )

    def num_batches(self, epoch: int = 0) -> int:
        """Batches this process runs in ``epoch`` (constant unless there are several training resolutions)."""
        return self._dataset.epochs.count(epoch)

    def steps_per_epoch(self, epoch: int = 0) -> int:
        return math.ceil(self.num_batches(epoch) / self.plan.grad_accum)

    def __len__(self) -> int:
        return self.num_batches(0)

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        """The batches of ``epoch`` (0-based) for this process, starting after the first ``skip`` batches."""
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        self._sampler.epoch, self._sampler.skip = epoch, skip
        if self._pins_itself:
            return map(Batch.pin_memory, self._loader)  # (keeps no unpinned batch alive, as torch's pinning)
        return iter(self._loader)


def make_loader(
    plan: Plan,
    *,
    rank: int = 0,
    world_size: int | None = None,
    num_workers: int = 0,
    persistent_workers: bool = False,
    pin_memory: bool = False,
    latent_cache: LatentCache | None = None,
    text_cache: TextCache | None = None,
    max_train_steps: int | None = None,
) -> Loader:
    """A ``Loader`` for process ``rank`` of ``world_size`` (default: the plan's ``num_processes``).

    Pass the caches returned by ``cache_latents`` / ``cache_text_encoder_outputs`` when caching is on (the
    batches then carry latents / encoder outputs instead of pixels). ``max_train_steps`` is needed only for a
    fractional ``token_warmup_step``.
    """
    if plan.args.cache_latents and latent_cache is None:
        raise ValueError("--cache_latents is set but no latent_cache was given; call cache_latents(plan, ...) first")
    if plan.args.cache_text_encoder_outputs and text_cache is None:
        raise ValueError(
            "--cache_text_encoder_outputs is set but no text_cache was given; call cache_text_encoder_outputs first"
        )
    return Loader(
        plan,
        rank,
        plan.num_processes if world_size is None else world_size,
        num_workers,
        persistent_workers,
        pin_memory,
        latent_cache,
        text_cache,
        max_train_steps,
    )
