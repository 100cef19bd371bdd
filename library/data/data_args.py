"""``DataArgs``: the dataset flag group as one frozen dataclass, built by its only reader ``DataArgs.from_args``."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, fields

from library.cli.parse import add_unsupported
from library.cli.problems import ConfigError

from .resolution import Size, parse_resolutions
from .schema import INTERPOLATIONS

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
    # set by the parser of a trainer that takes conditioning images (ControlNet-LLLite): conditioning_data_dir then
    # names them (library/data/conditioning.py) instead of loss masks
    conditioning_images: bool = False
    conditioning_data_dir: str | None = None
    control_images: bool = False  # not a flag: the model takes control images (library/data/control_images.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataArgs:
        """Read the parsed flags of :func:`add_dataset_args`; every problem is reported at once."""
        errors: list[str] = []  # (flags sdtrain refuses are refused at parsing: library.cli.parse.add_unsupported)
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
            raise ConfigError(errors, "dataset flags")
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


def add_dataset_args(parser: argparse.ArgumentParser, *, conditioning: bool = False) -> None:
    """Add the dataset, caption, bucket, augmentation, mask and caching flags (sd-scripts names and defaults).
    ``conditioning``: the trainer takes conditioning images (``--conditioning_data_dir`` read, as sd-scripts'
    ControlNet trainers read it)."""
    group = parser.add_argument_group("dataset")
    _add_sources_args(group, conditioning)
    _add_captions_args(group)
    _add_buckets_args(group)
    _add_augmentation_args(group)
    _add_caching_args(group)


def _add_sources_args(parser: argparse._ArgumentGroup, conditioning: bool = False) -> None:
    parser.add_argument(
        "--train_data_dir",
        type=str,
        default=None,
        help="parent folder of <repeats>_<class tokens> image folders (or, with --in_json, the image folder)",
    )
    parser.add_argument(
        "--reg_data_dir", type=str, default=None, help="parent folder of regularisation image folders (same naming)"
    )
    parser.add_argument("--in_json", type=str, default=None, help="metadata JSON for a fine-tune dataset")
    parser.add_argument("--dataset_repeats", type=int, default=1, help="repeats of the --in_json dataset")
    parser.add_argument(
        "--dataset_config",
        type=str,
        default=None,
        help="dataset config file (.toml or .json); replaces --train_data_dir/--reg_data_dir/--in_json",
    )
    add_unsupported(parser, "--dataset_class", "use --dataset_config (TOML/JSON) instead", type=str, default=None)
    parser.add_argument(
        "--cache_info",
        action="store_true",
        help="accepted for sd-scripts compatibility; sdtrain reads only image headers, nothing to cache",
    )
    add_unsupported(
        parser, "--debug_dataset", "the bucket report (--bucket_report) lists what will train", action="store_true"
    )
    parser.add_argument("--prior_loss_weight", type=float, default=1.0, help="loss weight of regularisation images")
    if conditioning:
        parser.add_argument(
            "--conditioning_data_dir",
            type=str,
            default=None,
            help="folder of conditioning images, one per training image of --train_data_dir with the same base name",
        )
        parser.set_defaults(conditioning_images=True)
    else:
        add_unsupported(
            parser,
            "--conditioning_data_dir",
            "on the command line (sd-scripts ignores it there too); put conditioning_data_dir in a "
            "[[datasets.subsets]] table of a --dataset_config file, or use alpha masks (--alpha_mask) or "
            "<image>-masklabel.png files",
            type=str,
            default=None,
        )
    parser.add_argument("--train_batch_size", type=int, default=1, help="batch size per process")


def _add_captions_args(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--caption_extension", type=str, default=".caption", help="extension of caption files")
    parser.add_argument("--caption_extention", type=str, default=None, help="legacy misspelling of --caption_extension")
    parser.add_argument("--shuffle_caption", action="store_true", help="shuffle the separated tags of each caption")
    parser.add_argument("--caption_separator", type=str, default=",", help="separator between tags")
    parser.add_argument("--keep_tokens", type=int, default=0, help="keep the first N tags in place when shuffling")
    parser.add_argument(
        "--keep_tokens_separator",
        type=str,
        default="",
        help="text before this separator is kept in place (and after a second one, as a fixed tail)",
    )
    parser.add_argument(
        "--secondary_separator",
        type=str,
        default=None,
        help="joins tags that shuffle/drop as one unit; replaced by --caption_separator afterwards",
    )
    parser.add_argument("--enable_wildcard", action="store_true", help="{a|b|c} picks one alternative per step")
    parser.add_argument("--caption_prefix", type=str, default=None, help="text put before every caption")
    parser.add_argument("--caption_suffix", type=str, default=None, help="text put after every caption")
    parser.add_argument("--caption_dropout_rate", type=float, default=0.0, help="probability of an empty caption")
    parser.add_argument(
        "--caption_dropout_every_n_epochs", type=int, default=0, help="all captions empty in every N-th epoch"
    )
    parser.add_argument("--caption_tag_dropout_rate", type=float, default=0.0, help="probability of dropping each tag")
    parser.add_argument("--token_warmup_min", type=int, default=1, help="number of flexible tags at step 0")
    parser.add_argument(
        "--token_warmup_step",
        type=float,
        default=0,
        help="steps (or fraction of max_train_steps if < 1) until all tags are used",
    )
    parser.add_argument(
        "--weighted_captions",
        action="store_true",
        help="A1111-style (tag:1.3) weights in captions (applied by the prompt encoder)",
    )


def _add_buckets_args(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--resolution",
        type=str,
        default=None,
        help='training resolution: "512", "768,512" (width,height), "896,960,1024" (several square '
        'resolutions, one drawn per sample and epoch) or explicitly "512;832x1216"',
    )
    parser.add_argument("--enable_bucket", action="store_true", help="aspect-ratio buckets")
    parser.add_argument("--min_bucket_reso", type=int, default=256, help="smallest bucket side")
    parser.add_argument("--max_bucket_reso", type=int, default=1024, help="largest bucket side")
    parser.add_argument("--bucket_reso_steps", type=int, default=64, help="bucket sides are multiples of this")
    parser.add_argument("--bucket_no_upscale", action="store_true", help="buckets from each image, never upscaling")
    parser.add_argument(
        "--resize_interpolation",
        type=str,
        default=None,
        choices=[i for i in INTERPOLATIONS if i != "box"],
        help="resize filter (default: area when downscaling, lanczos when upscaling)",
    )
    parser.add_argument(
        "--skip_image_resolution",
        type=str,
        default=None,
        help='skip images whose area is at most this ("768" or "512,768")',
    )
    parser.add_argument(
        "--bucket_report",
        type=str,
        default=None,
        help="save the bucket report here (.json gives JSON, anything else text)",
    )


def _add_augmentation_args(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--color_aug", action="store_true", help="weak colour augmentation (hue / gamma)")
    parser.add_argument("--flip_aug", action="store_true", help="random horizontal flips")
    parser.add_argument(
        "--face_crop_aug_range",
        type=str,
        default=None,
        help="face-centred crop scale range, e.g. 2.0,4.0 (face box from name_cx_cy_w_h file names)",
    )
    parser.add_argument("--random_crop", action="store_true", help="random instead of centre crop")
    parser.add_argument("--alpha_mask", action="store_true", help="use the alpha channel as the loss mask")
    parser.add_argument(
        "--masked_loss",
        action="store_true",
        help="weight the loss by a mask (conditioning_data_dir, <image>-masklabel.png or alpha)",
    )
    parser.add_argument(
        "--skip_corrupt_images",
        action="store_true",
        help="leave out unreadable images (listed in a warning) instead of stopping",
    )


def _add_caching_args(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--cache_latents", action="store_true", help="encode every image once and keep the latents")
    parser.add_argument(
        "--cache_latents_to_disk",
        action="store_true",
        help="also keep latents on disk (in --cache_dir, else next to the images)",
    )
    parser.add_argument("--vae_batch_size", type=int, default=1, help="batch size of the VAE while caching")
    parser.add_argument(
        "--skip_cache_check",
        action="store_true",
        help="trust existing cache files without opening them (their names already encode all inputs)",
    )
    parser.add_argument("--cache_text_encoder_outputs", action="store_true", help="encode every caption once")
    parser.add_argument(
        "--cache_text_encoder_outputs_to_disk", action="store_true", help="also keep text-encoder outputs on disk"
    )
    parser.add_argument(
        "--cache_dir",
        type=str,
        default=None,
        help="folder for latent / text-encoder caches, reused across runs (giving it keeps caches on disk there; without it, *_to_disk flags write next to each image)",
    )
