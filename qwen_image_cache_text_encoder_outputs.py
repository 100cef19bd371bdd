"""musubi-tuner's qwen_image_cache_text_encoder_outputs.py: encode every caption of a dataset config with
Qwen2.5-VL before training, with musubi-tuner's command line.

    python qwen_image_cache_text_encoder_outputs.py --dataset_config dataset.toml \
        --text_encoder qwen_2.5_vl_7b.safetensors --batch_size 16

Every caption a sample can take is encoded (Qwen-Image's template, the 34 template tokens dropped: the training
scripts' encoding) and written into the dataset config's ``cache_directory`` (else next to the images) under the
content key a training run computes, so qwen_image_train_network.py / qwen_image_train.py with the same dataset config
(and ``--mixed_precision bf16``: Qwen2.5-VL runs in bfloat16 here) find every entry and run no text encoder. The
entries are ours, not musubi-tuner's ``*_qi_te.safetensors`` files, which are neither written nor read. The flags:
library/families/qwen_image/cache_flags.py. With ``--model_version edit`` / ``edit-2509`` / ``edit-2511`` (or ``--edit`` /
``--edit_plus``) Qwen2.5-VL sees each sample's control images from the dataset's ``control_directory``, as the dataset
trains them (resized to the target's bucket, ``control_resolution`` or kept with ``no_resize_control``) and then at
the 384 x 384 area's bucket (one entry per caption and control images, keyed on their bytes and training sizes), as
musubi-tuner caches the edit models' prompts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.data import musubi_dataset
from library.families.base import Parts
from library.families.encoders import qwen25vl, qwen25vl_edit
from library.families.qwen_image import QWEN_IMAGE, cache_flags
from library.families.qwen_image.options import QwenImageOptions
from library.run import cache_steps


def build_parser():
    return cache_flags.text_parser(__doc__)


def run(argv: Sequence[str] | None = None):
    """Fill the text-encoder cache; returns it (its store and keys) for inspection."""
    args = parse_args(build_parser(), argv)
    flags = cache_flags.read_common(args, "--text_encoder")
    path = Path(args.text_encoder)
    if not path.exists():
        raise FileNotFoundError(f"--text_encoder {path}: no such file or folder (Qwen2.5-VL-7B)")
    edit = flags.model_version in qwen25vl_edit.VERSIONS  # prompts encoded with their control images
    plan = cache_steps.dataset_plan(args.dataset_config, QWEN_IMAGE, control_images=edit,
                                    cache_dir=musubi_dataset.cache_directory(args.dataset_config))  # fmt: skip
    load = qwen25vl_edit.load if edit else qwen25vl.load
    encoder = load(path, torch.bfloat16, "cpu", where="--text_encoder")
    if args.fp8_vl:
        qwen25vl.store_fp8(getattr(encoder, "language_model", encoder), torch.bfloat16)
    tokenizer = qwen25vl.load_tokenizer(path if path.is_dir() else None)
    options = QwenImageOptions(text_encoder=str(path), model_version=flags.model_version, fp8_vl=args.fp8_vl)
    parts = Parts(None, None, [encoder], [tokenizer], {}, QWEN_IMAGE.name, options=options)
    cache = cache_steps.write_text(plan, QWEN_IMAGE, parts, flags.device, flags.batch_size)
    print(f"text-encoder cache: {len(cache.keys)} captions in {cache_steps.where(plan)}")
    return cache


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: exit status 2 and one ``error:`` line for bad input."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
