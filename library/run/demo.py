"""The embedded default: ``--demo`` trains on a tiny model and example images that are made on the spot.

``python train_network.py --demo`` writes ``demo/models/<family>`` (a tiny model with the real module layout and
the real CLIP tokenizer, random weights), ``demo/dataset/10_sks shape/`` (four 64 px images with captions) and
trains a LoRA into ``demo/output/<family>``. Any other flag given with ``--demo`` overrides the demo's choice.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

DEMO_DIR = Path("demo")
SHAPES = (
    ("a red circle on a blue background", (200, 40, 40), (30, 60, 170), "circle"),
    ("a yellow square on a green background", (230, 210, 40), (40, 140, 60), "square"),
    ("a white triangle on a black background", (240, 240, 240), (15, 15, 15), "triangle"),
    ("a purple cross on an orange background", (140, 50, 160), (240, 140, 40), "cross"),
)


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--demo",
        action="store_true",
        help="train on a tiny model and example images made on the spot (no download); other flags override",
    )
    parser.add_argument("--demo_dir", type=str, default=str(DEMO_DIR), help="where --demo writes its files")


def make_example_dataset(folder: str | Path, size: int = 64) -> Path:
    """Four images of simple coloured shapes with captions, in sd-scripts' ``<repeats>_<class>`` folder layout."""
    sub = Path(folder) / "10_sks shape"
    sub.mkdir(parents=True, exist_ok=True)
    a, b = size // 5, size - size // 5
    for i, (caption, fg, bg, kind) in enumerate(SHAPES):
        draw_shape(kind, fg, bg, size, (a, a, b, b)).save(sub / f"{i:02d}_{kind}.png")
        (sub / f"{i:02d}_{kind}.txt").write_text(f"sks shape, {caption}\n", encoding="utf-8")
    return Path(folder)


def draw_shape(kind: str, fg: tuple, bg: tuple, size: int, box: tuple[int, int, int, int]):
    """A ``size`` px image in colour ``bg`` with a ``kind`` ("circle", "square", "triangle", "cross") of colour
    ``fg`` filling ``box`` (left, top, right, bottom)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    a, t, b, u = box
    if kind == "circle":
        d.ellipse([a, t, b, u], fill=fg)
    elif kind == "square":
        d.rectangle([a, t, b, u], fill=fg)
    elif kind == "triangle":
        d.polygon([((a + b) // 2, t), (a, u), (b, u)], fill=fg)
    else:
        w, cx, cy = (b - a) // 5, (a + b) // 2, (t + u) // 2
        d.rectangle([cx - w, t, cx + w, u], fill=fg)
        d.rectangle([a, cy - w, b, cy + w], fill=fg)
    return img


def make_concept_dataset(
    folder: str | Path, concepts: Sequence[tuple[str, tuple, str]], per_concept: int = 3, size: int = 64
) -> Path:
    """``per_concept`` images of each ``(caption, colour, shape)`` on one grey background, at different places and
    sizes, captioned with the concept's caption: a data set whose pixels only the text can tell apart."""
    sub = Path(folder) / "1_concepts"
    sub.mkdir(parents=True, exist_ok=True)
    for c, (caption, fg, kind) in enumerate(concepts):
        for i in range(per_concept):
            half, cx, cy = size // 4 + (i % 2) * size // 10, size // 2 + (i - 1) * size // 10, size // 2
            box = (cx - half, cy - half + (i % 3 - 1) * 3, cx + half, cy + half + (i % 3 - 1) * 3)
            draw_shape(kind, fg, (128, 128, 128), size, box).save(sub / f"{c:02d}_{i:02d}_{kind}.png")
            (sub / f"{c:02d}_{i:02d}_{kind}.txt").write_text(caption + "\n", encoding="utf-8")
    return Path(folder)


def make_tiny_model(folder: str | Path, family: str) -> Path:
    """A tiny diffusers folder of ``family`` (library/families/tiny.py ``tiny_model_folder``) under ``folder``,
    unless one is there."""
    from library.families.tiny import tiny_model_folder

    path = Path(folder) / family
    if not (path / "model_index.json").exists():
        tiny_model_folder(family, path)
    return path


def expand(argv: Sequence[str] | None, family_names: Sequence[str]) -> list[str] | None:
    """With ``--demo`` in ``argv``: build the demo files and put the demo's flags in front of the user's."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--demo" not in argv:
        return argv
    from library.cli.console import console_level_in, library_output

    library_output(show=console_level_in(argv) == "DEBUG")  # before the run's logging setup: the model is written now
    root = Path(argv[argv.index("--demo_dir") + 1]) if "--demo_dir" in argv else DEMO_DIR
    family = family_names[0]  # the script's first family: sd1 for train_network.py, sdxl for sdxl_train_network.py
    model, dataset = root / "models" / family, root / "dataset"
    ready = root / f".ready-{family}"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # under accelerate launch one process writes, the others wait
        ready.unlink(missing_ok=True)
        make_tiny_model(root / "models", family)
        make_example_dataset(dataset)
        ready.touch()
        print(f"demo: tiny {family} model in {model}, example images in {dataset}")
    else:
        while not ready.exists():
            time.sleep(0.2)
    defaults = [
        "--pretrained_model_name_or_path", str(model),
        "--train_data_dir", str(dataset),
        "--caption_extension", ".txt",
        "--resolution", "64",
        "--output_dir", str(root / "output" / family),  # SD1 and SDXL demos never overwrite each other
        "--output_name", "demo_lora",
        "--network_module", "networks.lora",
        "--network_dim", "8",
        "--network_alpha", "8",
        "--network_args", "conv_dim=8", "conv_alpha=8",
        "--optimizer_type", "AdamW",
        "--learning_rate", "3e-3",
        "--train_batch_size", "2",
        "--max_train_steps", "100",
        "--max_data_loader_n_workers", "0",
        "--seed", "0",
    ]  # fmt: skip
    return defaults + argv
