"""The caption and tag clean-up rules of sd-scripts' finetune/clean_captions_and_tags.py.

Clean-up of tagger tags and captioner captions in a fine-tune metadata JSON, with the rules of sd-scripts'
finetune/clean_captions_and_tags.py (tuned for DeepDanbooru / WD14 tags and BLIP captions of anime images).

Tags (a ", "-separated string):

1. ``_`` becomes a space (the ``^_^`` emoticon is kept); DeepDanbooru's ``rating:*`` tail is cut off.
2. Several people (``girls`` / ``boys`` anywhere in the tags): a kind of tag that describes one person — hair length,
   hair cut, eye colour, sleeves, hairstyle — is removed when more than one tag of that kind is present (they cannot
   all be true of every person); then hair-colour tags (``<word> hair``) likewise, hair length excepted.
3. A one-word tag (or ``hair ornament``) is removed when a longer tag ends with it (``shirt`` next to
   ``white shirt``).

Captions: a fixed list of replacements is applied in order, each until nothing changes (``anime woman`` -> ``girl``,
``a cartoon drawing`` -> ``a drawing``, ...).
"""

from __future__ import annotations

import re

_ONE_PERSON_KINDS = [
    re.compile(r"(long|short|medium) hair"),
    re.compile(r"(bob|hime) cut"),
    re.compile(r"[\w\-]+ eyes"),
    re.compile(r"[\w\-]+ sleeves|sleeveless"),
    re.compile(
        r"ponytail|braid|ahoge|twintails|[\w\-]+ bun|single hair bun|single side bun|two side up|two tails"
        r"|[\w\-]+ braid|sidelocks"
    ),
]
_HAIR_LENGTH = _ONE_PERSON_KINDS[0]
_HAIR = re.compile(r"[\w\-]+ hair")
_SINGLE_WORD = re.compile(r"[\w\-]+|hair ornament")

CAPTION_REPLACEMENTS = (
    ("anime anime", "anime"), ("young ", ""), ("anime girl", "girl"), ("cartoon female", "girl"),
    ("cartoon lady", "girl"), ("cartoon character", "girl"), ("cartoon woman", "girl"), ("cartoon women", "girls"),
    ("cartoon girl", "girl"), ("anime female", "girl"), ("anime lady", "girl"), ("anime character", "girl"),
    ("anime woman", "girl"), ("anime women", "girls"), ("lady", "girl"), ("female", "girl"), ("woman", "girl"),
    ("women", "girls"), ("people", "girls"), ("person", "girl"), ("a cartoon figure", "a figure"),
    ("a cartoon image", "an image"), ("a cartoon picture", "a picture"), ("an anime cartoon image", "an image"),
    ("a cartoon anime drawing", "a drawing"), ("a cartoon drawing", "a drawing"), ("girl girl", "girl"),
)  # fmt: skip


def _drop_if_several(tags: list[str], pattern: re.Pattern, keep: re.Pattern | None = None) -> list[str]:
    hits = [t for t in tags if pattern.fullmatch(t) and not (keep and keep.fullmatch(t))]
    return [t for t in tags if t not in hits] if len(hits) > 1 else tags


def clean_tags(tags: str) -> str:
    """The cleaned ", "-separated tag string (module docstring, rules 1-3)."""
    text = tags.replace("^_^", "\0").replace("_", " ").replace("\0", "^_^")
    text = text.split(", rating")[0]
    items = [t for t in text.split(", ") if t]
    if "girls" in text or "boys" in text:
        for kind in _ONE_PERSON_KINDS:
            items = _drop_if_several(items, kind)
        items = _drop_if_several(items, _HAIR, keep=_HAIR_LENGTH)
    for word in [t for t in items if _SINGLE_WORD.fullmatch(t)]:
        if any(re.fullmatch(rf"(\w+ )+{re.escape(word)}", other) for other in items):
            items = [t for t in items if t != word]
    return ", ".join(items)


def clean_caption(caption: str) -> str:
    """The caption with :data:`CAPTION_REPLACEMENTS` applied in order, each until nothing changes."""
    for old, new in CAPTION_REPLACEMENTS:
        while old in caption:
            replaced = caption.replace(old, new)
            if replaced == caption:
                break
            caption = replaced
    return caption
