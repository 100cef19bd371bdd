"""Find faces, turn each upright and crop around it (sd-scripts' tools/detect_face_rotate.py); needs OpenCV
(``pip install "sdtrain[canny]"``) and a face detector you supply.

    python tools/detect_face_rotate.py --src_dir in --dst_dir out [--rotate] [--crop_size 512,512 | \
        --crop_ratio 2,2] [--resize_fit | --resize_face_size 256] [--min_size 64] [--max_size 1024] \
        [--multiple_faces] [--debug] [--yunet_model face_detection_yunet_2023mar.onnx] [--score_threshold 0.9]

Detectors (a face needs a box and both eyes, for the angle):
* ``anime_face_detector`` (sd-scripts' detector, anime faces; used when it is installed and no ``--yunet_model`` is
  given): ``pip install anime-face-detector`` with its mmcv / mmdet / mmpose requirements.
* OpenCV's YuNet (``cv2.FaceDetectorYN``, photographs): ``--yunet_model`` = the ``face_detection_yunet_2023mar.onnx``
  file of the opencv_zoo repository, downloaded by you.
Without either the script stops and says so; it never guesses faces.

For each image in ``--src_dir`` (faces with score >= ``--score_threshold``, largest first, within ``--min_size`` <=
max(w, h) < ``--max_size``) it writes ``<name>[_NN]_<cx>_<cy>_<w>_<h>.png`` to ``--dst_dir``: NN numbers the faces
with ``--multiple_faces`` (else only the largest face is written); cx, cy, w, h are the face box in the written
image, the name format training's ``face_crop_aug_range`` reads. ``--rotate`` turns the image about the face centre
so the eyes are level; ``--crop_size W,H`` crops W x H around the face (enlarging a smaller image first;
``--resize_fit`` scales so the crop fills the shorter side); ``--crop_ratio h,v`` crops (h, v) x face size;
``--resize_face_size S`` scales the image so the face is S pixels first. ``--debug`` draws the face box.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np
from tqdm.auto import tqdm

from library.cli.main_guard import main_guard
from library.data.captioning import MissingPackage, images_or_error, require
from tools.canny import read_image, write_image

logger = logging.getLogger("sdtrain")
ANIME_RIGHT_EYE, ANIME_LEFT_EYE = 11, 19  # anime_face_detector's 28 landmarks: the two eye centres
NO_DETECTOR = (
    "no face detector: install sd-scripts' anime face detector (`pip install anime-face-detector`, which needs "
    "mmcv, mmdet and mmpose) or pass --yunet_model face_detection_yunet_2023mar.onnx (OpenCV's YuNet face detector "
    "for photographs, from the opencv_zoo repository)"
)


@dataclass(frozen=True)
class Face:
    """A face in image pixels: centre, box size and the angle (degrees) of the line from the right to the left eye
    (0 = upright; ``cv2.getRotationMatrix2D`` by this angle makes the eyes level)."""

    cx: int
    cy: int
    w: int
    h: int
    angle: float

    @property
    def size(self) -> int:
        return max(self.w, self.h)


def face_from_box(box: Sequence[float], right_eye: Sequence[float], left_eye: Sequence[float]) -> Face:
    """``box`` = (left, top, right, bottom); the eyes as (x, y). The angle is atan2 of left minus right eye."""
    left, top, right, bottom = (float(v) for v in box[:4])
    angle = math.degrees(math.atan2(left_eye[1] - right_eye[1], left_eye[0] - right_eye[0]))
    return Face(int((left + right) / 2), int((top + bottom) / 2), int(right - left), int(bottom - top), angle)


def yunet_faces(rows: np.ndarray | None, threshold: float) -> list[Face]:
    """Faces of ``cv2.FaceDetectorYN.detect`` rows (x, y, w, h, right eye x, y, left eye x, y, nose, mouth corners,
    score), largest first."""
    faces = []
    for row in [] if rows is None else rows:
        if row[14] >= threshold:
            x, y, w, h = row[:4]
            faces.append(face_from_box((x, y, x + w, y + h), row[4:6], row[6:8]))
    return sorted(faces, key=lambda f: f.size, reverse=True)


def make_detector(yunet_model: str | None, threshold: float) -> Callable[[np.ndarray], list[Face]]:
    """A function from a BGR ``(H, W, 3)`` image to its faces, largest first (see the module text)."""
    cv2 = require("cv2", "canny", "tools/detect_face_rotate.py")
    if yunet_model is not None:
        if not Path(yunet_model).is_file():
            raise FileNotFoundError(f"--yunet_model {yunet_model}: no such file; {NO_DETECTOR}")
        detector = cv2.FaceDetectorYN.create(str(yunet_model), "", (320, 320), threshold)

        def detect_yunet(image: np.ndarray) -> list[Face]:
            detector.setInputSize((image.shape[1], image.shape[0]))
            return yunet_faces(detector.detect(image)[1], threshold)

        return detect_yunet
    try:
        anime = require("anime_face_detector", "canny", "sd-scripts' anime face detector")
    except MissingPackage:
        raise MissingPackage(NO_DETECTOR) from None
    model = anime.create_detector("yolov3")

    def detect_anime(image: np.ndarray) -> list[Face]:
        faces = []
        for pred in model(image):
            if pred["bbox"][-1] >= threshold:
                points = pred["keypoints"]
                faces.append(face_from_box(pred["bbox"], points[ANIME_RIGHT_EYE, :2], points[ANIME_LEFT_EYE, :2]))
        return sorted(faces, key=lambda f: f.size, reverse=True)

    return detect_anime


def pair(text: str | None, flag: str, kind: type) -> tuple | None:
    """``"a,b"`` as two numbers; an error naming the flag otherwise."""
    if text is None:
        return None
    parts = text.split(",")
    try:
        values = tuple(kind(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) <= 0:
        raise ValueError(f"{flag} {text!r}: expected two positive numbers 'width,height', e.g. 512,512")
    return values


def resize(cv2, image: np.ndarray, scale: float) -> np.ndarray:
    """Scale by ``scale`` (area filter when shrinking, Lanczos when enlarging, as sd-scripts' resize_image)."""
    h, w = image.shape[:2]
    size = (int(w * scale + 0.5), int(h * scale + 0.5))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LANCZOS4)


def crop_window(centre: int, crop: int, length: int) -> tuple[int, int]:
    """``(start, centre inside the crop)`` of a ``crop``-long window around ``centre``, moved inside ``length``."""
    start = min(max(centre - crop // 2, 0), length - crop)
    return start, centre - start


def face_image(cv2, image: np.ndarray, face: Face, args: argparse.Namespace, name: str) -> tuple[np.ndarray, Face]:
    """The rotated / resized / cropped image of one face and the face box in it (sd-scripts' steps)."""
    cx, cy, fw, fh = face.cx, face.cy, face.w, face.h
    if args.rotate:
        matrix = cv2.getRotationMatrix2D((cx, cy), face.angle, 1.0)
        image = cv2.warpAffine(image, matrix, image.shape[1::-1], flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
    if args.crop is None and args.ratio is None:
        return image, Face(cx, cy, fw, fh, 0.0)
    h, w = image.shape[:2]
    if args.ratio is not None:
        crop_w, crop_h = int(face.size * args.ratio[0] + 0.5), int(face.size * args.ratio[1] + 0.5)
    else:
        crop_w, crop_h = args.crop
    scale = 1.0
    if args.resize_face_size is not None:
        scale = max(args.resize_face_size / face.size, crop_w / w, crop_h / h)
        if scale != args.resize_face_size / face.size:
            logger.warning("%s: the crop does not fit at face size %d; the face is scaled more", name, face.size)
    elif args.ratio is None:
        if w < crop_w or h < crop_h:
            logger.warning("%s: image smaller than the crop; enlarged (quality is lost)", name)
            scale = max(crop_w / w, crop_h / h, 1.0)
        if args.resize_fit:
            scale = max(crop_w / w, crop_h / h)
    if scale != 1.0:
        image = resize(cv2, image, scale)
        cx, cy, fw, fh = (int(v * scale + 0.5) for v in (cx, cy, fw, fh))
    h, w = image.shape[:2]
    crop_w, crop_h = min(crop_w, w), min(crop_h, h)
    x, cx = crop_window(cx, crop_w, w)
    y, cy = crop_window(cy, crop_h, h)
    return image[y : y + crop_h, x : x + crop_w], Face(cx, cy, fw, fh, 0.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--src_dir", type=str, required=True, help="folder of the images to read")
    add("--dst_dir", type=str, required=True, help="folder to write the face images to")
    add("--rotate", action="store_true", help="turn each image so that the face is upright")
    add("--resize_fit", action="store_true", help="scale so that the crop fills the image's shorter side")
    add("--resize_face_size", type=int, default=None, help="scale so that the face is this many pixels, then crop")
    add("--crop_size", type=str, default=None, help="crop 'width,height' pixels around the face")
    add("--crop_ratio", type=str, default=None, help="crop 'horizontal,vertical' times the face size around it")
    add("--min_size", type=int, default=None, help="smallest face size written (included)")
    add("--max_size", type=int, default=None, help="largest face size written (excluded)")
    add("--multiple_faces", action="store_true", help="write every face (else the largest one)")
    add("--debug", action="store_true", help="draw the face box")
    add("--yunet_model", type=str, default=None, help="OpenCV YuNet .onnx face detector (else anime_face_detector)")
    add("--score_threshold", type=float, default=0.9, help="lowest detector score of a face (sd-scripts: 0.9)")
    return parser


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Write the face images; returns their paths."""
    args = build_parser().parse_args(argv)
    problems = []
    if args.resize_fit and args.resize_face_size is not None:
        problems.append("--resize_fit and --resize_face_size: choose one")
    if args.crop_ratio is not None and (args.resize_face_size is not None or args.crop_size is not None):
        problems.append("--crop_ratio cannot be used with --resize_face_size or --crop_size")
    if args.resize_face_size is not None and args.crop_size is None:
        problems.append("--resize_face_size scales before cropping: give --crop_size too")
    try:
        args.crop, args.ratio = pair(args.crop_size, "--crop_size", int), pair(args.crop_ratio, "--crop_ratio", float)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError("; ".join(problems))
    cv2 = require("cv2", "canny", "tools/detect_face_rotate.py")
    images = images_or_error(args.src_dir, recursive=False)
    detect = make_detector(args.yunet_model, args.score_threshold)
    out_dir = Path(args.dst_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in tqdm(images, desc="faces", unit="img"):
        image = read_image(cv2, path, cv2.IMREAD_UNCHANGED)
        if image.ndim == 2:
            image = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
        elif image.shape[2] == 4:
            logger.warning("%s: transparency is dropped", path)
            image = np.ascontiguousarray(image[:, :, :3])
        faces = [f for f in detect(image) if (args.min_size or 0) <= f.size < (args.max_size or math.inf)]
        for number, face in enumerate(faces if args.multiple_faces else faces[:1], start=1):
            result, box = face_image(cv2, image, face, args, str(path))
            if args.debug:
                result = result.copy()
                corners = (box.cx - box.w // 2, box.cy - box.h // 2), (box.cx + box.w // 2, box.cy + box.h // 2)
                cv2.rectangle(result, *corners, (255, 0, 255), max(box.w // 20, 1))
            suffix = f"_{number:02d}" if args.multiple_faces else ""
            name = f"{path.stem}{suffix}_{box.cx:04d}_{box.cy:04d}_{box.w:04d}_{box.h:04d}.png"
            written.append(write_image(cv2, result, out_dir / name))
    print(f"{len(written)} face images from {len(images)} images written to {out_dir}")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
