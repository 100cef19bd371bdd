"""WD14 tagger labels and the choice of tags from its scores (sd-scripts' finetune/tag_images_by_wd14_tagger.py).

A WD14 tagger (SmilingWolf/wd-*-tagger) is an ONNX model: input ``(N, S, S, 3)`` float32 BGR pixels in 0..255 (the
image padded to a white square, resized to S, usually 448), output ``(N, T)`` probabilities, one per row of its
``selected_tags.csv`` (``tag_id,name,category,count``; category 9 = rating, 0 = general, 4 = character). The other layout sd-scripts
reads (``--repo_id owner/repo/subfolder``, e.g. cl_tagger): ``model_optimized.onnx`` takes ``(N, 3, S, S)`` pixels
scaled to -1..1 and gives logits, and ``tag_mapping.json`` maps output index to ``{"tag", "category"}`` with the
categories of ``MAPPING_CATEGORIES``. Here: the label files, the name edits (``--character_tag_expand``,
``--remove_underscore``, ``--tag_replacement``), the image preparation, and the tag list of one image, in
sd-scripts' order. Pure numpy / PIL; no model code.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

RATING, GENERAL, CHARACTER = "9", "0", "4"
MAPPING_CATEGORIES = ("Rating", "General", "Character", "Copyright", "Meta", "Model", "Quality", "Artist")
OTHER_CATEGORIES = ("Copyright", "Meta", "Model", "Artist")  # written with their own thresholds


@dataclass(frozen=True)
class TagChoice:
    """The settings that decide which tags an image gets and in which order (sd-scripts' flags)."""

    general_threshold: float = 0.35
    character_threshold: float = 0.35
    undesired: frozenset[str] = frozenset()
    use_rating_tags: bool = False
    use_rating_tags_as_last_tag: bool = False
    character_tags_first: bool = False
    always_first_tags: tuple[str, ...] = ()
    # tag_mapping.json taggers only
    other_thresholds: tuple[tuple[str, float], ...] = ()  # (category, threshold) of OTHER_CATEGORIES
    use_quality_tags: bool = False
    use_quality_tags_as_last_tag: bool = False


@dataclass
class ImageTags:
    """The tags of one image: ``combined`` in the order written, and each category's tags for ``--debug``."""

    combined: list[str] = field(default_factory=list)
    rating: list[str] = field(default_factory=list)
    general: list[str] = field(default_factory=list)
    character: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)  # tag_mapping.json: copyright / meta / model / artist
    quality: list[str] = field(default_factory=list)  # tag_mapping.json
    counted: list[str] = field(default_factory=list)  # the tags --frequency_tags counts (as sd-scripts)


def read_selected_tags(path: Path) -> tuple[list[str], list[str]]:
    """``(names, categories)`` of a ``selected_tags.csv``, one per model output; errors name the file and row."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip() for c in rows[0][:3]] != ["tag_id", "name", "category"]:
        head = rows[0] if rows else "nothing"
        raise ValueError(
            f"{path}: expected the header tag_id,name,category,count of a WD14 selected_tags.csv, got {head}"
        )
    names, categories = [], []
    for number, row in enumerate(rows[1:], start=2):
        if len(row) < 3 or row[2].strip() not in (RATING, GENERAL, CHARACTER):
            raise ValueError(f"{path}: line {number}: {row}: expected tag_id,name,category with category 9, 0 or 4")
        names.append(row[1])
        categories.append(row[2].strip())
    return names, categories


def read_tag_mapping(path: Path, outputs: int | None = None) -> tuple[list[str | None], list[str | None]]:
    """``(names, categories)`` by output index of a ``tag_mapping.json`` (``{index: {"tag", "category"}}``); an
    index without an entry is None. Errors name the file and the entry."""
    try:
        table = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(table, dict) or not table:
        raise ValueError(f'{path}: expected an object {{index: {{"tag": ..., "category": ...}}}}')
    entries = {}
    for key, info in table.items():
        if not key.isdigit() or not isinstance(info, dict) or info.get("category") not in MAPPING_CATEGORIES:
            raise ValueError(
                f'{path}: entry {key!r}: {info!r}: expected an index and {{"tag", "category"}} with a category '
                f"of {', '.join(MAPPING_CATEGORIES)}"
            )
        entries[int(key)] = (str(info.get("tag")), info["category"])
    size = max(entries) + 1 if outputs is None else outputs
    names: list[str | None] = [None] * size
    categories: list[str | None] = [None] * size
    for index, (name, category) in entries.items():
        if index < size:
            names[index], categories[index] = name, category
    return names, categories


def expand_character_tag(tag: str, separator: str) -> str:
    """``name_(series)`` -> ``name<separator>series``; ``name_(costume)_(series)`` -> ``name_(costume)<sep>series``."""
    if not tag.endswith(")") or "(" not in tag:
        return tag
    head, _, series = tag[:-1].rpartition("(")
    return head.removesuffix("_") + separator + series


def remove_underscore(tag: str) -> str:
    """Underscores to spaces, except in tags of 3 characters or fewer (emoticons such as ``^_^``), as sd-scripts."""
    return tag.replace("_", " ") if len(tag) > 3 else tag


def parse_tag_replacement(text: str) -> dict[str, str]:
    """``--tag_replacement "src1,dst1;src2,dst2"`` (``\\,`` and ``\\;`` stand for a literal comma and semicolon)."""
    comma, semicolon = "\0c", "\0s"
    escaped = text.replace("\\,", comma).replace("\\;", semicolon)
    pairs = {}
    for item in escaped.split(";"):
        parts = item.split(",")
        if len(parts) != 2 or not parts[0]:
            shown = item.replace(comma, "\\,").replace(semicolon, "\\;")
            raise ValueError(
                f"--tag_replacement {text!r}: {shown!r} is not `source,target`; separate pairs with ';' and write "
                "a comma or semicolon inside a tag as \\, or \\;"
            )
        source, target = (p.replace(comma, ",").replace(semicolon, ";") for p in parts)
        pairs[source] = target
    return pairs


def edit_names(
    names: list[str],
    categories: list[str],
    *,
    expand_characters: bool = False,
    separator: str = ", ",
    underscores_to_spaces: bool = False,
    replacements: dict[str, str] | None = None,
) -> list[str]:
    """The tag names as written, in sd-scripts' order: for selected_tags.csv character tags expanded, then
    underscores removed, then replaced; for tag_mapping.json underscores, replacement, then expansion."""
    edited = []
    for name, category in zip(names, categories):
        if name is None:
            edited.append(None)
            continue
        if expand_characters and category == CHARACTER:
            name = expand_character_tag(name, separator)
        if underscores_to_spaces:
            name = remove_underscore(name)
        name = (replacements or {}).get(name, name)
        if expand_characters and category == "Character":
            name = expand_character_tag(name, separator)
        edited.append(name)
    return edited


def prepare_image(path: str | Path, size: int) -> np.ndarray:
    """``(size, size, 3)`` float32 BGR in 0..255 as WD14 taggers read it: transparency over white, padded to a
    centred white square, resized with a box filter when shrinking (OpenCV's area filter in sd-scripts) and
    Lanczos when enlarging. EXIF orientation is applied (the image as training sees it)."""
    try:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im)
            if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
                rgba = im.convert("RGBA")
                im = Image.new("RGB", rgba.size, (255, 255, 255))
                im.paste(rgba, mask=rgba.getchannel("A"))
            im = im.convert("RGB")
    except OSError as e:
        raise ValueError(f"{path}: cannot decode image ({e}); remove or re-save it") from None
    side = max(im.size)
    square = Image.new("RGB", (side, side), (255, 255, 255))
    square.paste(im, ((side - im.width) // 2, (side - im.height) // 2))
    if side != size:
        resample = Image.Resampling.BOX if side > size else Image.Resampling.LANCZOS
        square = square.resize((size, size), resample)
    return np.asarray(square, dtype=np.float32)[:, :, ::-1].copy()


def choose_tags(probs: np.ndarray, names: list[str], categories: list[str], choice: TagChoice) -> ImageTags:
    """The tags of one image from its ``(T,)`` probabilities, in sd-scripts' order: general and character tags at
    or above their thresholds in label order (character tags each put first with ``character_tags_first``), the
    most probable rating first (``use_rating_tags``) or last (``..._as_last_tag``), then each of
    ``always_first_tags`` that is present moved to the front in turn. Undesired tags are never written."""
    tags = ImageTags()
    for p, name, category in zip(probs, names, categories):
        if name in choice.undesired:
            continue
        if category == GENERAL and p >= choice.general_threshold:
            tags.general.append(name)
            tags.combined.append(name)
        elif category == CHARACTER and p >= choice.character_threshold:
            tags.character.append(name)
            tags.combined.insert(0, name) if choice.character_tags_first else tags.combined.append(name)
    if choice.use_rating_tags or choice.use_rating_tags_as_last_tag:
        ratings = [i for i, c in enumerate(categories) if c == RATING]
        if ratings:
            best = names[max(ratings, key=lambda i: probs[i])]
            if best not in choice.undesired:
                tags.rating.append(best)
                tags.combined.insert(0, best) if choice.use_rating_tags else tags.combined.append(best)
    tags.counted = tags.general + tags.character + tags.rating
    _move_to_front(tags.combined, choice.always_first_tags)
    return tags


def choose_mapped_tags(logits: np.ndarray, names: list, categories: list, choice: TagChoice) -> ImageTags:
    """The tags of one image of a tag_mapping.json tagger from its ``(T,)`` logits (sd-scripts' rules): scores are
    sigmoid(logits); the most probable rating and quality tag at or above the lowest threshold; general, character
    and the other categories at or above their own thresholds, sorted by score (character tags in front with
    ``character_tags_first``); quality and rating tags first or last as asked, then ``always_first_tags``."""
    probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    thresholds = {"General": choice.general_threshold, "Character": choice.character_threshold}
    thresholds |= dict(choice.other_thresholds)
    lowest = min(thresholds.values())
    tags = ImageTags()
    best: dict[str, tuple[float, str]] = {}
    scored, characters = [], []
    for i in np.nonzero(probs >= lowest)[0]:
        name, category, p = names[i], categories[i], probs[i]
        if name is None or name in choice.undesired:
            continue
        if category in ("Rating", "Quality"):
            if p > best.get(category, (-1.0, ""))[0]:
                best[category] = (p, name)
        elif p >= thresholds.get(category, math.inf):
            {"General": tags.general, "Character": tags.character}.get(category, tags.other).append(name)
            (characters if category == "Character" and choice.character_tags_first else scored).append((p, name))
    ordered = sorted(characters, key=lambda t: -t[0]) + sorted(scored, key=lambda t: -t[0])
    tags.combined = [name for _, name in ordered]
    for category, first, last in [
        ("Quality", choice.use_quality_tags, choice.use_quality_tags_as_last_tag),
        ("Rating", choice.use_rating_tags, choice.use_rating_tags_as_last_tag),
    ]:
        if category in best:
            name = best[category][1]
            (tags.rating if category == "Rating" else tags.quality).append(name)
            if last:
                tags.combined.append(name)
            elif first:
                tags.combined.insert(0, name)
    tags.counted = tags.general + tags.character + tags.other
    _move_to_front(tags.combined, choice.always_first_tags)
    return tags


def _move_to_front(combined: list[str], always_first: tuple[str, ...]) -> None:
    """Each tag of ``always_first`` that is present moved to the front in turn (the last listed ends first)."""
    for tag in always_first:
        if tag in combined:
            combined.remove(tag)
            combined.insert(0, tag)


def append_to_existing(existing_text: str, tags: list[str], separator: str) -> list[str]:
    """``--append_tags``: the tags already in a caption file, then the new ones it does not have."""
    old = [t.strip() for t in existing_text.strip("\n").split(separator.strip()) if t.strip()]
    return old + [t for t in tags if t not in old]


def frequencies(all_tags: list[ImageTags]) -> list[tuple[str, int]]:
    """``--frequency_tags``: how many images got each tag, most frequent first."""
    counts = Counter(t for tags in all_tags for t in tags.counted)
    return counts.most_common()
