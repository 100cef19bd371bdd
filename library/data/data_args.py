"""``DataArgs``: the dataset flag group as one frozen dataclass, built by its only reader ``DataArgs.from_args``."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, fields

from .resolution import Size, parse_resolutions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataArgs:
    """Every dataset/caption/bucket/augmentation/mask/caching flag, typed, with sd-scripts' defaults.

    ``resolutions`` is the parsed ``--resolution`` (empty when not given); ``face_crop_aug_range`` the parsed pair.
    ``cache_latents`` is true when either latent-caching flag is given, likewise for text-encoder outputs.
    """

    train_data_dir: str | None = None
    reg_data_dir: str | None = None
    in_json: str | None = None
    dataset_repeats: int = 1
    dataset_config: str | None = None
    prior_loss_weight: float = 1.0
    train_batch_size: int = 1
    caption_extension: str = ".caption"
    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    secondary_separator: str | None = None
    enable_wildcard: bool = False
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    token_warmup_min: int = 1
    token_warmup_step: float = 0
    weighted_captions: bool = False
    resolutions: tuple[Size, ...] = ()
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False
    resize_interpolation: str | None = None
    skip_image_resolution: Size | None = None
    bucket_report: str | None = None
    color_aug: bool = False
    flip_aug: bool = False
    face_crop_aug_range: tuple[float, float] | None = None
    random_crop: bool = False
    alpha_mask: bool = False
    masked_loss: bool = False
    skip_corrupt_images: bool = False
    cache_latents: bool = False
    cache_latents_to_disk: bool = False
    vae_batch_size: int = 1
    skip_cache_check: bool = False
    cache_text_encoder_outputs: bool = False
    cache_text_encoder_outputs_to_disk: bool = False
    cache_dir: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataArgs:
        """Read the parsed flags of ``library.args.add_dataset_args``; every problem is reported at once."""
        errors: list[str] = []  # (flags sdtrain refuses are refused at parsing: library.config.add_unsupported)
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if getattr(args, "caption_extention", None):
            values["caption_extension"] = args.caption_extention
        if getattr(args, "cache_info", False):
            logger.warning("--cache_info: sdtrain reads only image headers and has nothing to cache; flag ignored")
        values["resolutions"] = _parse_flag(args, "resolution", parse_resolutions, errors) or ()
        skip = _parse_flag(args, "skip_image_resolution", parse_resolutions, errors)
        values["skip_image_resolution"] = skip[0] if skip else None
        values["face_crop_aug_range"] = _parse_flag(args, "face_crop_aug_range", _parse_pair, errors)
        values["cache_latents"] = bool(values.get("cache_latents") or values.get("cache_latents_to_disk"))
        values["cache_text_encoder_outputs"] = bool(
            values.get("cache_text_encoder_outputs") or values.get("cache_text_encoder_outputs_to_disk")
        )
        errors += _range_errors(values)
        if values.get("dataset_repeats", 1) < 1 and not values.get("in_json"):
            logger.info(
                "--dataset_repeats %s is not used: it sets the repeats of an --in_json dataset only (as in "
                "sd-scripts); folder datasets take repeats from their names",
                values["dataset_repeats"],
            )
        if errors:
            raise ValueError("invalid dataset flags:\n" + "\n".join(f"  - {e}" for e in errors))
        return cls(**values)

    def cli_fallbacks(self) -> dict[str, object]:
        """Values the dataset-config resolution falls back to (sd-scripts maps CLI names onto dataset keys)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["batch_size"] = self.train_batch_size
        out["num_repeats"] = self.dataset_repeats if self.in_json or self.dataset_repeats >= 1 else None
        out["resolution"] = self.resolutions or None
        return out


def _parse_flag(args: argparse.Namespace, name: str, parse, errors: list[str]):
    raw = getattr(args, name, None)
    if raw is None:
        return None
    try:
        return parse(raw)
    except ValueError as e:
        errors.append(f"--{name}: {e}")
        return None


def _parse_pair(text: str) -> tuple[float, float]:
    try:
        low, high = (float(p) for p in str(text).split(","))
    except ValueError:
        raise ValueError(f'expected two numbers like "2.0,4.0", got "{text}"') from None
    if not 0 < low <= high:
        raise ValueError(f"expected 0 < first <= second, got {low},{high}")
    return low, high


def _range_errors(v: dict) -> list[str]:
    checks = [
        ("train_batch_size", v.get("train_batch_size", 1) >= 1, "must be >= 1"),
        ("dataset_repeats", not v.get("in_json") or v.get("dataset_repeats", 1) >= 1, "must be >= 1 with --in_json"),
        ("vae_batch_size", v.get("vae_batch_size", 1) >= 1, "must be >= 1"),
        ("keep_tokens", v.get("keep_tokens", 0) >= 0, "must be >= 0"),
        ("caption_dropout_rate", 0 <= v.get("caption_dropout_rate", 0) <= 1, "must be between 0 and 1"),
        ("caption_tag_dropout_rate", 0 <= v.get("caption_tag_dropout_rate", 0) <= 1, "must be between 0 and 1"),
        ("caption_dropout_every_n_epochs", v.get("caption_dropout_every_n_epochs", 0) >= 0, "must be >= 0"),
        ("token_warmup_step", v.get("token_warmup_step", 0) >= 0, "must be >= 0"),
        ("bucket_reso_steps", v.get("bucket_reso_steps", 64) >= 1, "must be >= 1"),
        ("prior_loss_weight", v.get("prior_loss_weight", 1.0) >= 0, "must be >= 0"),
    ]
    return [f"--{name}: {text}, got {v.get(name)}" for name, ok, text in checks if not ok]
