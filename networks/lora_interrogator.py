"""Which tokens an adapter's text-encoder part changes most (sd-scripts' networks/lora_interrogator.py).

    python networks/lora_interrogator.py --sd_model model.safetensors --model lora.safetensors \
        [--batch_size 16] [--clip_skip 2] [--v2] [--top_k 100] [--device cuda] [--precision fp16]

For every token id t from 0 to the tokenizer's largest special id (the whole CLIP vocabulary, 49,408 ids), the prompt
``<BOS> t <EOS>`` (three tokens, no padding) is encoded by the model's text encoder(s) without and with the adapter,
through the family's prompt encoding (--clip_skip as in training; SDXL: both encoders' penultimate states side by
side plus the pooled output). The score of t is sd-scripts' ``mean |E_adapter − E_base|`` over the three states
(and, for SDXL, the pooled vector); the ``--top_k`` tokens with the largest scores are printed as sd-scripts prints
them, ``[rank]: id token: score``. Any adapter algorithm training writes (LoRA, LoCon, LoHa, LoKr, DoRA...) works:
the file's text-encoder modules are injected with the training code; its UNet modules are not needed. A file
without text-encoder modules cannot be interrogated (an error says so). The family (SD1, SD2, SDXL) is read from
--sd_model; --v2 / --sdxl are checked against it. Models with a T5 encoder (FLUX.1, Chroma) are refused with a message.
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
from library.families import FAMILIES
from networks.tool_common import add_family_flags, device_problem, dtype_of, family_as_flagged, family_titles, progress

logger = logging.getLogger(__name__)
_CLIP_LAYOUTS = ("clip", "open_clip")  # TextEncoderSpec.layout of the CLIP text encoders


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sd_model", default=None, help="the model the adapter is for: .safetensors / .ckpt file or "
                   "diffusers folder")  # fmt: skip
    p.add_argument("--model", default=None, help="the adapter file to interrogate (.safetensors / .ckpt / .pt)")
    p.add_argument("--batch_size", type=int, default=16, help="prompts per text-encoder call (default 16)")
    p.add_argument("--clip_skip", type=int, default=None, help="use the n-th layer from the end (n >= 1), as in "
                   "training")  # fmt: skip
    add_family_flags(p, "accepted: the family is read from --sd_model and checked")  # --v2, --sdxl
    p.add_argument("--top_k", type=int, default=100, help="how many tokens to print (default 100, as sd-scripts)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--precision", choices=["float", "fp16", "bf16"], default=None,
                   help="text-encoder precision (default: fp16 on a GPU as sd-scripts, float on the CPU)")  # fmt: skip
    return p


def check(args: argparse.Namespace) -> None:
    """Every problem of the command line in one ConfigError."""
    problems = []
    for flag, value, what in (("--sd_model", args.sd_model, "the model (file or diffusers folder)"),
                              ("--model", args.model, "the adapter file")):  # fmt: skip
        if not value:
            problems.append(f"{flag} is required: {what}")
        elif not Path(value).exists():
            problems.append(f"{flag} {value}: no such file or folder")
    if args.batch_size < 1:
        problems.append(f"--batch_size {args.batch_size}: must be at least 1")
    if args.top_k < 1:
        problems.append(f"--top_k {args.top_k}: must be at least 1")
    device_problem(args.device, problems)
    if args.clip_skip is not None and args.clip_skip < 1:
        problems.append(f"--clip_skip {args.clip_skip}: must be at least 1 (1 = the last layer)")
    if problems:
        raise ConfigError(problems)


def text_encoder_state(state: dict[str, Tensor], roots, source: str) -> dict[str, Tensor]:
    """The file's text-encoder modules; a ValueError when a module is not in the model (another family's file) or
    when there is none."""
    from networks import files

    groups = files.group_by_module(state)
    index = files.module_index(roots)
    unknown = [n for n in groups if n not in index]
    if unknown or not groups:
        raise ValueError(files.explain_unmatched(unknown or ["(no modules)"], roots, source))
    te = [n for n in groups if not index[n].is_unet]
    if not te:
        raise ValueError(f"{source}: this adapter has no text-encoder modules (all {len(groups)} are UNet modules, "
                         f"e.g. {next(iter(groups))}), so it changes no token's text embedding and cannot be "
                         "interrogated; it needs an adapter trained with its text-encoder part")  # fmt: skip
    return {f"{n}.{suffix}": t for n in te for suffix, t in groups[n].items()}


def prompts(parts, token_ids: Sequence[int]) -> list[Tensor]:
    """Per text encoder, the ids (B, 3) of ``<BOS> t <EOS>`` for every t (sd-scripts' prompts, unpadded)."""
    return [torch.tensor([[tok.bos_token_id, t, tok.eos_token_id] for t in token_ids]) for tok in parts.tokenizers]


def embedding(family, parts, ids: list[Tensor], clip_skip: int | None) -> Tensor:
    """(B, F) float32: the three tokens' encoder states (and the pooled output, where the family has one)."""
    cond = family.encode_tokens(parts, ids, clip_skip)
    out = [cond.hidden_states[:, :3].flatten(1).float()]
    if cond.pooled is not None:
        out.append(cond.pooled.flatten(1).float())
    return torch.cat(out, dim=1)


@torch.no_grad()
def token_scores(family, parts, network, batch_size: int, clip_skip: int | None) -> Tensor:
    """(V,) sd-scripts' score per token id: mean |E_adapter − E_base| (module docstring); the adapter is switched
    off (multiplier 0: the base forward) and on per batch, so no table of embeddings is kept."""
    tokenizer = parts.tokenizers[0]
    count = max(tokenizer.all_special_ids) + 1
    scores = torch.empty(count)
    bar = progress(count, "interrogating", unit="token")
    for start in range(0, count, batch_size):
        ids = prompts(parts, range(start, min(count, start + batch_size)))
        network.set_multiplier(0.0)
        base = embedding(family, parts, ids, clip_skip)
        network.set_multiplier(1.0)
        adapted = embedding(family, parts, ids, clip_skip)
        scores[start : start + len(ids[0])] = (adapted - base).abs().mean(dim=1).cpu()
        bar.update(len(ids[0]))
    bar.close()
    return scores


def _clip_only(family) -> bool:
    """Whether every text encoder of ``family`` is a CLIP (whose prompts are CLIP token ids)."""
    return all(te.layout in _CLIP_LAYOUTS for te in family.spec.text_encoders)


def run(argv: Sequence[str] | None = None) -> list[tuple[int, float]]:
    """Interrogate; prints the top ``--top_k`` and returns every token as (id, score), highest score first."""
    from library.files.weights import load_state_dict
    from networks import network_from_state_dict

    args = build_parser().parse_args(argv)
    check(args)
    try:
        family = family_as_flagged(args.sd_model, args)
    except ValueError as e:
        raise ConfigError([f"--sd_model {e}"]) from e
    if not _clip_only(family):
        with_clip = family_titles([n for n, f in FAMILIES.items() if _clip_only(f)], " / ")
        other = next(te.layout for te in family.spec.text_encoders if te.layout not in _CLIP_LAYOUTS)
        raise ConfigError([f"--sd_model {args.sd_model} is a {family.spec.title} model: lora_interrogator.py scores "
                           f"CLIP tokens through CLIP text encoders ({with_clip}), as sd-scripts' tool; a "
                           f"{other.upper()} encoder's prompts are not CLIP token ids, so this model is not "
                           "supported"])  # fmt: skip
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype_of(args.precision, torch.float16 if torch.device(device).type == "cuda" else torch.float32)
    state, _ = load_state_dict(args.model)
    logger.info("loading %s (%s, %s on %s)", args.sd_model, family.spec.title, dtype, device)
    parts = family.load(args.sd_model, dtype=dtype, device=device)
    roots = family.adapter_roots(parts)
    network = network_from_state_dict(text_encoder_state(state, roots, args.model), roots, source=args.model)
    network.to(device)
    logger.info("%s: %d text-encoder modules", args.model, len(network))
    scores = token_scores(family, parts, network, args.batch_size, args.clip_skip)
    order = torch.argsort(scores, descending=True, stable=True).tolist()
    ranked = [(t, float(scores[t])) for t in order]
    tokenizer = parts.tokenizers[0]
    print(f"top {min(args.top_k, len(ranked))}:")
    for i, (token, score) in enumerate(ranked[: args.top_k]):
        text = tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens([token]))
        print(f"[{i:3d}]: {token:5d} {text:<20s}: {score:.5f}")
    return ranked


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
