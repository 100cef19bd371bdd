"""library/families/tokenizers.py DeferredTokenizer: the tokenizer a family's loader hands out is built at its first
use and is then the real one (same ids, attributes set on it, pickled as it)."""

from __future__ import annotations

import pickle

from library.families.tokenizers import DeferredTokenizer, load_clip_tokenizer


def test_built_at_first_use_and_then_the_real_tokenizer():
    built = []

    def load(pad):
        built.append(pad)
        return load_clip_tokenizer(pad)

    deferred = DeferredTokenizer(load, "!")
    assert not deferred.loaded and bool(deferred) and built == []  # ``tokenizer or default`` builds nothing
    real = load_clip_tokenizer("!")
    text = ["a photo of sks dog", "x"]
    assert deferred(text, padding="max_length", max_length=12).input_ids == real(text, padding="max_length",
                                                                                max_length=12).input_ids  # fmt: skip
    assert built == ["!"] and deferred.loaded
    assert len(deferred) == len(real) and deferred.pad_token == real.pad_token == "!"
    deferred.model_max_length = 33  # set on the tokenizer itself
    assert deferred.resolve().model_max_length == 33 and built == ["!"]
    copy = pickle.loads(pickle.dumps(deferred))  # a data loader worker gets the real tokenizer
    assert not isinstance(copy, DeferredTokenizer) and copy("x").input_ids == real("x").input_ids
