"""Which training captions carry a textual-inversion token, checked once after the datasets are read and before
the model loads.

A batch whose captions all lack the token does not reach the token's vectors, so its step changes nothing (it is
still counted and makes its random draws: library/run/trainer.py ``reaches_trained``). sd-scripts trains the whole
embedding table there and restores the other rows, so the new rows get a zero gradient (which a momentum optimizer
such as AdamW still turns into a small move along its momentum; here they stay put). :func:`check_captions`
says up front how many captions lack the token and which caption settings can drop it at some steps, and refuses
a run in which no step could ever train it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from library.cli.problems import ConfigError
from library.data.captions import CaptionConfig, caption_lines, split_tags


@dataclass
class TokenCoverage:
    """How the training captions (one per line of each training image's caption) hold ``token``."""

    token: str
    total: int = 0
    lacking: int = 0
    places: dict[str, int] = field(default_factory=dict)  # image folder / metadata file -> captions lacking it
    droppers: set[str] = field(default_factory=set)  # settings that remove the token from a caption at some steps
    always_dropped: int = 0  # captions with the token that a dropout setting removes at every step


def _always_dropped(cfg: CaptionConfig) -> bool:
    return cfg.caption_dropout_rate >= 1 or cfg.caption_dropout_every_n_epochs == 1


def _droppers(text: str, token: str, cfg: CaptionConfig) -> set[str]:
    """The settings that can take ``token`` out of the caption ``text`` (prefix and suffix included) at a step."""
    found = {name for name in ("caption_dropout_rate", "caption_dropout_every_n_epochs") if getattr(cfg, name) > 0}
    if cfg.caption_tag_dropout_rate > 0 or cfg.token_warmup_step > 0:
        head, flex, tail = split_tags(text, cfg)  # only the tags after the kept ones can be dropped
        if any(token in tag for tag in flex) and not any(token in tag for tag in head + tail):
            found |= {n for n in ("caption_tag_dropout_rate", "token_warmup_step") if getattr(cfg, n) > 0}
    return found


def token_coverage(plan: Any, token: str) -> TokenCoverage:
    """Count the training captions of ``plan`` (a :class:`library.data.Plan`) with and without ``token``
    (regularisation images are left out: they describe the class, not the new token)."""
    out = TokenCoverage(token)
    for dataset in plan.datasets:
        for record in dataset.records:
            if record.is_reg:
                continue
            subset = dataset.subset(record)
            cfg = subset.captions
            for line in caption_lines(record.caption):
                text = " ".join(p for p in (cfg.caption_prefix, line, cfg.caption_suffix) if p)
                out.total += 1
                if token in text and not _always_dropped(cfg):
                    out.droppers |= _droppers(text, token, cfg)
                    continue
                out.lacking += 1
                out.always_dropped += token in text
                place = subset.image_dir or subset.metadata_file or subset.where
                out.places[place] = out.places.get(place, 0) + 1
    return out


def check_captions(plan: Any, token: str) -> list[str]:
    """The notes to show once before training (captions that lack ``token``; settings that drop it at some steps).
    Raises :class:`ConfigError` when no training caption holds the token (no step could train it)."""
    cov = token_coverage(plan, token)
    places = "; ".join(f"{place}: {n}" for place, n in cov.places.items())
    templates = "--use_object_template / --use_style_template (captions made from templates around the token)"
    if cov.total and cov.lacking == cov.total:
        why = "holds the token" if not cov.always_dropped else "keeps the token (caption dropout removes them all)"
        raise ConfigError(
            [f"--token_string {token}: none of the {cov.total} training captions {why} ({places}), so no step could "
             f"train it; write {token!r} into the captions (e.g. \"{token}, a photo of ...\"), add it with "
             f"--caption_prefix {token} (or the dataset's caption_prefix / class tokens), or use {templates}"],
            "textual-inversion captions",
        )  # fmt: skip
    notes = []
    if cov.lacking:
        notes.append(f"textual inversion: {cov.lacking} of {cov.total} training captions lack the token {token!r} "
                     f"({places}); a step whose batch holds none with the token changes nothing (it is still "
                     f"counted). Write the token into those captions, or use {templates}")  # fmt: skip
    if cov.droppers:
        notes.append(f"textual inversion: {', '.join(sorted(cov.droppers))} can remove the token {token!r} from a "
                     "caption at some steps; a step whose batch then holds no caption with the token changes nothing "
                     "(it is still counted). Tag dropout and token warm-up spare the first keep_tokens tags")  # fmt: skip
    return notes
