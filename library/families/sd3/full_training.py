"""sd3_train.py's own flags (full fine-tuning of SD3 medium / SD3.5 medium / large) and the rules they carry, as
sd-scripts' ``sd3_train.py`` reads them; sd3_train.py composes them with the run layer.

* ``--train_text_encoder``: CLIP-L and CLIP-G train too; ``--train_t5xxl`` adds T5-XXL (needs
  ``--train_text_encoder``). ``--learning_rate_te1 / te2 / te3``: the encoders' learning rates (default
  ``--learning_rate``; 0 = that encoder stays frozen). So the trained encoders are CLIP-L when
  ``lr_te1 != 0``, CLIP-G when ``lr_te2 != 0``, T5 when ``--train_t5xxl`` and ``lr_te3 != 0``.
* ``--use_t5xxl_cache_only``: sd-scripts' partial text cache. Every caption's encoder outputs are cached (the flag
  turns ``--cache_text_encoder_outputs`` on, with a warning), and while CLIP-L / CLIP-G train their outputs are
  recomputed at each step over the cached T5 tokens (``SD3Family.cond_with_trained_encoders``). Otherwise a cache
  with ``--train_text_encoder`` is refused, and ``--train_t5xxl`` refuses any cache.
* ``--num_last_block_to_freeze N``: sd-scripts freezes the last N of the MMDiT's *parameters* whose name contains
  ``x_block``, in the MMDiT's own parameter order (block by block; in a block ``attn.qkv``, ``attn.proj``,
  ``attn.ln_q``, ``attn.ln_k``, ``attn2.*`` likewise, ``mlp.fc1``, ``mlp.fc2``, ``adaLN_modulation.1``; weight before
  bias). N counts SAI parameters, not blocks: on SD3 medium a block's image stream has 10, so N = 10 freezes the
  last block's ``x_block``, and the context streams never freeze. An SAI ``qkv`` parameter is three diffusers
  parameters (``to_q | to_k | to_v``): all three freeze.
* ``--learning_rate 0``: the transformer is not trained (sd-scripts' ``train_mmdit``), the encoders may be.
* Output (sd-scripts' ``sd3_train_utils.save_models``): the SAI file holds the transformer and the VAE; a trained
  CLIP-L / CLIP-G (both when either trains) and a trained T5 go next to it as ``<name>_clip_l.safetensors``,
  ``<name>_clip_g.safetensors``, ``<name>_t5xxl.safetensors`` (transformers names, what ``--clip_l`` / ``--clip_g``
  / ``--t5xxl`` take). ``--save_clip`` / ``--save_t5xxl`` are sd-scripts' "[DOES NOT WORK]" flags (no unified
  checkpoint): accepted, said in the log, no effect.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from library.files.weights import save_state_dict

from ..full_training import PlainRules, raise_if
from . import keys as K

if TYPE_CHECKING:
    from ..base import Parts
    from ..protocol import ModelFamily

logger = logging.getLogger("sdtrain")
TEXT_ENCODER_NAMES = ("clip_l", "clip_g", "t5xxl")  # the order of Parts.text_encoders and of the sidecar files
# sd-scripts' DismantledBlock / AttentionLinears registration order (library/sd3_models.py) of the x_block modules
X_BLOCK_ORDER = ("attn.qkv", "attn.proj", "attn.ln_q", "attn.ln_k", "attn2.qkv", "attn2.proj", "attn2.ln_q",
                 "attn2.ln_k", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1")  # fmt: skip
SAVE_REASON = ("sd-scripts' sd3_train.py marks it [DOES NOT WORK] (no unified checkpoint): trained CLIP-L / CLIP-G / "
               "T5-XXL are written next to the model file as <name>_clip_l / _clip_g / _t5xxl.safetensors anyway")  # fmt: skip


@dataclass(frozen=True)
class SD3Rules(PlainRules):
    """sd3_train.py's rules: per-encoder learning rates (CLIP-L, CLIP-G, T5), ``--learning_rate 0`` = the
    transformer stays frozen, ``--num_last_block_to_freeze``, the trained encoders written next to the model file."""

    num_last_block_to_freeze: int | None = None

    def freeze(self, denoiser: nn.Module) -> None:
        if self.train_denoiser:
            freeze_last_x_block_parameters(denoiser, self.num_last_block_to_freeze)

    def save(self, family: ModelFamily, parts: Parts, path: Path, *, dtype: Any, metadata: Mapping[str, str],
             safetensors: bool) -> None:  # fmt: skip
        """A ``.safetensors`` path: the SAI file (transformer + VAE) and the trained encoders' files next to it
        (``<stem>_clip_l.safetensors`` ...), each atomic; a folder: the whole pipeline."""
        from .saving import text_encoder_state

        if path.suffix.lower() != ".safetensors":
            return super().save(family, parts, path, dtype=dtype, metadata=metadata, safetensors=safetensors)
        family.save(parts, path, dtype=dtype, metadata=metadata, text_encoders=False)
        for name in sidecar_names(self.text_encoder_lrs):
            te = parts.text_encoders[TEXT_ENCODER_NAMES.index(name)]
            save_state_dict(text_encoder_state(te), path.with_name(f"{path.stem}_{name}.safetensors"), {}, dtype)
        return None


class SD3FullTraining:
    """sd3_train.py's own flags (module docstring) and their reader."""

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        add_sd3_full_training_args(parser.add_argument_group("SD3 full fine-tuning", "sd-scripts' sd3_train.py"))

    def prepare_args(self, args: argparse.Namespace) -> None:
        imply_text_cache(args)

    def read(self, args: argparse.Namespace, train_text_encoder: bool) -> SD3Rules:
        """The rules of :func:`problems`, :func:`text_encoder_lrs` and ``--learning_rate 0`` = the transformer is not
        trained (the method's ``train_text_encoder`` is not used: ``--train_text_encoder`` is this group's flag)."""
        out = problems(args)
        lrs = text_encoder_lrs(args)
        train_denoiser = args.learning_rate != 0
        if not train_denoiser and not (lrs and any(lrs)):
            out.append("--learning_rate 0 leaves the transformer out of training and no text encoder is "
                       "trained, so this run trains nothing; add --train_text_encoder (with a non-zero "
                       "--learning_rate_te1 / --learning_rate_te2) to train the text encoders only")  # fmt: skip
        raise_if(out)
        return SD3Rules(lrs, train_denoiser, args.num_last_block_to_freeze)


def add_sd3_full_training_args(g: Any) -> Any:
    """sd-scripts' sd3_train.py-only flags (names, types, defaults as there) on the group ``g``; ``--save_clip`` /
    ``--save_t5xxl`` (the SD3 model flags) get this script's reason. Returns the group."""
    g.add_argument("--train_text_encoder", action="store_true", help="train CLIP-L and CLIP-G too")
    g.add_argument("--train_t5xxl", action="store_true", help="train T5-XXL too (with --train_text_encoder)")
    g.add_argument("--use_t5xxl_cache_only", action="store_true", help="cache the text-encoder outputs and recompute "
                   "CLIP-L's / CLIP-G's at each step while they train (implies --cache_text_encoder_outputs)")  # fmt: skip
    for i, what in enumerate(("CLIP-L", "CLIP-G", "T5-XXL"), 1):
        g.add_argument(f"--learning_rate_te{i}", type=float, default=None,
                       help=f"{what} learning rate (default --learning_rate; 0 = do not train it)")  # fmt: skip
    g.add_argument("--num_last_block_to_freeze", type=int, default=None, help="freeze the last N x_block parameters "
                   "of the transformer (sd-scripts counts parameters, in the MMDiT's order)")  # fmt: skip
    for action in g._actions:
        if action.option_strings and action.option_strings[0] in ("--save_clip", "--save_t5xxl"):
            action.no_effect_reason = SAVE_REASON
            action.help = f"accepted for sd-scripts, no effect here: {SAVE_REASON}"
    return g


def caches_text(args: argparse.Namespace) -> bool:
    return bool(args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk)


def imply_text_cache(args: argparse.Namespace) -> None:
    """``--use_t5xxl_cache_only`` turns ``--cache_text_encoder_outputs`` on (sd-scripts, with its warning); call it
    before the dataset flags are read."""
    if args.use_t5xxl_cache_only and not caches_text(args):
        logger.warning("--use_t5xxl_cache_only is given, so --cache_text_encoder_outputs is turned on too")
        args.cache_text_encoder_outputs = True


def text_encoder_lrs(args: argparse.Namespace) -> tuple[float, float, float] | None:
    """(CLIP-L, CLIP-G, T5) learning rates, 0 for an encoder that stays frozen; None without
    ``--train_text_encoder`` (sd-scripts: ``lr_te* if given else --learning_rate``; T5 only with ``--train_t5xxl``)."""
    if not args.train_text_encoder:
        return None
    lr1, lr2, lr3 = (args.learning_rate if lr is None else lr
                     for lr in (args.learning_rate_te1, args.learning_rate_te2, args.learning_rate_te3))  # fmt: skip
    return (lr1, lr2, lr3 if args.train_t5xxl else 0.0)


def problems(args: argparse.Namespace) -> list[str]:
    """sd-scripts' sd3_train.py assertions, each naming its flags (call after :func:`imply_text_cache`)."""
    out = []
    cache = caches_text(args)
    if args.train_t5xxl and cache:  # every encoder trains: no cache of any kind fits, so suggest none
        out.append("--train_t5xxl with a text-encoder cache (--cache_text_encoder_outputs, --use_t5xxl_cache_only): "
                   "T5-XXL's outputs cannot be cached while it trains; drop the cache flags or --train_t5xxl")  # fmt: skip
    elif args.train_text_encoder and cache and not args.use_t5xxl_cache_only:
        out.append("--cache_text_encoder_outputs with --train_text_encoder: the CLIP-L / CLIP-G outputs cannot be "
                   "cached while they train; add --use_t5xxl_cache_only (only T5-XXL's outputs are read from the "
                   "cache) or drop the cache flag")  # fmt: skip
    if args.train_t5xxl and not args.train_text_encoder:
        out.append("--train_t5xxl needs --train_text_encoder (sd-scripts trains T5-XXL only with CLIP-L / CLIP-G)")
    given = [f"--learning_rate_te{i}" for i, v in enumerate(
        (args.learning_rate_te1, args.learning_rate_te2, args.learning_rate_te3), 1) if v is not None]  # fmt: skip
    if given and not args.train_text_encoder:
        logger.warning("%s: no text encoder is trained without --train_text_encoder; ignored", " ".join(given))
    if args.learning_rate_te3 is not None and args.train_text_encoder and not args.train_t5xxl:
        logger.warning("--learning_rate_te3: T5-XXL is trained only with --train_t5xxl; ignored")
    if args.use_t5xxl_cache_only and not args.train_text_encoder:
        logger.info("--use_t5xxl_cache_only without --train_text_encoder: every encoder output comes from the cache")
    lrs = [(f"--learning_rate_te{i}", v) for i, v in enumerate(
        (args.learning_rate_te1, args.learning_rate_te2, args.learning_rate_te3), 1)]  # fmt: skip
    out += [
        f"{flag} must be >= 0 (0 = that encoder is not trained), got {v}" for flag, v in lrs if v is not None and v < 0
    ]
    if args.num_last_block_to_freeze is not None and args.num_last_block_to_freeze < 0:
        out.append(f"--num_last_block_to_freeze must be >= 0, got {args.num_last_block_to_freeze}")
    return out


def x_block_parameters(layout: K.Layout) -> list[tuple[str, tuple[str, ...]]]:
    """The MMDiT's ``x_block`` parameters in sd-scripts' order: (SAI name, the diffusers parameters it is)."""
    out = []
    for i in range(layout.num_layers):
        entries = {e.sai.removeprefix(f"joint_blocks.{i}.x_block."): e for e in layout.table
                   if e.sai.startswith(f"joint_blocks.{i}.x_block.")}  # fmt: skip
        unknown = set(entries) - set(X_BLOCK_ORDER)
        if unknown:
            raise ValueError(f"x_block modules with no place in sd-scripts' order: {sorted(unknown)}")
        for name in (n for n in X_BLOCK_ORDER if n in entries):
            e = entries[name]
            for sai_param, d_param in e.params:
                out.append((K.param_key(e.sai, sai_param), tuple(K.param_key(d, d_param) for d in e.diffusers)))
    return out


def last_x_block_parameters(denoiser: nn.Module, n: int) -> list[str]:
    """The diffusers names of ``--num_last_block_to_freeze n``'s parameters (see the module docstring)."""
    names = [name for name, _ in denoiser.named_parameters()]
    table = x_block_parameters(K.diffusers_layout(names))
    chosen = table[max(0, len(table) - n) :] if n > 0 else []
    return [d for _, ds in chosen for d in ds]


def freeze_last_x_block_parameters(denoiser: nn.Module, n: int | None) -> list[str]:
    """``requires_grad_(False)`` on :func:`last_x_block_parameters`; returns their names (logged, with the count)."""
    if not n:
        return []
    frozen = last_x_block_parameters(denoiser, n)
    params = dict(denoiser.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    blocks = sorted({int(name.split(".")[1]) for name in frozen})
    logger.info("--num_last_block_to_freeze %d: %d transformer parameters frozen (x_block of blocks %s)", n,
                len(frozen), blocks)  # fmt: skip
    return frozen


def sidecar_names(lrs: Iterable[float] | None) -> tuple[str, ...]:
    """The encoders sd-scripts writes next to the model file: CLIP-L and CLIP-G both when either trains, T5 when it
    trains."""
    lrs = tuple(lrs or (0, 0, 0))
    clip = ("clip_l", "clip_g") if lrs[0] != 0 or lrs[1] != 0 else ()
    return clip + (("t5xxl",) if lrs[2] != 0 else ())
