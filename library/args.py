"""Argparse groups with sd-scripts' flag names, types and defaults, defined once.

Each ``add_*_args(parser)`` adds one group; each group has one reader that builds a frozen dataclass (in the module
that owns the concept), so nothing past parsing takes an ``argparse.Namespace``. Flags that sd-scripts has but we do
not support yet are added with :func:`library.config.add_unsupported`: using them is an error, never a no-op.
"""

from __future__ import annotations

import argparse

from library.config import add_unsupported
from library.data.schema import INTERPOLATIONS
from library.run_files import METADATA_NAMES


def add_run_groups(
    parser: argparse.ArgumentParser, default_format: str | None = "safetensors", deepspeed: bool = False
) -> None:
    """The groups every training recipe takes, in order: logging, model, dataset, run, save (``default_format``:
    ``--save_model_as``'s default), state, trackers, validation, EMA, noise, loss. ``deepspeed``: the DeepSpeed
    flags are read (full-model recipes) instead of refused."""
    add_logging_args(parser)
    add_model_args(parser)
    add_dataset_args(parser)
    add_run_args(parser, deepspeed)
    add_save_args(parser, default_format)
    for add in (add_state_args, add_tracker_args, add_validation_args, add_ema_args, add_noise_args, add_loss_args):
        add(parser)


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("console logging")
    g.add_argument(
        "--console_log_level",
        type=str,
        default=None,
        choices=["CRITICAL", "DEBUG", "ERROR", "INFO", "WARNING"],
        help="logging level (default INFO)",
    )
    g.add_argument("--console_log_file", type=str, default=None, help="log to this file instead of stderr")
    g.add_argument("--console_log_simple", action="store_true", help="plain log lines")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument(
        "--pretrained_model_name_or_path",
        type=str,
        default=None,
        help="base model: a diffusers folder or a single-file checkpoint (.safetensors / .ckpt)",
    )
    g.add_argument("--v2", action="store_true", help="the base model is Stable Diffusion 2.x")
    g.add_argument("--v_parameterization", action="store_true", help="train with v-prediction (SD2 768-v, v-pred SDXL)")
    g.add_argument("--vae", type=str, default=None, help="replace the model's VAE (diffusers folder or VAE file)")
    g.add_argument("--tokenizer_cache_dir", type=str, default=None, help="folder with tokenizers (offline use)")
    g.add_argument(
        "--disable_mmap_load_safetensors",
        action="store_true",
        help="read model safetensors files into memory whole instead of memory-mapping them",
    )
    g.add_argument("--clip_skip", type=int, default=None, help="use the n-th last text-encoder layer (n >= 1)")
    g.add_argument(
        "--max_token_length", type=int, default=None, choices=[None, 150, 225], help="75 (default), 150 or 225 tokens"
    )
    g.add_argument("--no_half_vae", action="store_true", help="keep the VAE in fp32 under mixed precision")
    g.add_argument("--lowram", action="store_true", help="load models straight to the GPU")
    g.add_argument(
        "--highvram",
        action="store_true",
        help="accepted for sd-scripts: sdtrain never empties the CUDA cache between caching batches (always on)",
    )


def add_run_args(parser: argparse.ArgumentParser, deepspeed: bool = False) -> None:
    """Run length, batching, data loading, seed, precision, attention and distributed settings."""
    g = parser.add_argument_group("run")
    g.add_argument("--max_train_steps", type=int, default=1600, help="training steps")
    g.add_argument("--max_train_epochs", type=int, default=None, help="training epochs (overrides --max_train_steps)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--max_data_loader_n_workers", type=int, default=8, help="DataLoader workers (capped at CPUs)")
    g.add_argument("--persistent_data_loader_workers", action="store_true", help="keep workers between epochs")
    g.add_argument("--seed", type=int, default=None, help="random seed (random if omitted; stored as ss_seed)")
    g.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    g.add_argument("--full_fp16", action="store_true", help="fp16 trained weights and gradients")
    g.add_argument("--full_bf16", action="store_true", help="bf16 trained weights and gradients")
    g.add_argument("--fp8_base", action="store_true", help="store the frozen base model in float8 (e4m3fn)")
    g.add_argument("--fp8_base_unet", action="store_true", help="store only the frozen UNet in float8")
    g.add_argument("--gradient_checkpointing", action="store_true")
    add_unsupported(
        g,
        "--cpu_offload_checkpointing",
        "diffusers' SD/SDXL UNets cannot offload checkpointed activations; use --gradient_checkpointing",
        action="store_true",
    )
    g.add_argument("--mem_eff_attn", action="store_true", help="memory-efficient attention (torch SDPA kernel)")
    g.add_argument("--xformers", action="store_true", help="xformers attention (needs the xformers package + CUDA)")
    g.add_argument("--sdpa", action="store_true", help="torch scaled_dot_product_attention (the default)")
    g.add_argument("--torch_compile", action="store_true", help="torch.compile the UNet")
    g.add_argument("--dynamo_backend", type=str, default="inductor", help="torch.compile backend")
    g.add_argument("--ddp_timeout", type=int, default=None, help="DDP timeout in minutes")
    g.add_argument("--ddp_gradient_as_bucket_view", action="store_true")
    g.add_argument("--ddp_static_graph", action="store_true")
    if deepspeed:  # full-model trainers: the real flags (library/engines.py)
        from library.engines import add_deepspeed_args

        add_deepspeed_args(parser)
        return
    reason = "multi-GPU runs use accelerate's DDP (accelerate config / --multi_gpu)"
    add_unsupported(g, "--deepspeed", reason, action="store_true")
    add_unsupported(g, "--zero_stage", reason, type=int, default=2, choices=[0, 1, 2, 3])
    for flag in ("--offload_optimizer_device", "--offload_param_device"):
        add_unsupported(g, flag, reason, type=str, default=None, choices=[None, "cpu", "nvme"])
    for flag in ("--offload_optimizer_nvme_path", "--offload_param_nvme_path"):
        add_unsupported(g, flag, reason, type=str, default=None)
    for flag in ("--zero3_init_flag", "--zero3_save_16bit_model", "--fp16_master_weights_and_gradients"):
        add_unsupported(g, flag, reason, action="store_true")


def add_save_args(parser: argparse.ArgumentParser, default_format: str | None = "safetensors") -> None:
    g = parser.add_argument_group("saving")
    g.add_argument("--output_dir", type=str, default=None, help="folder for the trained files")
    g.add_argument("--output_name", type=str, default=None, help="file stem of the trained files")
    g.add_argument(
        "--save_model_as",
        type=str,
        default=default_format,
        choices=[None, "ckpt", "pt", "safetensors", "diffusers", "diffusers_safetensors"],
    )
    g.add_argument("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"])
    g.add_argument("--save_every_n_epochs", type=int, default=None)
    g.add_argument("--save_every_n_steps", type=int, default=None)
    g.add_argument("--save_n_epoch_ratio", type=int, default=None, help="save at least N files over the run")
    g.add_argument("--save_last_n_epochs", type=int, default=None, help="keep only the last N epoch files")
    g.add_argument("--save_last_n_steps", type=int, default=None, help="keep only files of the last N steps")
    g.add_argument("--no_metadata", action="store_true", help="write only the minimal metadata")
    g.add_argument("--training_comment", type=str, default=None, help="stored as ss_training_comment")
    reason = "upload the files yourself, e.g. with `huggingface-cli upload`"
    for flag in (
        "--huggingface_repo_id",
        "--huggingface_repo_type",
        "--huggingface_path_in_repo",
        "--huggingface_token",
        "--huggingface_repo_visibility",
    ):
        add_unsupported(g, flag, reason, type=str, default=None)
    add_unsupported(g, "--async_upload", reason, action="store_true")
    m = parser.add_argument_group("metadata")
    for name in METADATA_NAMES:
        m.add_argument(f"--metadata_{name}", type=str, default=None, help=f"modelspec.{name}")


def add_state_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("state")
    g.add_argument("--save_state", action="store_true", help="also save a resumable state with every model file")
    g.add_argument("--save_state_on_train_end", action="store_true", help="save a resumable state at the end")
    g.add_argument("--save_last_n_epochs_state", type=int, default=None)
    g.add_argument("--save_last_n_steps_state", type=int, default=None)
    g.add_argument("--resume", type=str, default=None, help="state folder to resume from")
    reason = "download the state folder and pass it to --resume"
    add_unsupported(g, "--save_state_to_huggingface", reason, action="store_true")
    add_unsupported(g, "--resume_from_huggingface", reason, action="store_true")
    reason = "use --resume <state folder>: it restores the exact position, scheduler and RNG"
    add_unsupported(g, "--initial_epoch", reason, type=int, default=None)
    add_unsupported(g, "--initial_step", reason, type=int, default=None)
    add_unsupported(g, "--skip_until_initial_step", reason, action="store_true")


def add_tracker_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trackers")
    g.add_argument("--logging_dir", type=str, default=None, help="TensorBoard log folder")
    g.add_argument("--log_with", type=str, default=None, choices=["tensorboard", "wandb", "all"])
    g.add_argument("--log_prefix", type=str, default=None, help="prefix of the run's log folder")
    g.add_argument("--log_tracker_name", type=str, default=None)
    g.add_argument("--log_tracker_config", type=str, default=None, help="TOML of per-tracker init kwargs")
    g.add_argument("--wandb_run_name", type=str, default=None)
    g.add_argument("--wandb_api_key", type=str, default=None)
    g.add_argument("--log_config", action="store_true", help="log the (sanitised) arguments to the trackers")


def add_validation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("validation")
    g.add_argument("--validation_split", type=float, default=0.0, help="fraction of training images held out")
    g.add_argument("--validation_seed", type=int, default=None, help="seed of the split and of the fixed noise")
    g.add_argument("--validate_every_n_steps", type=int, default=None)
    g.add_argument("--validate_every_n_epochs", type=int, default=None)
    g.add_argument("--max_validation_steps", type=int, default=None)


def add_ema_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ema")
    g.add_argument("--ema", action="store_true", help="keep an EMA of the trained weights (samples + saved file)")
    g.add_argument("--ema_decay", type=float, default=0.999)
    g.add_argument("--ema_update_every", type=int, default=1, help="update the EMA every N optimizer steps")
    g.add_argument("--ema_device", type=str, default="same", choices=["same", "cpu"], help="where the EMA lives")


def add_noise_args(parser: argparse.ArgumentParser) -> None:
    """Noise and timestep flags; read into ``library.noising.NoiseConfig`` (same field names)."""
    g = parser.add_argument_group("noise")
    g.add_argument("--noise_offset", type=float, default=None, help="offset noise strength (around 0.1 is usual)")
    g.add_argument("--noise_offset_random_strength", action="store_true", help="offset strength ~ U(0, offset)")
    g.add_argument("--adaptive_noise_scale", type=float, default=None, help="add |latent mean| x this to the offset")
    g.add_argument("--multires_noise_iterations", type=int, default=None, help="pyramid noise levels (6-10 usual)")
    g.add_argument("--multires_noise_discount", type=float, default=0.3, help="pyramid noise discount per level")
    g.add_argument("--ip_noise_gamma", type=float, default=None, help="input perturbation noise (around 0.1)")
    g.add_argument("--ip_noise_gamma_random_strength", action="store_true", help="gamma ~ U(0, ip_noise_gamma)")
    g.add_argument("--zero_terminal_snr", action="store_true", help="rescale betas to zero terminal SNR")
    g.add_argument("--min_timestep", type=int, default=None, help="lowest training timestep (0-999)")
    g.add_argument("--max_timestep", type=int, default=None, help="highest training timestep, exclusive (1-1000)")
    g.add_argument(
        "--timestep_sampling",
        type=str,
        default="uniform",
        choices=["uniform", "logit_normal", "sigmoid"],
        help="timestep distribution (uniform = sd-scripts)",
    )
    g.add_argument("--logit_mean", type=float, default=0.0, help="logit_normal: mean")
    g.add_argument("--logit_std", type=float, default=1.0, help="logit_normal: standard deviation")
    g.add_argument("--sigmoid_scale", type=float, default=1.0, help="sigmoid: scale")
    g.add_argument("--timestep_shift", type=float, default=1.0, help="SD3-style shift; > 1 trains more at high noise")


def add_loss_args(parser: argparse.ArgumentParser) -> None:
    """Loss flags; read into ``library.losses.LossConfig`` (same field names)."""
    g = parser.add_argument_group("loss")
    g.add_argument("--loss_type", type=str, default="l2", choices=["l1", "l2", "huber", "smooth_l1"])
    g.add_argument("--huber_schedule", type=str, default="snr", choices=["constant", "exponential", "snr"])
    g.add_argument("--huber_c", type=float, default=0.1)
    g.add_argument("--huber_scale", type=float, default=1.0)
    g.add_argument("--min_snr_gamma", type=float, default=None, help="Min-SNR weighting gamma (5 is usual)")
    g.add_argument("--scale_v_pred_loss_like_noise_pred", action="store_true")
    g.add_argument("--v_pred_like_loss", type=float, default=None)
    g.add_argument("--debiased_estimation_loss", action="store_true")
    g.add_argument("--unmasked_probability", type=float, default=0.0, help="masked loss: chance to ignore the mask")
    g.add_argument("--unmasked_weight", type=float, default=0.0, help="masked loss: weight outside the mask")
    g.add_argument(
        "--normalize_masked_area_loss", action="store_true", help="masked loss: divide by the mask's mean area"
    )


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
    add_unsupported(
        parser,
        "--conditioning_data_dir",
        "on the command line (sd-scripts ignores it there too); put conditioning_data_dir in a [[datasets.subsets]] "
        "table of a --dataset_config file, or use alpha masks (--alpha_mask) or <image>-masklabel.png files",
        type=str,
        default=None,
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


def add_textual_inversion_args(parser: argparse.ArgumentParser) -> None:
    """sd-scripts' train_textual_inversion.py flags (same names, defaults and meaning)."""
    g = parser.add_argument_group("textual inversion")
    g.add_argument("--token_string", type=str, default=None, help="the new token trained (must not be a known word)")
    g.add_argument("--init_word", type=str, default=None, help="word(s) whose vectors initialise the token (cycled)")
    g.add_argument("--num_vectors_per_token", type=int, default=1, help="vectors per token (tok, tok1, ...)")
    g.add_argument("--weights", type=str, default=None, help="embedding file to continue from (instead of init_word)")
    g.add_argument("--use_object_template", action="store_true", help="ignore captions; use 27 object templates")
    g.add_argument("--use_style_template", action="store_true", help="ignore captions; use 19 style templates")


def add_embedding_args(parser: argparse.ArgumentParser) -> None:
    """Pivotal tuning in the adapter scripts: new token embeddings trained in the same run."""
    g = parser.add_argument_group("new token embeddings (pivotal tuning)")
    g.add_argument(
        "--embedding",
        action="append",
        default=None,
        metavar="TOKEN=INIT_WORD[:VECTORS]",
        help="also train a new token (repeatable), e.g. sks_cat=cat:2; file <output_name>_embeddings/<token>.<ext>",
    )
    g.add_argument(
        "--embedding_lr", type=float, default=None, help="lr of the new embeddings (default --learning_rate)"
    )
    g.add_argument(
        "--stop_embedding_training", type=int, default=None, help="keep the embeddings as they are after step N"
    )
    g.add_argument(
        "--bundle_embeddings",
        action="store_true",
        help="also write the embeddings into the adapter file as A1111 bundle_emb.* keys (diffusers rejects those)",
    )
