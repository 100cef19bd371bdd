"""Tag a folder of images with a WD14 tagger (sd-scripts' finetune/tag_images_by_wd14_tagger.py), through
onnxruntime (``pip install "sdtrain[tagger]"``).

    python finetune/tag_images_by_wd14_tagger.py train_data_dir --onnx \
        [--repo_id SmilingWolf/wd-v1-4-convnext-tagger-v2] [--model_dir wd14_tagger_model] [--batch_size 8] \
        [--thresh 0.35] [--general_threshold G] [--character_threshold C] [--caption_extension .txt] \
        [--remove_underscore] [--undesired_tags "a,b"] [--use_rating_tags | --use_rating_tags_as_last_tag] \
        [--character_tags_first] [--always_first_tags "1girl,1boy"] [--caption_separator ", "] \
        [--tag_replacement "a,b;c,d"] [--character_tag_expand] [--append_tags] [--frequency_tags] \
        [--output_path tags.json] [--recursive] [--max_data_loader_n_workers 2] [--debug]

Nothing is downloaded: the model folder must hold ``model.onnx`` and ``selected_tags.csv`` of the tagger. It is
``<model_dir>/<repo_id with / replaced by _>`` (sd-scripts' layout), or ``--model_dir`` itself. Get them with

    huggingface-cli download SmilingWolf/wd-v1-4-convnext-tagger-v2 model.onnx selected_tags.csv \
        --local-dir wd14_tagger_model/SmilingWolf_wd-v1-4-convnext-tagger-v2

Writes ``<image stem><caption_extension>`` with the chosen tags joined by ``--caption_separator`` (or, with
``--output_path``, one JSON / JSONL file instead). The model's input size and a fixed batch size are read from the
ONNX file.

sd-scripts' second layout, ``--repo_id owner/repo/subfolder`` (e.g. cl_tagger), is read from
``<model_dir>/<owner_repo>/<subfolder>``: ``model_optimized.onnx`` (NCHW input scaled to -1..1, logits out) and
``tag_mapping.json`` with the categories Rating, General, Character, Copyright, Meta, Model, Quality and Artist
(``--copyright_threshold`` etc., ``--use_quality_tags``); its tags are sorted by score.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np

from library.cli.main_guard import main_guard
from library.data import wd14_tags
from library.data.captioning import (
    caption_file,
    check_extension,
    image_batches,
    images_or_error,
    require,
    write_text_atomic,
)

DEFAULT_WD14_TAGGER_REPO = "SmilingWolf/wd-v1-4-convnext-tagger-v2"
MODEL_FILE, TAGS_FILE = "model.onnx", "selected_tags.csv"
CATEGORY_THRESHOLDS = ("meta", "model", "copyright", "artist")  # categories of tag_mapping.json taggers only
logger = logging.getLogger("sdtrain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("train_data_dir", type=str, help="folder of the images to tag")
    add(
        "--repo_id",
        type=str,
        default=DEFAULT_WD14_TAGGER_REPO,
        help="tagger name: its folder is model_dir/<id, / -> _>",
    )
    add("--model_dir", type=str, default="wd14_tagger_model", help="folder of tagger folders (or of model.onnx)")
    add("--force_download", action="store_true", help="not supported: this script never downloads")
    add("--batch_size", type=int, default=1, help="images per model call")
    add("--max_data_loader_n_workers", type=int, default=None, help="load images in this many processes")
    add("--output_path", type=str, default=None, help="write all tags to this .json / .jsonl instead of tag files")
    add("--caption_extention", type=str, default=None, help="old spelling of --caption_extension")
    add("--caption_extension", type=str, default=".txt", help="extension of the tag files")
    add("--thresh", type=float, default=0.35, help="probability at or above which a tag is written")
    add("--general_threshold", type=float, default=None, help="threshold of general tags (default --thresh)")
    add(
        "--character_threshold",
        type=float,
        default=None,
        help="threshold of character tags (default --thresh; >1: none)",
    )
    for name in CATEGORY_THRESHOLDS:
        add(
            f"--{name}_threshold",
            type=float,
            default=None,
            help="tag_mapping.json taggers: threshold of this category (default --thresh)",
        )
    add("--recursive", action="store_true", help="also tag the images in sub-folders")
    add("--remove_underscore", action="store_true", help="underscores to spaces (tags longer than 3 characters)")
    add("--debug", action="store_true", help="print each image's rating, character and general tags")
    add("--undesired_tags", type=str, default="", help="tags never written, separated like --caption_separator")
    add("--frequency_tags", action="store_true", help="print how many images got each tag")
    add("--onnx", action="store_true", help="run the ONNX model (the only way here; TensorFlow is not supported)")
    add("--append_tags", action="store_true", help="keep the tags of an existing file, add the new ones after them")
    add("--use_rating_tags", action="store_true", help="put the most probable rating tag first")
    add("--use_rating_tags_as_last_tag", action="store_true", help="put the most probable rating tag last")
    add("--use_quality_tags", action="store_true", help="tag_mapping.json taggers: the best quality tag first")
    add(
        "--use_quality_tags_as_last_tag",
        action="store_true",
        help="tag_mapping.json taggers: the best quality tag last",
    )
    add("--character_tags_first", action="store_true", help="character tags before general tags")
    add("--always_first_tags", type=str, default=None, help="tags moved to the front when present, e.g. 1girl,1boy")
    add("--caption_separator", type=str, default=", ", help="text between tags (include the space)")
    add("--tag_replacement", type=str, default=None, help="rename tags: src1,dst1;src2,dst2 (\\, and \\; escape)")
    add("--character_tag_expand", action="store_true", help="chara_(series) -> chara<separator>series")
    return parser


@dataclass(frozen=True)
class Layout:
    """The files and tensors of a tagger: WD14 (selected_tags.csv, NHWC BGR 0..255 in, probabilities out) or
    sd-scripts' other layout for ``--repo_id owner/repo/subfolder`` (tag_mapping.json, NCHW -1..1 in, logits out)."""

    model_file: str
    tags_file: str
    channels_first: bool

    @property
    def mapping(self) -> bool:
        return self.channels_first


WD14 = Layout(MODEL_FILE, TAGS_FILE, channels_first=False)
MAPPED = Layout("model_optimized.onnx", "tag_mapping.json", channels_first=True)


def layout_of(repo_id: str) -> tuple[Layout, str]:
    """``(layout, sub-folder)``: an id with more than two parts is owner/repo/sub-folder of a tag_mapping.json tagger."""
    parts = repo_id.split("/")
    if len(parts) > 2:
        return MAPPED, str(Path(*parts[2:]))
    return WD14, ""


def check_args(args: argparse.Namespace, layout: Layout) -> list[str]:
    """Every problem of the command line at once (the flags this tagger's layout cannot honour included)."""
    problems = []
    if args.force_download:
        problems.append(
            f"--force_download: this script never downloads; place {layout.model_file} and {layout.tags_file} yourself"
        )
    if not layout.mapping:
        for name in CATEGORY_THRESHOLDS:
            if getattr(args, f"{name}_threshold") is not None:
                problems.append(f"--{name}_threshold: WD14 taggers have no {name} tags (tag_mapping.json taggers do)")
        if args.use_quality_tags or args.use_quality_tags_as_last_tag:
            problems.append("--use_quality_tags: WD14 taggers have no quality tags (tag_mapping.json taggers do)")
    if args.use_rating_tags and args.use_rating_tags_as_last_tag:
        problems.append("--use_rating_tags and --use_rating_tags_as_last_tag: choose one")
    if args.use_quality_tags and args.use_quality_tags_as_last_tag:
        problems.append("--use_quality_tags and --use_quality_tags_as_last_tag: choose one")
    if args.output_path and args.append_tags:
        problems.append("--append_tags adds to tag files; it cannot be used with --output_path")
    if args.output_path and not args.output_path.endswith((".json", ".jsonl")):
        problems.append(f"--output_path {args.output_path}: must end in .json or .jsonl")
    if not args.caption_separator.strip():
        problems.append(f"--caption_separator {args.caption_separator!r}: needs a character other than spaces")
    return problems


def model_folder(args: argparse.Namespace, layout: Layout, sub_folder: str) -> Path:
    """The folder with the tagger's two files; when it is missing, say what to put where."""
    model_dir = Path(args.model_dir)
    repo = "/".join(args.repo_id.split("/")[:2])
    expected = model_dir / repo.replace("/", "_") / sub_folder
    for folder in (expected, model_dir):
        if (folder / layout.model_file).is_file():
            if not (folder / layout.tags_file).is_file():
                raise ValueError(
                    f"{folder}: has {layout.model_file} but no {layout.tags_file}; put the tagger's {layout.tags_file} there"
                )
            return folder
        if (folder / "saved_model.pb").is_file():
            raise ValueError(
                f"{folder}: a TensorFlow (Keras) tagger; it is not supported here: put the tagger's "
                f"{layout.model_file} and {layout.tags_file} in this folder"
            )
    files = " ".join(f"{sub_folder}/{f}" if sub_folder else f for f in (layout.model_file, layout.tags_file))
    local = expected.parent if sub_folder else expected
    raise ValueError(
        f"no tagger at {expected} (nor {layout.model_file} in {model_dir}): this script does not download; run "
        f"`huggingface-cli download {repo} {files} --local-dir {local}` (or copy the two files there), or point "
        "--model_dir at a folder that holds them"
    )


def open_session(path: Path, batch_size: int, layout: Layout):
    """``(session, input name, input size, batch size, fixed)``: a fixed batch dimension of the model overrides
    ``--batch_size`` (with a warning, as sd-scripts; a last, shorter batch is padded); a dynamic one keeps it."""
    ort = require("onnxruntime", "tagger", "the WD14 tagger")
    available = ort.get_available_providers()
    providers = [p for p in ("CUDAExecutionProvider", "ROCMExecutionProvider") if p in available][:1]
    session = ort.InferenceSession(str(path), providers=providers + ["CPUExecutionProvider"])
    spec = session.get_inputs()[0]
    channel_axis, size_axis = (1, 2) if layout.channels_first else (3, 1)
    if len(spec.shape) != 4 or spec.shape[channel_axis] != 3:
        want = "(N, 3, size, size)" if layout.channels_first else "(N, size, size, 3)"
        raise ValueError(f"{path}: input {spec.name} has shape {spec.shape}; this tagger layout takes {want}")
    size = spec.shape[size_axis] if isinstance(spec.shape[size_axis], int) else 448
    fixed = isinstance(spec.shape[0], int) and spec.shape[0] > 0
    if fixed and spec.shape[0] != batch_size:
        logger.warning(
            "%s: the model's batch size is %d; --batch_size %d is replaced by it", path, spec.shape[0], batch_size
        )
        batch_size = spec.shape[0]
    return session, spec.name, size, batch_size, fixed


def run(argv: Sequence[str] | None = None) -> dict[str, str]:
    """Tag every image; returns ``{file written: text}`` (one tag file per image, or the ``--output_path``)."""
    args = build_parser().parse_args(argv)
    extension = check_extension(args.caption_extention or args.caption_extension)
    layout, sub_folder = layout_of(args.repo_id)
    problems = check_args(args, layout)
    replacements = {}
    if args.tag_replacement is not None:
        try:
            replacements = wd14_tags.parse_tag_replacement(args.tag_replacement)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("; ".join(problems))
    images = images_or_error(args.train_data_dir, args.recursive)
    folder = model_folder(args, layout, sub_folder)
    session, input_name, size, batch_size, fixed = open_session(folder / layout.model_file, args.batch_size, layout)
    if layout.mapping:
        outputs = session.get_outputs()[0].shape[-1]
        names, categories = wd14_tags.read_tag_mapping(
            folder / layout.tags_file, outputs if isinstance(outputs, int) else None
        )
    else:
        names, categories = wd14_tags.read_selected_tags(folder / layout.tags_file)
    names = wd14_tags.edit_names(
        names, categories, expand_characters=args.character_tag_expand, separator=args.caption_separator,
        underscores_to_spaces=args.remove_underscore, replacements=replacements,
    )  # fmt: skip
    sep = args.caption_separator.strip()
    choice = wd14_tags.TagChoice(
        general_threshold=args.thresh if args.general_threshold is None else args.general_threshold,
        character_threshold=args.thresh if args.character_threshold is None else args.character_threshold,
        undesired=frozenset(t.strip() for t in args.undesired_tags.split(sep) if t.strip()),
        use_rating_tags=args.use_rating_tags,
        use_rating_tags_as_last_tag=args.use_rating_tags_as_last_tag,
        character_tags_first=args.character_tags_first,
        always_first_tags=tuple(t.strip() for t in (args.always_first_tags or "").split(sep) if t.strip()),
        other_thresholds=tuple(
            (
                name.capitalize(),
                args.thresh if getattr(args, f"{name}_threshold") is None else getattr(args, f"{name}_threshold"),
            )
            for name in CATEGORY_THRESHOLDS
        ),
        use_quality_tags=args.use_quality_tags,
        use_quality_tags_as_last_tag=args.use_quality_tags_as_last_tag,
    )
    choose = wd14_tags.choose_mapped_tags if layout.mapping else wd14_tags.choose_tags
    written: dict[str, str] = {}
    records, all_tags, failed = [], [], []
    load = functools.partial(_load, size=size)
    for batch in image_batches(images, load, batch_size, args.max_data_loader_n_workers, failed, "tagging"):
        pixels = np.stack([pixels for _, (pixels, _) in batch])
        if layout.channels_first:  # sd-scripts' tag_mapping.json layout: NCHW in -1..1 (channels as prepared)
            pixels = pixels.transpose(0, 3, 1, 2) / np.float32(127.5) - np.float32(1.0)
        if fixed and len(batch) < batch_size:  # the model takes exactly batch_size images
            pixels = np.concatenate([pixels, np.zeros((batch_size - len(batch), *pixels.shape[1:]), pixels.dtype)])
        probs = session.run(None, {input_name: pixels})[0][: len(batch)]
        if probs.shape[-1] != len(names):
            raise ValueError(
                f"{folder}: the model gives {probs.shape[-1]} scores but {layout.tags_file} lists {len(names)} tags"
            )
        for (path, (_, image_size)), p in zip(batch, probs):
            tags = choose(p, names, categories, choice)
            all_tags.append(tags)
            target = caption_file(path, extension)
            combined = tags.combined
            if args.append_tags and target.is_file():
                combined = wd14_tags.append_to_existing(target.read_text(encoding="utf-8"), combined, sep)
            text = args.caption_separator.join(combined)
            if args.output_path:
                records.append({"image_path": str(path), "caption": text, "image_size": list(image_size)})
            else:
                written[str(write_text_atomic(target, text + "\n"))] = text
            if args.debug:
                print(f"{path}:\n\tRating tags: {', '.join(tags.rating)}\n\tCharacter tags: "
                      f"{', '.join(tags.character)}\n\tGeneral tags: {', '.join(tags.general)}")  # fmt: skip
                quality = tags.quality if args.use_quality_tags or args.use_quality_tags_as_last_tag else []
                if tags.other or quality:
                    print(f"\tOther tags: {', '.join(tags.other + quality)}")
    if args.output_path:
        written[args.output_path] = _write_records(records, Path(args.output_path))
    if args.frequency_tags:
        print("Tag frequencies:")
        for tag, count in wd14_tags.frequencies(all_tags):
            print(f"{tag}: {count}")
    print(f"{len(all_tags)} images tagged; {len(failed)} could not be read")
    return written


def _load(path: Path, size: int) -> tuple[np.ndarray, tuple[int, int]]:
    """The tagger's pixels of one image and its original ``(width, height)``."""
    from PIL import Image

    with Image.open(path) as im:
        original = im.size
    return wd14_tags.prepare_image(path, size), original


def _write_records(records: list[dict], path: Path) -> str:
    """sd-scripts' ``--output_path``: JSONL lines ``{image_path, caption, image_size}`` or one JSON object
    ``{image_path: {tags, image_size}}``; written atomically."""
    if path.suffix == ".jsonl":
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    else:
        table = {r["image_path"]: {"tags": r["caption"], "image_size": r["image_size"]} for r in records}
        text = json.dumps(table, ensure_ascii=False, indent=4)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
