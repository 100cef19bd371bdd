"""Caption composition: sd-scripts' documented examples and properties (keep tokens, warm-up formula)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from library.data.captions import CaptionConfig, compose_caption, possible_captions, resolve_warmup_steps

tag = st.text(alphabet="abcdefghij ", min_size=1, max_size=6).map(str.strip).filter(bool)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tags=st.lists(tag, min_size=1, max_size=12, unique=True), keep=st.integers(0, 12), seed=st.integers(0, 10**6))
def test_shuffle_keeps_first_keep_tokens_in_place(tags, keep, seed):
    cfg = CaptionConfig(shuffle_caption=True, keep_tokens=keep)
    out = compose_caption(", ".join(tags), cfg, random.Random(seed), epoch=0).split(", ")
    assert out[:keep] == tags[:keep]
    assert sorted(out) == sorted(tags)  # a permutation: nothing lost or added


def test_keep_tokens_separator_doc_example():
    # sd-scripts docs/config_README-en.md: "aaa, bbb ||| ccc, ddd, eee, fff ||| ggg, hhh"
    cfg = CaptionConfig(shuffle_caption=True, keep_tokens_separator="|||")
    text = "aaa, bbb ||| ccc, ddd, eee, fff ||| ggg, hhh"
    seen = set()
    for seed in range(30):
        out = compose_caption(text, cfg, random.Random(seed), epoch=0).split(", ")
        assert out[:2] == ["aaa", "bbb"] and out[-2:] == ["ggg", "hhh"]
        assert sorted(out[2:6]) == ["ccc", "ddd", "eee", "fff"]
        seen.add(tuple(out))
    assert len(seen) > 1  # it does shuffle


def test_keep_tokens_separator_removed_without_shuffle():
    cfg = CaptionConfig(keep_tokens_separator="|||")
    assert compose_caption("a, b ||| c ||| d", cfg, random.Random(0), epoch=0) == "a, b, c, d"


def test_secondary_separator_doc_example():
    cfg = CaptionConfig(secondary_separator=";;;")
    text = "1girl, sky;;;cloud;;;day, outdoors"
    assert compose_caption(text, cfg, random.Random(0), epoch=0) == "1girl, sky,cloud,day, outdoors"
    cfg = CaptionConfig(secondary_separator=";;;", shuffle_caption=True)
    for seed in range(10):
        parts = compose_caption(text, cfg, random.Random(seed), epoch=0).split(", ")
        assert "sky,cloud,day" in parts  # moves as one tag


def test_wildcards_and_escapes():
    cfg = CaptionConfig(enable_wildcard=True)
    outs = {compose_caption("{simple|white} background", cfg, random.Random(s), epoch=0) for s in range(40)}
    assert outs == {"simple background", "white background"}
    assert compose_caption("vocaloid, {{retro style}}", cfg, random.Random(0), epoch=0) == "vocaloid, {retro style}"


def test_multi_line_caption_draws_every_line_and_prefix_applies_to_each():
    cfg = CaptionConfig(caption_prefix="pre,", caption_suffix=", post")
    text = "first line\n\nsecond line\nthird line\n"
    outs = {compose_caption(text, cfg, random.Random(s), epoch=0) for s in range(60)}
    assert outs == {f"pre, {x} , post" for x in ("first line", "second line", "third line")}


def test_caption_dropout_every_n_epochs_is_one_based_like_sd_scripts():
    cfg = CaptionConfig(caption_dropout_every_n_epochs=2)
    got = [compose_caption("a, b", cfg, random.Random(0), epoch=e) for e in range(4)]
    assert got == ["a, b", "", "a, b", ""]  # sd-scripts epochs 1..4: dropped in 2 and 4


def test_caption_dropout_rate_frequency():
    cfg = CaptionConfig(caption_dropout_rate=0.25)
    drops = sum(compose_caption("a", cfg, random.Random(s), epoch=0) == "" for s in range(4000))
    assert abs(drops / 4000 - 0.25) < 0.03


def test_tag_dropout_only_touches_flexible_tags():
    cfg = CaptionConfig(caption_tag_dropout_rate=0.5, keep_tokens=1)
    lengths = []
    for s in range(300):
        out = compose_caption("k, a, b, c, d", cfg, random.Random(s), epoch=0).split(", ")
        assert out[0] == "k"
        lengths.append(len(out) - 1)
    assert abs(sum(lengths) / len(lengths) - 2.0) < 0.3  # 4 tags x 0.5 kept


@pytest.mark.parametrize("step", [0, 3, 7, 10, 20])
def test_token_warmup_formula(step):
    cfg = CaptionConfig(token_warmup_min=2, token_warmup_step=10)
    tags = [f"t{i}" for i in range(8)]
    out = compose_caption(", ".join(tags), cfg, random.Random(0), epoch=0, step=step, warmup_steps=10)
    n = 8 if step >= 10 else math.floor(step * (8 - 2) / 10) + 2  # sd-scripts BaseDataset.process_caption
    assert out.split(", ") == tags[:n]


def test_fractional_warmup_needs_run_length():
    cfg = CaptionConfig(token_warmup_step=0.5)
    assert resolve_warmup_steps(cfg, 200) == 100
    with pytest.raises(ValueError, match="max_train_steps"):
        resolve_warmup_steps(cfg, None)


def test_custom_separator_is_kept_after_shuffle():  # sd-scripts issue #1304
    cfg = CaptionConfig(shuffle_caption=True, caption_separator=".")
    out = compose_caption("a. b. c", cfg, random.Random(1), epoch=0)
    assert sorted(out.split(". ")) == ["a", "b", "c"]


def test_possible_captions_enumerates_lines_and_dropout():
    cfg = CaptionConfig(caption_dropout_rate=0.1, caption_prefix="p")
    assert possible_captions("x\ny", cfg) == ["p x", "p y", ""]
    with pytest.raises(ValueError):
        possible_captions("x", CaptionConfig(shuffle_caption=True))
