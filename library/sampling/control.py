"""gen_img.py's ControlNet flags (sd-scripts' names): ``--control_net_models`` (ControlNet files) or
``--control_net_lllite_models`` (ControlNet-LLLite files; not both, as sd-scripts), each file's
``--control_net_multipliers`` (strength, 1.0 when not given), ``--control_net_ratios`` (the fraction of the sampling
steps that is controlled, from the first; 1.0 when not given) and ``--control_net_preps`` (a ControlNet's guide-image
preprocessor: ``canny[_<low>[_<high>]]``, sd-scripts' default thresholds 63 and 191, or ``none``), and
``--guide_image_path`` (the conditioning images, or folders of them). Image n of a run uses guide image n modulo
their count; with several ControlNets, ControlNet j of image n uses guide image ``n * count + j`` (modulo), as
sd-scripts pairs them. The files are applied by the network code (gen_img.py); here they are only read and checked."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_TYPES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_CANNY = re.compile(r"canny(?:_(\d+))?(?:_(\d+))?")


def add_control_net_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ControlNet / ControlNet-LLLite")
    g.add_argument("--control_net_lllite_models", type=str, default=None, nargs="*",
                   help="ControlNet-LLLite files to apply (the LLLite trainer's output)")  # fmt: skip
    g.add_argument("--control_net_models", type=str, default=None, nargs="*",
                   help="ControlNet files (our ControlNet trainers' output, or any original-named or "
                   "diffusers-named ControlNet file) or diffusers ControlNet folders")  # fmt: skip
    g.add_argument(
        "--control_net_preps",
        type=str,
        default=None,
        nargs="*",
        help="each ControlNet's guide-image preprocessor: canny_<low>_<high> (e.g. canny_63_191) or none",
    )
    g.add_argument("--control_net_multipliers", type=float, default=None, nargs="*",
                   help="strength of each ControlNet / LLLite file (default 1.0)")  # fmt: skip
    g.add_argument(
        "--control_net_ratios",
        type=float,
        default=None,
        nargs="*",
        help="fraction of the steps each ControlNet guides, from the first (default 1.0: all)",
    )
    g.add_argument("--guide_image_path", type=str, default=None, nargs="*",
                   help="conditioning image(s), or folders of them, for the ControlNet")  # fmt: skip


@dataclass(frozen=True)
class ControlModel:
    """One control file with its settings."""

    path: Path
    kind: str  # "controlnet" | "lllite"
    multiplier: float = 1.0
    ratio: float = 1.0
    prep: str | None = None  # "canny_63_191" (normalised) or None


@dataclass(frozen=True)
class ControlNetConfig:
    """The control files with their settings, and the guide images in use order."""

    models: tuple[ControlModel, ...] = ()
    guide_images: tuple[Path, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.models)

    @classmethod
    def from_args(cls, args: argparse.Namespace, problems: list[str]) -> ControlNetConfig:
        """Read the flags; problems (a missing file, more settings than files, an unknown preprocessor, models
        without images) join ``problems``."""
        lllite = [Path(p) for p in args.control_net_lllite_models or ()]
        nets = [Path(p) for p in getattr(args, "control_net_models", None) or ()]
        if lllite and nets:
            problems.append("--control_net_models and --control_net_lllite_models cannot be used together (as in "
                            "sd-scripts); give one kind")  # fmt: skip
        kind, flag, files = ("lllite", "--control_net_lllite_models", lllite) if lllite else (
            "controlnet", "--control_net_models", nets)  # fmt: skip
        for f in files:
            if not (f.is_file() or (kind == "controlnet" and f.is_dir())):
                problems.append(f"{flag} {f}: file not found")
        multipliers = _per_file(args, "control_net_multipliers", files, flag, problems)
        ratios = _per_file(args, "control_net_ratios", files, flag, problems)
        preps = list(getattr(args, "control_net_preps", None) or ())
        if preps and kind == "lllite":
            problems.append("--control_net_preps: preprocessors apply to --control_net_models (ControlNet) only; "
                            "give ControlNet-LLLite its guide images preprocessed")  # fmt: skip
        elif len(preps) > len(files):
            problems.append(f"--control_net_preps: {len(preps)} values for {len(files)} {flag} files")
        preps = [_prep_name(p, problems) for p in preps]
        for r in ratios:
            if not 0.0 <= r <= 1.0:
                problems.append(f"--control_net_ratios: {r} is not a fraction of the steps (0 to 1)")
        if kind == "lllite" and any(r < 1.0 for r in ratios):
            problems.append("--control_net_ratios below 1 are not available for ControlNet-LLLite yet (only for "
                            "--control_net_models); drop them to guide every step")  # fmt: skip
        guides = _guide_images(args.guide_image_path or (), problems)
        if files and not guides:
            problems.append(f"{flag} needs --guide_image_path (the conditioning image)")
        if guides and not files:
            problems.append("--guide_image_path: guide images need --control_net_models or "
                            "--control_net_lllite_models")  # fmt: skip

        def at(values: list, i: int, default: Any) -> Any:
            return values[i] if i < len(values) else default

        models = tuple(ControlModel(f, kind, at(multipliers, i, 1.0), at(ratios, i, 1.0), at(preps, i, None))
                       for i, f in enumerate(files))  # fmt: skip
        return cls(models, tuple(guides))

    def guide_for(self, image_number: int, model_index: int = 0) -> Path:
        """Image ``image_number``'s guide for control file ``model_index``: ControlNets take the images in turn
        (sd-scripts' order), LLLite files share the image's guide."""
        n = len(self.models) if self.models and self.models[0].kind == "controlnet" else 1
        return self.guide_images[(image_number * n + model_index) % len(self.guide_images)]


def preprocessor(name: str | None) -> Callable[[Any], Any] | None:
    """The guide-image preprocessor of a ``--control_net_preps`` value: (H, W, 3) uint8 RGB -> (H, W) uint8 edges
    (OpenCV's Canny on the greyscale image, as sd-scripts), or None."""
    if name is None:
        return None
    m = _CANNY.fullmatch(name)
    low, high = int(m[1]), int(m[2])
    import cv2

    return lambda rgb: cv2.Canny(cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY), low, high)


def _prep_name(value: str, problems: list[str]) -> str | None:
    if value.lower() == "none":
        return None
    m = _CANNY.fullmatch(value)
    if m is None:
        problems.append(f"--control_net_preps {value}: unknown preprocessor; sd-scripts has canny_<low>_<high> "
                        "(e.g. canny_63_191) and none")  # fmt: skip
        return None
    try:
        import cv2  # noqa: F401
    except ImportError:
        problems.append(f"--control_net_preps {value}: the canny preprocessor needs OpenCV (pip install "
                        "opencv-python-headless), or give an edge image without a preprocessor")  # fmt: skip
        return None
    return f"canny_{m[1] or 63}_{m[2] or 191}"


def _per_file(args: argparse.Namespace, dest: str, files: list[Path], flag: str, problems: list[str]) -> list[float]:
    values = list(getattr(args, dest, None) or ())
    if len(values) > len(files):
        name = "--" + dest
        problems.append(f"{name}: {len(values)} values for {len(files)} {flag} files; give one per file")
    return values


def _guide_images(paths, problems: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_TYPES)
            if not found:
                problems.append(f"--guide_image_path {p}: no images in the folder")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            problems.append(f"--guide_image_path {p}: not found")
    return out
