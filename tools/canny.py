"""Canny edge map of an image, e.g. a ControlNet condition (sd-scripts' tools/canny.py); needs OpenCV
(``pip install "sdtrain[canny]"``).

    python tools/canny.py --input photo.png --output edges.png [--thres1 32] [--thres2 224]

The image is read as grey and given to ``cv2.Canny(grey, thres1, thres2)``: gradients above ``thres2`` start an
edge, those above ``thres1`` continue one. The output (white edges on black, one channel) is written atomically in
the format of its extension.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np

from library.cli.main_guard import main_guard
from library.data.captioning import require


def read_image(cv2, path: str | Path, flags: int) -> np.ndarray:
    """``cv2.imdecode`` of a file (any file name, unlike ``cv2.imread``); errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such image")
    image = cv2.imdecode(np.fromfile(path, np.uint8), flags)
    if image is None:
        raise ValueError(f"{path}: cannot decode image; remove or re-save it")
    return image


def write_image(cv2, image: np.ndarray, path: str | Path) -> Path:
    """Encode by the extension of ``path`` and write atomically (a hidden ``.partial`` file, then a rename)."""
    path = Path(path)
    try:
        ok, data = cv2.imencode(path.suffix or ".", image)
    except cv2.error:
        ok = False
    if not ok:
        raise ValueError(f"{path}: OpenCV cannot write {path.suffix or 'files without an extension'}; use .png or .jpg")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_bytes(data.tobytes())
    tmp.replace(path)
    return path


def canny(image_path: str | Path, thres1: int, thres2: int) -> np.ndarray:
    """``(H, W)`` uint8 edge map (255 on edges) of the image at ``image_path``."""
    cv2 = require("cv2", "canny", "tools/canny.py")
    grey = read_image(cv2, image_path, cv2.IMREAD_GRAYSCALE)
    return cv2.Canny(grey, thres1, thres2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=str, required=True, help="image to read")
    parser.add_argument("--output", type=str, required=True, help="edge image to write (.png, .jpg, ...)")
    parser.add_argument("--thres1", type=int, default=32, help="lower hysteresis threshold")
    parser.add_argument("--thres2", type=int, default=224, help="upper hysteresis threshold")
    return parser


def run(argv: Sequence[str] | None = None) -> Path:
    """Write the edge map; returns the output path."""
    args = build_parser().parse_args(argv)
    if not 0 <= args.thres1 <= args.thres2:
        raise ValueError(f"--thres1 {args.thres1} / --thres2 {args.thres2}: need 0 <= thres1 <= thres2")
    edges = canny(args.input, args.thres1, args.thres2)
    out = write_image(require("cv2", "canny", "tools/canny.py"), edges, args.output)
    print(f"{out}: {int((edges > 0).sum())} edge pixels")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
