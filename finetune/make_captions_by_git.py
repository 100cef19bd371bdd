"""Caption a folder of images with GIT (sd-scripts' finetune/make_captions_by_git.py), through transformers.

    python finetune/make_captions_by_git.py train_data_dir [--model_id microsoft/git-large-textcaps] \
        [--batch_size 8] [--max_length 50] [--remove_words] [--caption_extension .caption] [--recursive] \
        [--max_data_loader_n_workers 2] [--debug]

Writes ``<image stem><caption_extension>`` next to every image with transformers' ``GitForCausalLM`` and its
processor (greedy decoding, ``--max_length`` tokens at most). ``--model_id`` is a Hugging Face id (transformers
downloads it into its cache once) or a local folder of a transformers GIT model, e.g. after
``huggingface-cli download microsoft/git-large-textcaps --local-dir git-large-textcaps``. ``--remove_words`` cuts
the text GIT reads off signs ("with the words ...", "that says ...", "with the number 3 on it"), which it often
invents.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from library.cli.main_guard import main_guard
from library.data.captioning import (
    caption_file,
    check_extension,
    default_device,
    image_batches,
    images_or_error,
    load_transformers_captioner,
    write_text_atomic,
)
from library.data.images import load_image

DEFAULT_MODEL = "microsoft/git-large-textcaps"
HOW_TO_GET = (
    "--model_id needs a transformers GIT model: a Hugging Face id or a folder (config.json, model.safetensors, "
    "processor and tokenizer files), e.g. `huggingface-cli download microsoft/git-large-textcaps --local-dir "
    "git-large-textcaps`, then --model_id git-large-textcaps"
)
_QUOTED = r"(?:\"[^\"]*\"?|'[^']*'?|\w+)"  # a quoted text (closing quote optional) or one word
# The phrases GIT uses for text it reads (or imagines) in the image; each is removed with what it quotes.
READ_TEXT_PATTERNS = [
    re.compile(
        rf"\b(?:has|with|and) the (?:words?|letters?|name) ?{_QUOTED}(?: ?(?:is )?(?:on|in) (?:the |her |their |him )?\w+)?"
    ),
    re.compile(rf"(?:with a sign )?that says ?(?:the word )?{_QUOTED}?(?: ?on it)?"),
    re.compile(r"with the number \d+ on (?:it|\w+ \w+)"),
    re.compile(r"\bword \w+ on it"),
]
logger = logging.getLogger("sdtrain")


def remove_read_text(caption: str) -> str:
    """``caption`` without the phrases of ``READ_TEXT_PATTERNS`` (spaces tidied)."""
    for pattern in READ_TEXT_PATTERNS:
        caption = pattern.sub("", caption)
    return re.sub(r"\s{2,}", " ", caption).strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train_data_dir", type=str, help="folder of the images to caption")
    parser.add_argument("--caption_extension", type=str, default=".caption", help="extension of the caption files")
    parser.add_argument("--model_id", type=str, default=DEFAULT_MODEL, help="GIT model: Hugging Face id or folder")
    parser.add_argument("--batch_size", type=int, default=1, help="images per generate call")
    parser.add_argument(
        "--max_data_loader_n_workers", type=int, default=None, help="load images in this many processes"
    )
    parser.add_argument("--max_length", type=int, default=50, help="most tokens of a caption")
    parser.add_argument("--remove_words", action="store_true", help="remove 'with the words xxx' and the like")
    parser.add_argument("--debug", action="store_true", help="print each image and its caption")
    parser.add_argument("--recursive", action="store_true", help="also caption the images in sub-folders")
    return parser


def run(argv: Sequence[str] | None = None) -> dict[Path, str]:
    """Caption every image; returns ``{caption file: caption}`` of the files written."""
    args = build_parser().parse_args(argv)
    extension = check_extension(args.caption_extension)
    if args.max_length < 1:
        raise ValueError(f"--max_length {args.max_length}: must be at least 1")
    images = images_or_error(args.train_data_dir, args.recursive)
    from transformers import GitForCausalLM

    model, processor = load_transformers_captioner(GitForCausalLM, args.model_id, "--model_id", "git", HOW_TO_GET)
    device = default_device()
    model.to(device)
    written: dict[Path, str] = {}
    failed: list[str] = []
    batches = image_batches(images, load_image, args.batch_size, args.max_data_loader_n_workers, failed, "GIT")
    for batch in batches:
        pixels = processor(images=[image for _, image in batch], return_tensors="pt").pixel_values.to(device)
        with torch.no_grad():
            tokens = model.generate(pixel_values=pixels.to(model.dtype), max_length=args.max_length)
        for (path, _), caption in zip(batch, processor.batch_decode(tokens, skip_special_tokens=True)):
            caption = caption.strip()
            if args.remove_words:
                cleaned = remove_read_text(caption)
                if args.debug and cleaned != caption:
                    print(f"{caption!r} -> {cleaned!r}")
                caption = cleaned
            written[write_text_atomic(caption_file(path, extension), caption + "\n")] = caption
            if args.debug:
                print(path, caption)
    print(f"{len(written)} captions written ({extension}); {len(failed)} images could not be read")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
