"""gen_img.py's ControlNet-LLLite flags (sd-scripts' names): ``--control_net_lllite_models`` (files),
``--control_net_multipliers`` (one per file; 1.0 when not given) and ``--guide_image_path`` (the conditioning
images; image i of a run uses guide image i modulo their count, as sd-scripts). The files are applied by the
network code (gen_img.py: ``networks.lllite``); here they are only read and checked."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

IMAGE_TYPES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def add_control_net_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ControlNet-LLLite")
    g.add_argument(
        "--control_net_lllite_models",
        type=str,
        default=None,
        nargs="*",
        help="ControlNet-LLLite files to apply (the LLLite trainer's output)",
    )
    g.add_argument(
        "--control_net_multipliers",
        type=float,
        default=None,
        nargs="*",
        help="strength of each --control_net_lllite_models file (default 1.0)",
    )
    g.add_argument("--guide_image_path", type=str, default=None, nargs="*",
                   help="conditioning image(s), or folders of them, for the ControlNet")  # fmt: skip


@dataclass(frozen=True)
class ControlNetConfig:
    """The ControlNet-LLLite files with their multipliers, and the guide images in use order."""

    models: tuple[tuple[Path, float], ...] = ()
    guide_images: tuple[Path, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.models)

    @classmethod
    def from_args(cls, args: argparse.Namespace, problems: list[str]) -> ControlNetConfig:
        """Read the flags; problems (a missing file, a multiplier without a model, models without images) join
        ``problems``."""
        files = [Path(p) for p in args.control_net_lllite_models or ()]
        multipliers = list(args.control_net_multipliers or ())
        for f in files:
            if not f.is_file():
                problems.append(f"--control_net_lllite_models {f}: file not found")
        if len(multipliers) > len(files):
            problems.append(f"--control_net_multipliers: {len(multipliers)} values for {len(files)} "
                            "--control_net_lllite_models files; give one per file")  # fmt: skip
        guides = _guide_images(args.guide_image_path or (), problems)
        if files and not guides:
            problems.append("--control_net_lllite_models needs --guide_image_path (the conditioning image)")
        if guides and not files:
            problems.append("--guide_image_path: guide images need --control_net_lllite_models (a ControlNet-LLLite)")
        models = tuple((f, multipliers[i] if i < len(multipliers) else 1.0) for i, f in enumerate(files))
        return cls(models, tuple(guides))

    def guide_for(self, image_number: int) -> Path:
        return self.guide_images[image_number % len(self.guide_images)]


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
