"""Caption a folder of images with BLIP (sd-scripts' finetune/make_captions.py), through transformers.

    python finetune/make_captions.py train_data_dir --caption_weights blip-large [--batch_size 8] \
        [--beam_search --num_beams 3] [--top_p 0.9] [--max_length 75] [--min_length 5] \
        [--caption_extension .caption] [--recursive] [--max_data_loader_n_workers 2] [--seed 42] [--debug]

Writes ``<image stem><caption_extension>`` (one caption and a newline) next to every image. The model is
transformers' ``BlipForConditionalGeneration`` with its processor, loaded from ``--caption_weights``: a folder of a
transformers BLIP captioning model or its Hugging Face id (default Salesforce/blip-image-captioning-large, which
transformers downloads into its cache once). sd-scripts' default, a URL of its own ``model_large_caption.pth``, is
not a transformers model and cannot be loaded here. To work offline, download the model first:

    huggingface-cli download Salesforce/blip-image-captioning-large --local-dir blip-large

Decoding as sd-scripts' BLIP: each caption continues the prompt "a picture of " (which is then cut off, so the file
holds what follows it; unprompted, BLIP large tends to start with "arafed"); nucleus sampling (``--top_p``, repetition penalty 1.1, seeded by ``--seed``) unless
``--beam_search`` (``--num_beams``, no sampling); ``--max_length`` / ``--min_length`` count tokens.
"""

from __future__ import annotations

import argparse
import logging
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

DEFAULT_MODEL = "Salesforce/blip-image-captioning-large"
PROMPT = "a picture of"  # sd-scripts' BLIP prompt, removed from the captions
HOW_TO_GET = (
    "--caption_weights needs a transformers BLIP captioning model: a folder (config.json, model.safetensors, "
    "processor and tokenizer files) or a Hugging Face id; download one with `huggingface-cli download "
    "Salesforce/blip-image-captioning-large --local-dir blip-large` and pass --caption_weights blip-large "
    "(sd-scripts' model_large_caption.pth is not a transformers model)"
)
logger = logging.getLogger("sdtrain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train_data_dir", type=str, help="folder of the images to caption")
    parser.add_argument(
        "--caption_weights", type=str, default=DEFAULT_MODEL, help="transformers BLIP model folder or Hugging Face id"
    )
    parser.add_argument("--caption_extention", type=str, default=None, help="old spelling of --caption_extension")
    parser.add_argument("--caption_extension", type=str, default=".caption", help="extension of the caption files")
    parser.add_argument("--beam_search", action="store_true", help="beam search (default: nucleus sampling)")
    parser.add_argument("--batch_size", type=int, default=1, help="images per generate call")
    parser.add_argument(
        "--max_data_loader_n_workers", type=int, default=None, help="load images in this many processes"
    )
    parser.add_argument("--num_beams", type=int, default=1, help="beams of --beam_search")
    parser.add_argument("--top_p", type=float, default=0.9, help="top_p of nucleus sampling")
    parser.add_argument("--max_length", type=int, default=75, help="most tokens of a caption")
    parser.add_argument("--min_length", type=int, default=5, help="fewest tokens of a caption")
    parser.add_argument("--seed", type=int, default=42, help="seed of nucleus sampling")
    parser.add_argument("--debug", action="store_true", help="print each image and its caption")
    parser.add_argument("--recursive", action="store_true", help="also caption the images in sub-folders")
    return parser


def check_args(args: argparse.Namespace) -> list[str]:
    """Every problem of the generation flags at once."""
    problems = []
    if args.num_beams < 1:
        problems.append(f"--num_beams {args.num_beams}: must be at least 1")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top_p {args.top_p}: must be in (0, 1]")
    if args.min_length < 0 or args.max_length < 1 or args.min_length > args.max_length:
        problems.append(f"--min_length {args.min_length} / --max_length {args.max_length}: need 0 <= min <= max")
    return problems


def generation_kwargs(args: argparse.Namespace) -> dict:
    """``generate`` arguments of sd-scripts' BLIP decoding: beam search or nucleus sampling (top_k off)."""
    lengths = {"max_length": args.max_length, "min_length": args.min_length}
    if args.beam_search:
        return {"do_sample": False, "num_beams": args.num_beams, "repetition_penalty": 1.0, **lengths}
    return {"do_sample": True, "top_p": args.top_p, "top_k": 0, "num_beams": 1, "repetition_penalty": 1.1, **lengths}


def without_prompt(text: str) -> str:
    """A decoded caption without the leading prompt (compared case-insensitively: BLIP's tokenizer lowercases)."""
    text = text.strip()
    return text[len(PROMPT) :].strip() if text.lower().startswith(PROMPT) else text


def run(argv: Sequence[str] | None = None) -> dict[Path, str]:
    """Caption every image; returns ``{caption file: caption}`` of the files written."""
    args = build_parser().parse_args(argv)
    extension = check_extension(args.caption_extention or args.caption_extension)
    problems = check_args(args)
    if problems:
        raise ValueError("; ".join(problems))
    images = images_or_error(args.train_data_dir, args.recursive)
    from transformers import BlipForConditionalGeneration

    model, processor = load_transformers_captioner(
        BlipForConditionalGeneration, args.caption_weights, "--caption_weights", "blip", HOW_TO_GET
    )
    prompt_tokens = len(processor.tokenizer(PROMPT).input_ids) - 1  # the start token and the prompt, not [SEP]
    if args.max_length <= prompt_tokens:
        raise ValueError(
            f"--max_length {args.max_length}: counts the {prompt_tokens} tokens of the start and the prompt "
            f"{PROMPT!r}; give more (sd-scripts' default is 75)"
        )
    device = default_device()
    model.to(device)
    torch.manual_seed(args.seed)
    kwargs = generation_kwargs(args)
    written: dict[Path, str] = {}
    failed: list[str] = []
    batches = image_batches(images, load_image, args.batch_size, args.max_data_loader_n_workers, failed, "BLIP")
    for batch in batches:
        inputs = processor(images=[image for _, image in batch], text=[PROMPT] * len(batch), return_tensors="pt")
        with torch.no_grad():
            tokens = model.generate(
                pixel_values=inputs.pixel_values.to(device, model.dtype),
                input_ids=inputs.input_ids.to(device),
                attention_mask=inputs.attention_mask.to(device),
                **kwargs,
            )
        for (path, _), text in zip(batch, processor.batch_decode(tokens, skip_special_tokens=True)):
            caption = without_prompt(text)
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
