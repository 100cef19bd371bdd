"""sd-scripts' legacy ``gen_img_diffusers.py`` command line: gen_img.py, plus the flags only the old script has.

    python gen_img_diffusers.py --ckpt model.safetensors --prompt "a photo of sks_cat --n blurry --d 42" \\
        --XTI_embeddings sks_cat.safetensors --sampler euler_a --steps 28 --outdir out

Everything gen_img.py takes works the same (SD 1.x / 2.x / SDXL ..., adapters, ``--textual_inversion_embeddings``),
including ``--XTI_embeddings`` (files of train_textual_inversion_XTI.py: one embedding per cross-attention layer;
the token is the file name) and ControlNet (``--control_net_models --control_net_preps --control_net_ratios
--guide_image_path``, with the old name ``--control_net_weights`` of ``--control_net_multipliers``). The old
script's other own flags are refused with the reason: CLIP / VGG16 guidance (dropped by sd-scripts' gen_img.py too),
Gradual Latent and ``--highres_fix_steps`` (not available in gen_img.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import gen_img
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.cli.parse import add_unsupported


def add_legacy_flags(parser: argparse.ArgumentParser) -> None:
    """The flags sd-scripts' generation scripts have and gen_img.py lacks, refused when set (sd-scripts' defaults)."""
    g = parser.add_argument_group("sd-scripts flags not supported here")
    for flag, kind, default in (("--gradual_latent_every_n_steps", int, 3), ("--gradual_latent_ratio_step", float,
                                0.125), ("--gradual_latent_s_noise", float, 1.0),
                                ("--gradual_latent_unsharp_params", str, None)):  # fmt: skip
        add_unsupported(g, flag, "Gradual Latent", type=kind, default=default)
    add_unsupported(g, "--highres_fix_steps", "highres fix", type=int, default=28)


def build_parser() -> argparse.ArgumentParser:
    parser = gen_img.build_parser()
    parser.description = __doc__.split("\n\n")[0]
    add_legacy_flags(parser)
    g = parser.add_argument_group("gen_img_diffusers.py only")
    g.add_argument(
        "--control_net_weights",
        dest="control_net_multipliers",
        type=float,
        default=None,
        nargs="*",
        help="the old name of --control_net_multipliers: each --control_net_models file's strength",
    )
    guidance = (("--clip_guidance_scale", float, 0.0), ("--clip_image_guidance_scale", float, 0.0),
                ("--vgg16_guidance_scale", float, 0.0), ("--vgg16_guidance_layer", int, 20))  # fmt: skip
    for flag, kind, default in guidance:
        add_unsupported(g, flag, "CLIP / VGG16 guidance, which sd-scripts' gen_img.py dropped as well", type=kind,
                        default=default)  # fmt: skip
    return parser


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """gen_img.run with this script's parser; returns the written image paths."""
    return gen_img.run(argv, parser=build_parser())


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
