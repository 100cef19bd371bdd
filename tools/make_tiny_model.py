"""Write tiny SD1 / SD2-v / SDXL / FLUX.1 / Chroma / SD3 / SD3.5 models with random weights (tests, the demo, trying
sdtrain offline).

    python tools/make_tiny_model.py --out models/tiny [--family sd1 sd2 sdxl flux-dev flux-schnell chroma sd3
        sd3.5-medium sd3.5-large] [--seed 0]

writes, per family, ``<out>/<family>/`` (a diffusers folder) and ``<out>/<family>.safetensors`` (a single-file
checkpoint in the original layout; FLUX.1 / Chroma: the BFL transformer, with the ``--clip_l``, ``--t5xxl`` and
``--ae`` files sd-scripts takes beside it as ``<out>/<family>_{clip_l,t5xxl,ae}.safetensors``; SD3 / SD3.5: the SAI
file with its VAE and text encoders, plus ``<out>/<family>_dit.safetensors`` (transformer and VAE only, as
``sd3.5_large.safetensors``) and the ``--clip_l --clip_g --t5xxl --vae`` files as
``<out>/<family>_{clip_l,clip_g,t5xxl,vae}.safetensors``). The models have the real block layout, module names and
tokenizers of the released models with tiny widths (see ``library/families/tiny.py``, ``library/families/flux/tiny.py``,
``library/families/sd3/tiny.py``); every training script accepts either layout.
Without ``--family`` the SD families are written.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from library.cli.main_guard import main_guard  # noqa: E402
from library.families import get_family  # noqa: E402
from library.families.flux.tiny import VARIANTS as FLUX_VARIANTS  # noqa: E402
from library.families.flux.tiny import build_tiny_flux, write_tiny_files  # noqa: E402
from library.families.sd3.configs import VARIANTS as SD3_VARIANTS  # noqa: E402
from library.families.sd3.tiny import build_tiny_sd3  # noqa: E402
from library.families.sd3.tiny import write_tiny_files as write_tiny_sd3_files  # noqa: E402
from library.families.tiny import FAMILIES, build_tiny  # noqa: E402

# joint blocks of the tiny SD3 models this tool writes (None: the variant's tiny default, 34 for sd3.5-large): the
# fewest that sd-scripts' documented command lines accept (docs/fine_tune.md's sd3_train.py --blocks_to_swap 10)
CLI_SD3_BLOCKS = {"sd3": 12, "sd3.5-medium": 12}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--family", nargs="+", choices=FAMILIES + FLUX_VARIANTS + SD3_VARIANTS, default=list(FAMILIES),
                        help="families to write (default: the SD families)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument(
        "--flux_blocks",
        type=int,
        nargs=2,
        default=[11, 20],
        metavar=("DOUBLE", "SINGLE"),
        help="FLUX / Chroma double and single blocks (default 11 20: enough for sd-scripts' "
        "documented --blocks_to_swap 18, which keeps 2 blocks of each kind on the device)",
    )
    parser.add_argument(
        "--sd3_blocks",
        type=int,
        default=None,
        metavar="N",
        help="SD3 / SD3.5 joint blocks (default: 12, enough for sd-scripts' documented sd3_train.py "
        "--blocks_to_swap 10; 34 for sd3.5-large, enough for its sd3_train_network.py --blocks_to_swap 32; swapping "
        "keeps 2 blocks on the device)",
    )
    return parser


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Write the requested tiny models; returns the paths written (folder, file per family)."""
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    written = []
    for name in args.family:
        start = time.perf_counter()
        family = get_family(name)
        flux, sd3 = name in FLUX_VARIANTS, name in SD3_VARIANTS
        if sd3:
            parts = build_tiny_sd3(name, args.seed, args.sd3_blocks or CLI_SD3_BLOCKS.get(name))
        else:
            parts = (
                build_tiny_flux(name, args.seed, tuple(args.flux_blocks)) if flux else build_tiny(name, seed=args.seed)
            )
        folder = family.save(parts, out / name)
        single = family.save(parts, out / f"{name}.safetensors")
        if flux:  # sd-scripts' --clip_l / --t5xxl / --ae files beside the BFL transformer
            for part, path in write_tiny_files(parts, out / f".{name}_parts").items():
                if part != "model":
                    path.replace(out / f"{name}_{part}.safetensors")
            (out / f".{name}_parts" / "model.safetensors").unlink()
            (out / f".{name}_parts").rmdir()
        if sd3:  # the SAI file without encoders, and sd-scripts' --clip_l / --clip_g / --t5xxl / --vae files
            family.save(parts, out / f"{name}_dit.safetensors", text_encoders=False)
            tmp = out / f".{name}_parts"
            for part, path in write_tiny_sd3_files(parts, tmp, diffusers=False).items():
                if part in ("clip_l", "clip_g", "t5xxl", "vae"):
                    path.replace(out / f"{name}_{part}.safetensors")
            (tmp / "model.safetensors").unlink()
            tmp.rmdir()
        params = sum(p.numel() for m in (parts.denoiser, parts.vae, *parts.text_encoders) for p in m.parameters())
        print(f"{name}: {folder}/ and {single} ({params:,} parameters, {parts.prediction_type}) "
              f"in {time.perf_counter() - start:.1f}s")  # fmt: skip
        written += [folder, single]
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
