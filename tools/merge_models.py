"""Weighted merge of whole Stable Diffusion models (sd-scripts' tools/merge_models.py).

    python tools/merge_models.py --models a.safetensors b_diffusers_folder c.ckpt --ratios 0.5 0.3 0.2 \
        --output merged.safetensors [--unet_only] [--precision float] [--saving_precision fp16] [--show_skipped]

Every weight of the output is Σᵢ ratioᵢ·Wᵢ over the models (sd-scripts' rule): without --ratios each ratio is 1/N;
given ratios are used as they are, not normalised (ratios that do not sum to 1 scale the weights). With
--unet_only only the UNet is merged; the VAE and the text encoders are the first model's, unchanged. Integer
tensors (position ids) are the first model's.

Inputs may be single files (.safetensors / .ckpt) and diffusers folders, in any mix; every input is read through
the model family's loader, so files that name the same weight differently (legacy text-encoder keys, old VAE layouts)
are merged weight by weight. All models must be of one family (SD1, SD2 or SDXL), one architecture and one prediction
type; anything else is refused before any weight is merged. The output's format follows --output: a name ending in
.safetensors / .ckpt is a single file, any other name a diffusers folder (sd-scripts writes .safetensors only and adds
the suffix). The output carries ``modelspec.merged_from`` (the input names) and the first model's prediction type.

Keys outside the model (EMA copies ``model_ema.*``, schedule buffers such as ``alphas_cumprod``) are not carried
into the output; --show_skipped lists them per input. The SD2 OpenCLIP tensors that the HF text encoder does not hold
(the 24th block, ``logit_scale``) follow sd-scripts' rule for keys not in every model: a key missing from a later
model takes the first model's value at that model's ratio (with a warning), a key missing from the first model is
skipped (listed with --show_skipped).
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
from torch import Tensor

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from networks.tool_common import device_problem, dtype_of, progress

logger = logging.getLogger(__name__)
SINGLE_FILE = (".safetensors", ".ckpt")
MARKERS = ("v_pred", "ztsnr")  # prediction-type marker tensors: read by the loader, written again by the saver


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=None, help="models to merge: .safetensors / .ckpt files or "
                   "diffusers folders, in any mix")  # fmt: skip
    p.add_argument("--output", default=None, help="output: .safetensors / .ckpt (single file) or a folder name "
                   "(diffusers)")  # fmt: skip
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="one ratio per model (default 1/N each; "
                   "not normalised)")  # fmt: skip
    p.add_argument("--unet_only", action="store_true", help="merge the UNet only; VAE and text encoders are the "
                   "first model's")  # fmt: skip
    p.add_argument("--device", default="cpu", help="device the weights are merged on (default cpu)")
    p.add_argument("--precision", choices=["float", "fp16", "bf16"], default="float",
                   help="calculation precision (default float)")  # fmt: skip
    p.add_argument("--saving_precision", choices=["float", "fp16", "bf16"], default="float",
                   help="saving precision (default float)")  # fmt: skip
    p.add_argument("--show_skipped", action="store_true", help="list the keys of each input that are not merged")
    return p


def check(args: argparse.Namespace):
    """(family, ratios); every problem of the command line in one ConfigError (files that do not exist or are no
    model, models of different families, a ratio list that does not match, an output name that is no model format,
    a device that is not there)."""
    problems = []
    device_problem(args.device, problems)
    models = args.models or []
    if not models:
        problems.append("--models is required: the models to merge (.safetensors / .ckpt files or diffusers folders)")
    for m in models:
        if not Path(m).exists():
            problems.append(f"--models {m}: no such file or folder")
    if args.ratios is not None and len(args.ratios) != len(models):
        problems.append(f"--ratios has {len(args.ratios)} value(s) for {len(models)} --models; give one ratio per "
                        "model, in the same order (or none: 1/N each)")  # fmt: skip
    if not args.output:
        problems.append("--output is required: a .safetensors / .ckpt file or a folder name (diffusers)")
    elif Path(args.output).suffix.lower() in (".pt", ".pth", ".bin"):
        problems.append(f"--output {args.output}: save a model as .safetensors, .ckpt or a folder name (diffusers)")
    elif any(Path(args.output).resolve() == Path(m).resolve() for m in models):
        problems.append(f"--output {args.output} is one of the --models; write the merge to a new name")
    family = detect_families([m for m in models if Path(m).exists()], problems)
    if problems:
        raise ConfigError(problems)
    return family, list(args.ratios) if args.ratios is not None else [1.0 / len(models)] * len(models)


def detect_families(models: Sequence[str], problems: list[str]):
    """The one family of all ``models`` (None when there is none); problems for files that are no model and for
    models of different families, naming each file's family."""
    from library.families import detect_family

    found = {}
    for m in models:
        try:
            found[m] = detect_family(m)
        except ValueError as e:
            problems.append(f"--models {e}")
    names = {f.name for f in found.values()}
    if len(names) > 1:
        listing = ", ".join(f"{m} ({f.spec.title})" for m, f in found.items())
        problems.append(f"the models are of different families: {listing}; only models of one family (and one "
                        "architecture) can be merged weight by weight")  # fmt: skip
    return next(iter(found.values()), None)


def components(parts, unet_only: bool) -> dict[str, torch.nn.Module]:
    """The modules whose weights are merged: {name: module}."""
    out = {"UNet": parts.denoiser}
    if not unet_only:
        out["VAE"] = parts.vae
        out.update({f"text encoder {i + 1}": te for i, te in enumerate(parts.text_encoders)})
    return out


def architecture_problems(first, other, source: str, unet_only: bool) -> list[str]:
    """Why ``other`` (loaded from ``source``) cannot be merged into ``first``: other keys or shapes per component,
    another prediction type."""
    problems = []
    if other.prediction_type != first.prediction_type:
        problems.append(f"{source} predicts {other.prediction_type} but {first.source} predicts "
                        f"{first.prediction_type}; models of different objectives cannot be merged")  # fmt: skip
    ztsnr = [bool(p.scheduler_config.get("rescale_betas_zero_snr")) for p in (first, other)]
    if ztsnr[0] != ztsnr[1]:
        logger.warning("%s is %sa zero-terminal-SNR model and %s is %s; the output keeps the first model's schedule",
                       source, "" if ztsnr[1] else "not ", first.source, "one" if ztsnr[0] else "not")  # fmt: skip
    mine, theirs = components(first, unet_only), components(other, unet_only)
    for name, module in mine.items():
        a, b = module.state_dict(), theirs[name].state_dict()
        keys = [k for k in a.keys() ^ b.keys()]
        shapes = [f"{k}: {tuple(b[k].shape)} vs {tuple(a[k].shape)}" for k in a if k in b and a[k].shape != b[k].shape]
        if keys or shapes:
            details = "; ".join(f"{label} {len(items)} (e.g. {', '.join(sorted(items)[:3])})"
                                for label, items in (("keys in one model only", keys), ("other shapes", shapes))
                                if items)  # fmt: skip
            problems.append(f"{source}: its {name} has another architecture than {first.source}'s: {details}; "
                            "only models of one architecture can be merged")  # fmt: skip
    return problems


@torch.no_grad()
def scale_into(target: dict[str, Tensor], source: dict[str, Tensor] | None, ratio: float, dtype: torch.dtype) -> None:
    """``target[k] = ratio·target[k]`` (``source`` None) or ``target[k] += ratio·source[k]``, floating tensors only,
    in ``dtype`` (sd-scripts: ``merged + ratio * value.to(dtype)``)."""
    seen = set()
    for k, t in target.items():
        if not t.is_floating_point() or t.data_ptr() in seen:
            continue  # integer buffers (position ids) stay the first model's; a tied tensor is merged once
        seen.add(t.data_ptr())
        if source is None:
            t.mul_(ratio)
        else:
            t.add_(source[k].to(device=t.device, dtype=dtype) * ratio)


def merge_extras(first, others: Sequence[tuple[str, list]], ratios: Sequence[float], dtype, show_skipped: bool) -> None:
    """Text-encoder tensors outside the HF modules (SD2's OpenCLIP extras), merged with sd-scripts' rule for keys
    not in every model (module docstring), into ``first``'s extras; ``others``: (source, its extras) per model."""
    firsts = first.text_encoder_extras
    for i, extras in enumerate(firsts):
        original = {k: v.clone() for k, v in extras.items()}
        for k, v in extras.items():
            if v.is_floating_point():
                extras[k] = v.to(dtype) * ratios[0]
        for (source, other_extras), ratio in zip(others, ratios[1:]):
            theirs = (other_extras or [{}] * len(firsts))[i]
            for k, v in extras.items():
                if not v.is_floating_point():
                    continue
                if k in theirs:
                    extras[k] = v + theirs[k].to(device=v.device, dtype=dtype) * ratio
                else:
                    logger.warning("%s: key %s not in this model, the first model's value is used at ratio %g",
                                   source, k, ratio)  # fmt: skip
                    extras[k] = v + original[k].to(dtype) * ratio
            skipped = sorted(set(theirs) - set(extras))
            if show_skipped and skipped:
                print(f"skipped ({source}, text encoder {i + 1}, not in the first model): {', '.join(skipped)}")


def unread_keys(path: Path, family) -> list[str]:
    """Keys of a single file that the family's loader does not read (EMA copies, schedule buffers...)."""
    from library.families.convert import VAE_PREFIX
    from library.families.loading import check_model_path
    from library.families.sd.convert import UNET_PREFIX
    from library.files.weights import load_state_dict

    path = check_model_path(path)
    if path.is_dir():
        return []
    if path.suffix.lower() == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    else:
        keys = list(load_state_dict(path)[0])
    read = (UNET_PREFIX, VAE_PREFIX, *(te.prefix for te in family.spec.text_encoders))
    return sorted(k for k in keys if not k.startswith(read) and k not in MARKERS)


def merge_models(args: argparse.Namespace, family, ratios: list[float]):
    """Load every model, check them against the first, and merge into the first model's parts (returned)."""
    dtype = dtype_of(args.precision)
    load = lambda m: family.load(m, dtype=dtype, device=args.device)  # noqa: E731
    if args.show_skipped:
        for m in args.models:
            unread = unread_keys(Path(m), family)
            if unread:
                print(f"skipped ({m}, not part of the model): {len(unread)} key(s): {', '.join(unread)}")
    first = load(args.models[0])
    logger.info("%s: %s model, ratio %g", args.models[0], family.spec.title, ratios[0])
    merged = {name: m.state_dict() for name, m in components(first, args.unet_only).items()}
    for state in merged.values():
        scale_into(state, None, ratios[0], dtype)
    others = []
    for m, ratio in zip(args.models[1:], ratios[1:]):
        other = load(m)
        problems = architecture_problems(first, other, m, args.unet_only)
        if problems:
            raise ConfigError(problems)
        theirs = components(other, args.unet_only)
        bar = progress(sum(len(s) for s in merged.values()), f"merging {Path(m).name} x{ratio:g}", unit="tensor")
        for name, state in merged.items():
            scale_into(state, theirs[name].state_dict(), ratio, dtype)
            bar.update(len(state))
        bar.close()
        others.append((other.source, other.text_encoder_extras))  # small tensors only
        del other, theirs  # one input at a time besides the merge
    if not args.unet_only:
        merge_extras(first, others, ratios, dtype, args.show_skipped)
    return family, first


def run(argv: Sequence[str] | None = None) -> Path:
    """Merge; returns the path written."""
    from networks.merge import merged_from

    args = build_parser().parse_args(argv)
    family, ratios = check(args)
    family, parts = merge_models(args, family, ratios)
    titles = [Path(m).stem if Path(m).suffix.lower() in SINGLE_FILE else Path(m).name for m in args.models]
    terms = " + ".join(f"{r:g}·{t}" for r, t in zip(ratios, titles))
    what = f"merged by merge_models.py: {terms}" + (" (UNet only)" if args.unet_only else "")
    meta = {"modelspec.merged_from": merged_from(titles), "modelspec.description": what}
    path = family.save(parts, args.output, dtype=dtype_of(args.saving_precision), metadata=meta)
    kind = "single file" if Path(args.output).suffix.lower() in SINGLE_FILE else "diffusers folder"
    print(f"merged {len(args.models)} {family.spec.title} model(s) ({terms}) into {path} ({kind}, "
          f"{args.saving_precision})")  # fmt: skip
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
