"""Argparse groups, defined once, with sd-scripts' flag names, types and defaults (SD_SCRIPTS.md §1.2).

Each group has one reader that turns the parsed namespace into a frozen dataclass; library code never takes a
Namespace. Dataset flags: ``add_dataset_args`` here, read by ``library.data.DataArgs.from_args``.
"""

from __future__ import annotations

import argparse

from library.data.schema import INTERPOLATIONS

# sd-scripts flags of the dataset group that sdtrain does not implement: using one is an error, never ignored.
UNSUPPORTED_DATASET_FLAGS: dict[str, str] = {
    "dataset_class": "custom dataset classes are not supported yet; use --dataset_config (TOML/JSON) instead",
    "debug_dataset": "--debug_dataset is not supported yet; the bucket report (--bucket_report) lists what will train",
    "conditioning_data_dir": (
        "--conditioning_data_dir on the command line is not supported (sd-scripts ignores it too); put "
        "conditioning_data_dir in a [[datasets.subsets]] table of a --dataset_config file, or use alpha masks "
        "(--alpha_mask) or <image>-masklabel.png files"
    ),
}


def _sources(parser: argparse._ArgumentGroup) -> None:
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
    parser.add_argument("--dataset_class", type=str, default=None, help="not supported yet")
    parser.add_argument(
        "--cache_info",
        action="store_true",
        help="accepted for sd-scripts compatibility; sdtrain reads only image headers, nothing to cache",
    )
    parser.add_argument("--debug_dataset", action="store_true", help="not supported yet")
    parser.add_argument("--prior_loss_weight", type=float, default=1.0, help="loss weight of regularisation images")
    parser.add_argument(
        "--conditioning_data_dir",
        type=str,
        default=None,
        help="not supported on the command line; use the dataset-config subset key",
    )
    parser.add_argument("--train_batch_size", type=int, default=1, help="batch size per process")


def _captions(parser: argparse._ArgumentGroup) -> None:
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


def _buckets(parser: argparse._ArgumentGroup) -> None:
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


def _augmentation(parser: argparse._ArgumentGroup) -> None:
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


def _caching(parser: argparse._ArgumentGroup) -> None:
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


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """Add the dataset, caption, bucket, augmentation, mask and caching flags (sd-scripts names and defaults)."""
    group = parser.add_argument_group("dataset")
    _sources(group)
    _captions(group)
    _buckets(group)
    _augmentation(group)
    _caching(group)
