"""Caption composition: pure functions of (caption text, settings, a seeded RNG, epoch, step).

Follows sd-scripts' ``BaseDataset.process_caption`` (library/train_util.py) in order and meaning, with three
deliberate differences, each fixing a reported problem:

* A caption with several lines gives one line per sample and epoch, drawn at random (OneTrainer's convention; sd-scripts
  takes only the first line unless ``enable_wildcard``). The line is drawn *before* prefix/suffix are added, so
  every line gets both (sd-scripts adds them to the whole multi-line text, so only the first/last line got them).
* Tags are re-joined with the configured separator (``caption_separator`` + space), not a hard-coded ", "
  (sd-scripts issue #1304).
* Empty tags ("a, , b") are dropped when a caption is split into tags.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, fields

_WILDCARD = re.compile(r"\{([^}]+)\}")


@dataclass(frozen=True)
class CaptionConfig:
    """Per-subset caption settings (sd-scripts names and defaults: ``library/config_util.py: BaseSubsetParams``)."""

    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    secondary_separator: str | None = None
    enable_wildcard: bool = False
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    token_warmup_min: int = 1
    token_warmup_step: float = 0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def varies_per_step(self) -> list[str]:
        """Settings that make the text differ between steps beyond a choice among fixed strings.

        Those cannot be combined with caching text-encoder outputs. Whole-caption dropout and the choice of one
        line of a multi-line caption are fine: every possible result is known up front and cached.
        """
        bad = []
        if self.shuffle_caption:
            bad.append("shuffle_caption")
        if self.caption_tag_dropout_rate > 0:
            bad.append("caption_tag_dropout_rate")
        if self.token_warmup_step > 0:
            bad.append("token_warmup_step")
        if self.enable_wildcard:
            bad.append("enable_wildcard")
        return bad


def caption_lines(text: str) -> list[str]:
    """The non-empty lines of a caption text, stripped. An empty text gives ``[""]``."""
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines if line] or [""]


def _with_prefix_suffix(line: str, cfg: CaptionConfig) -> str:
    if cfg.caption_prefix:
        line = cfg.caption_prefix + " " + line
    if cfg.caption_suffix:
        line = line + " " + cfg.caption_suffix
    return line


def _expand_wildcards(caption: str, rng: random.Random) -> str:
    """``{a|b|c}`` becomes one of a, b, c; ``{{`` and ``}}`` are literal braces (sd-scripts' notation)."""
    open_mark, close_mark = "\u2985", "\u2986"
    while open_mark in caption or close_mark in caption:
        open_mark += "\u2985"
        close_mark += "\u2986"
    caption = caption.replace("{{", open_mark).replace("}}", close_mark)
    caption = _WILDCARD.sub(lambda m: rng.choice(m.group(1).split("|")), caption)
    return caption.replace(open_mark, "{").replace(close_mark, "}")


def _split(text: str, sep: str) -> list[str]:
    return [t.strip() for t in text.split(sep) if t.strip()]


def split_tags(caption: str, cfg: CaptionConfig) -> tuple[list[str], list[str], list[str]]:
    """Split a caption into (fixed head, flexible middle, fixed tail) tags.

    With ``keep_tokens_separator`` present: text before its first occurrence is the head, text after a second
    occurrence is the tail. Otherwise the first ``keep_tokens`` tags are the head and there is no tail.
    """
    sep, kts = cfg.caption_separator, cfg.keep_tokens_separator
    if kts and kts in caption:
        head, flex = caption.split(kts, 1)
        tail = ""
        if kts in flex:
            flex, tail = flex.split(kts, 1)
        return _split(head, sep), _split(flex, sep), _split(tail, sep)
    tags = _split(caption, sep)
    return tags[: cfg.keep_tokens], tags[cfg.keep_tokens :], []


def warmup_tag_count(n_flex: int, step: int, warmup_steps: int, warmup_min: int) -> int:
    """Flexible tags used at ``step`` under token warm-up: ``floor(step * (n - min) / warmup_steps) + min``."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return n_flex
    return math.floor(step * ((n_flex - warmup_min) / warmup_steps)) + warmup_min


def _process_tags(caption: str, cfg: CaptionConfig, rng: random.Random, step: int, warmup_steps: int) -> str:
    head, flex, tail = split_tags(caption, cfg)
    flex = flex[: warmup_tag_count(len(flex), step, warmup_steps, cfg.token_warmup_min)]
    if cfg.shuffle_caption:
        rng.shuffle(flex)
    if cfg.caption_tag_dropout_rate > 0:
        flex = [t for t in flex if rng.random() >= cfg.caption_tag_dropout_rate]
    sep = cfg.caption_separator
    joiner = sep + " " if sep.strip() else sep
    return joiner.join(head + flex + tail)


def resolve_warmup_steps(cfg: CaptionConfig, max_train_steps: int | None) -> int:
    """``token_warmup_step`` in steps; values below 1 are a fraction of ``max_train_steps`` (sd-scripts)."""
    if cfg.token_warmup_step <= 0:
        return 0
    if cfg.token_warmup_step < 1:
        if max_train_steps is None:
            raise ValueError(
                f"token_warmup_step={cfg.token_warmup_step} is a fraction of the run length, but the run length is "
                "not known to the data loader; pass max_train_steps to make_loader or give token_warmup_step in steps"
            )
        return math.floor(cfg.token_warmup_step * max_train_steps)
    return int(cfg.token_warmup_step)


def is_dropped(cfg: CaptionConfig, rng: random.Random, epoch: int) -> bool:
    """Whole-caption dropout: with probability ``caption_dropout_rate``, or in every N-th epoch (1-based, as
    sd-scripts counts epochs)."""
    if cfg.caption_dropout_rate > 0 and rng.random() < cfg.caption_dropout_rate:
        return True
    n = cfg.caption_dropout_every_n_epochs
    return n > 0 and (epoch + 1) % n == 0


def compose_caption(
    text: str, cfg: CaptionConfig, rng: random.Random, *, epoch: int, step: int = 0, warmup_steps: int = 0
) -> str:
    """The caption used for one sample at one step.

    ``text`` is the raw caption (a file's content, possibly several lines); ``rng`` must be seeded from (seed,
    epoch, sample) so the result is reproducible; ``epoch`` is 0-based; ``step`` is the optimizer step (for token
    warm-up, with ``warmup_steps`` from ``resolve_warmup_steps``). Order as sd-scripts: line choice, prefix/suffix,
    dropout, wildcards, tag split (keep tokens) -> warm-up -> shuffle -> tag dropout -> join, secondary separator.
    """
    lines = caption_lines(text)
    line = lines[rng.randrange(len(lines))] if len(lines) > 1 else lines[0]
    caption = _with_prefix_suffix(line, cfg)
    if is_dropped(cfg, rng, epoch):
        return ""
    if cfg.enable_wildcard:
        caption = _expand_wildcards(caption, rng)
    needs_split = cfg.shuffle_caption or warmup_steps > 0 or cfg.caption_tag_dropout_rate > 0
    if needs_split or (cfg.keep_tokens_separator and cfg.keep_tokens_separator in caption):
        caption = _process_tags(caption, cfg, rng, step, warmup_steps)
    if cfg.secondary_separator:
        caption = caption.replace(cfg.secondary_separator, cfg.caption_separator)
    return caption


def possible_captions(text: str, cfg: CaptionConfig) -> list[str]:
    """Every caption ``compose_caption`` can return for ``text`` when ``cfg.varies_per_step()`` is empty.

    Used to cache text-encoder outputs up front: one entry per line, plus "" when captions can be dropped.
    """
    if cfg.varies_per_step():
        raise ValueError(f"captions vary per step ({', '.join(cfg.varies_per_step())}); they cannot be enumerated")
    rng = random.Random(0)  # unused by the static path, required by the signature
    out = []
    for line in caption_lines(text):
        static = CaptionConfig(**{**cfg.__dict__, "caption_dropout_rate": 0.0, "caption_dropout_every_n_epochs": 0})
        out.append(compose_caption(line, static, rng, epoch=0))
    if cfg.caption_dropout_rate > 0 or cfg.caption_dropout_every_n_epochs > 0:
        out.append("")
    return list(dict.fromkeys(out))


def finetune_caption(caption: str | None, tags: str | None, separator: str) -> str:
    """Fine-tune (metadata JSON) caption: each caption line followed by the tags (sd-scripts FineTuningDataset)."""
    joiner = separator + " " if separator.strip() else separator
    lines = caption_lines(caption or "")
    if not tags:
        return "\n".join(lines)
    return "\n".join(joiner.join(p for p in (line, tags) if p) for line in lines)
