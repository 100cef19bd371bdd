"""The dataset pipeline, from sd-scripts datasets on disk to batches: its public API.

The dataset pipeline: sd-scripts datasets (folders, metadata JSON, dataset TOML) -> captions -> buckets with a
report -> latent / text-encoder caches -> batches.

Typical use by a training script::

    data_args = DataArgs.from_args(args)                      # flags of library.data.data_args.add_dataset_args
    plan = build_datasets(data_args, grad_accum=..., num_processes=..., seed=..., size_multiple=64)
    latents = cache_latents(plan, encode_fn, vae_id) if data_args.cache_latents else None
    loader = make_loader(plan, rank=..., latent_cache=latents)
    for batch in loader.epoch(epoch, skip=k): ...
"""

from .captions import CaptionConfig, compose_caption
from .data_args import DataArgs
from .dataset_config import DatasetConfig, SubsetConfig, load_dataset_configs
from .dataset_plan import DatasetPlan
from .loader import Batch, Loader, make_loader
from .plan import Plan, build_datasets
from .precompute import LatentCache, TextCache, cache_latents, cache_text_encoder_outputs
from .report import BucketReport

__all__ = [
    "Batch",
    "BucketReport",
    "CaptionConfig",
    "DataArgs",
    "DatasetConfig",
    "DatasetPlan",
    "LatentCache",
    "Loader",
    "Plan",
    "SubsetConfig",
    "TextCache",
    "build_datasets",
    "cache_latents",
    "cache_text_encoder_outputs",
    "compose_caption",
    "load_dataset_configs",
    "make_loader",
]
