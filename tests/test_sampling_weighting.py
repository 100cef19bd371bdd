"""Prompt weighting: A1111 syntax against hand-computed weights, the mean-restoring rule against a hand computation,
and the chunked ids / conditioning against the family's own tokenizer and encoder."""

from __future__ import annotations

import copy

import pytest
import torch

from library.text.prompt_weighting import (
    apply_weights,
    chunk_ids,
    encode_weighted,
    merged_weights,
    num_chunks,
    parse_weighted,
    weighted_token_ids,
)

R = 1.1
CASES = [
    ("a cat", [("a cat", 1.0)]),
    ("a (cat)", [("a ", 1.0), ("cat", R)]),
    ("a ((cat))", [("a ", 1.0), ("cat", R * R)]),
    ("a (cat:1.3) b", [("a ", 1.0), ("cat", 1.3), (" b", 1.0)]),
    ("(cat : 0.5 )", [("cat ", 0.5)]),
    ("((cat:1.5))", [("cat", 1.5 * R)]),
    ("[cat]", [("cat", 1 / R)]),
    ("[[cat]]", [("cat", 1 / R / R)]),
    ("(a [b] c)", [("a ", R), ("b", 1.0), (" c", R)]),
    (r"\(cat\) \[x\] a\\b", [(r"(cat) [x] a\b", 1.0)]),
    ("a (cat", [("a ", 1.0), ("cat", R)]),  # unclosed: applied at the end
    ("a [cat", [("a ", 1.0), ("cat", 1 / R)]),
    ("cat) dog]", [("cat) dog]", 1.0)]),  # unmatched closers are text
    ("ratio 16:9", [("ratio 16:9", 1.0)]),
    ("(time: noon)", [("time: noon", R)]),  # not a number: text, then ')' gives 1.1
    ("(a [b) c]", [("a ", R), ("b", 1.0), (" c", 1 / R)]),  # kinds matched separately, as A1111
    ("a BREAK b", [("a", 1.0), ("BREAK", -1.0), ("b", 1.0)]),
    ("aBREAK b", [("aBREAK b", 1.0)]),
    ("", [("", 1.0)]),
]


@pytest.mark.parametrize("text,expected", CASES)
def test_parse_weighted(text, expected):
    got = parse_weighted(text)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [w for _, w in got] == pytest.approx([w for _, w in expected], rel=1e-12)


def test_apply_weights_matches_hand_computation():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 3, generator=g) + 0.3
    weights = torch.tensor([[1.0, 1.2, 0.8, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    out = apply_weights(hidden, weights)
    # by hand: row 0 scaled per token, then rescaled so its mean over tokens and features is the original mean
    row = hidden[0].double()
    scaled = torch.stack([row[i] * float(weights[0, i]) for i in range(5)])
    expected = scaled * (row.sum() / 15) / (scaled.sum() / 15)
    assert torch.allclose(out[0].double(), expected, atol=1e-6)
    assert torch.equal(out[1], hidden[1])  # all weights 1: untouched
    assert out[0].mean().item() == pytest.approx(hidden[0].mean().item(), abs=1e-6)
    plain = apply_weights(hidden, weights, normalize="none")
    assert torch.allclose(plain[0], hidden[0] * weights[0, :, None])
    by_abs = apply_weights(hidden, weights, normalize="abs")
    assert by_abs[0].abs().mean().item() == pytest.approx(hidden[0].abs().mean().item(), rel=1e-6)


def test_apply_weights_gradient_is_finite_for_a_zero_mean_prompt():
    """A layer-normed prompt can have a mean of exactly 0 (the tiny CLIP's does): no rescale, and the gradient that
    trains embeddings through the weighting (--weighted_captions) stays finite."""
    hidden = torch.tensor([[[1.0, -1.0], [2.0, -2.0]], [[0.5, 1.0], [1.0, 0.5]]], requires_grad=True)
    weights = torch.tensor([[1.0, 1.0], [1.0, 1.5]])
    out = apply_weights(hidden, weights)
    out.sum().backward()
    assert torch.equal(out[0], hidden[0]) and torch.isfinite(hidden.grad).all()


def test_chunk_count_and_weight_layout():
    assert num_chunks([3, 80], 3) == 2 and num_chunks([0], 3) == 1 and num_chunks([400], 3) == 3
    w = merged_weights([1.5, 0.5], 2)
    assert w.shape == (152,) and w[:4].tolist() == [1.0, 1.5, 0.5, 1.0] and w[3:].eq(1.0).all()


@pytest.mark.parametrize("family_name", ["sd1", "sd2", "sdxl"])
@pytest.mark.parametrize("max_token_length", [None, 150, 225])
def test_unweighted_prompt_gives_family_ids_and_conditioning(tiny_parts, family_name, max_token_length):
    from library.families import get_family

    family, parts = get_family(family_name), tiny_parts[family_name]
    k = (max_token_length or 75) // 75
    caption = " ".join(["a photo of a red cat on a mat"] * (8 * k))  # long enough to fill all k chunks
    expected = family.tokenize(parts, [caption, "short"], max_token_length)
    for tok, ids in zip(parts.tokenizers, expected):
        ours = torch.stack([chunk_ids(weighted_token_ids(tok, c)[0], k, tok) for c in (caption, "short")])
        assert torch.equal(ours, ids)
    with torch.no_grad():
        want = family.encode_prompt(parts, [caption, "short"], max_token_length=max_token_length)
        got = encode_weighted(family, parts, [caption, "short"], max_embeddings_multiples=k, min_chunks=k)
    assert torch.equal(got.hidden_states, want.hidden_states)
    assert (got.pooled is None) == (want.pooled is None)
    if want.pooled is not None:
        assert torch.equal(got.pooled, want.pooled)


@pytest.mark.parametrize("family_name", ["sd1", "sdxl"])
def test_weighted_prompt_against_hand_computation(tiny_parts, family_name):
    from library.families import get_family

    family, parts = get_family(family_name), copy.deepcopy(tiny_parts[family_name])
    # a freshly initialised final LayerNorm makes every token's mean 0; give it a bias as trained models have
    for te in parts.text_encoders:
        getattr(te, "text_model", te).final_layer_norm.bias.data.uniform_(-0.5, 1.0)
    tok = parts.tokenizers[0]
    n_cat = len(tok("red cat").input_ids) - 2
    with torch.no_grad():
        plain = family.encode_prompt(parts, ["a red cat on a mat"])
        got = encode_weighted(family, parts, ["a (red cat:1.5) on a mat"])
    w = torch.ones(77)
    w[2 : 2 + n_cat] = 1.5  # BOS, "a", then the weighted words
    h = plain.hidden_states[0].double()
    expected = h * w.double()[:, None]
    expected = expected * h.mean() / expected.mean()
    assert torch.allclose(got.hidden_states[0].double(), expected, atol=1e-5)
    if plain.pooled is not None:
        assert torch.equal(got.pooled, plain.pooled)  # the pooled embedding is not weighted


def test_break_starts_a_new_chunk(tiny_parts):
    parts = tiny_parts["sd1"]
    tok = parts.tokenizers[0]
    ids, weights = weighted_token_ids(tok, "a cat BREAK a dog")
    cat = len(tok("a cat").input_ids) - 2
    assert len(ids) == 75 + len(tok("a dog").input_ids) - 2
    assert ids[cat:75] == [tok.pad_token_id] * (75 - cat) and ids[75:] == tok("a dog").input_ids[1:-1]


def test_textual_inversion_token_is_expanded(tiny_parts, tmp_path):
    from safetensors.torch import save_file

    from library.families import get_family
    from library.text.textual_inversion import add_embedding

    family, parts = get_family("sd1"), copy.deepcopy(tiny_parts["sd1"])
    save_file({"emb_params": torch.randn(3, 32)}, str(tmp_path / "mychar.safetensors"))
    (ids,) = add_embedding(family, parts, tmp_path / "mychar.safetensors")
    tok = parts.tokenizers[0]
    got, weights = weighted_token_ids(tok, "a (mychar:1.2)", {ids[0]: ids})
    assert got == tok("a").input_ids[1:-1] + ids and weights == [1.0, 1.2, 1.2, 1.2]
    comfy, _ = weighted_token_ids(tok, "a embedding:mychar", {ids[0]: ids})
    assert comfy == tok("a").input_ids[1:-1] + ids
