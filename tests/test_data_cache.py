"""Latent and text-encoder caches: keys change when any input changes and only then; cached batches equal
encoding the uncached batches; disk caches are reused across runs and never stale; conflicting flags are errors."""

from __future__ import annotations

import copy
import os
from dataclasses import replace

import pytest
import torch
from _data_utils import make_png, parse, small_args, tree_digest

from library.data import build_datasets, cache_latents, cache_text_encoder_outputs, make_loader
from library.data.cache_store import latent_key, text_key

BASE = dict(
    image_digest="a" * 64,
    encoder_id="vae-1",
    bucket=(64, 64),
    resized=(96, 64),
    crop=(16, 0),
    flip=False,
    interpolation=None,
    mask_digest=None,
    alpha_mask=False,
)
CHANGES = dict(
    image_digest="b" * 64,
    encoder_id="vae-2",
    bucket=(64, 32),
    resized=(97, 64),
    crop=(15, 0),
    flip=True,
    interpolation="lanczos",
    mask_digest="c" * 64,
    alpha_mask=True,
)


def test_latent_key_changes_with_every_input_and_only_then():
    base = latent_key(**BASE)
    assert latent_key(**copy.deepcopy(BASE)) == base
    keys = {name: latent_key(**{**BASE, name: value}) for name, value in CHANGES.items()}
    assert base not in keys.values() and len(set(keys.values())) == len(CHANGES)
    assert text_key(caption="a", encoder_id="te") == text_key(caption="a", encoder_id="te")
    assert len({text_key(caption="a", encoder_id="te"), text_key(caption="b", encoder_id="te"),
                text_key(caption="a", encoder_id="te2")}) == 3  # fmt: skip


@pytest.fixture
def vae(tiny_parts):
    model = copy.deepcopy(tiny_parts["sd1"].vae).eval()
    calls = []

    def encode(pixels: torch.Tensor) -> torch.Tensor:  # deterministic (mean), so cached == recomputed
        calls.append(pixels.shape[0])
        return model.encode(pixels).latent_dist.mode() * model.config.scaling_factor

    encode.calls = calls
    return encode


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "train"
    for i, (w, h) in enumerate([(64, 64), (96, 64), (64, 96), (80, 80)]):
        make_png(root / "2_x" / f"img{i}.png", w, h, seed=i)
        (root / "2_x" / f"img{i}.txt").write_text(f"caption {i}\nother {i}")
    return root


def test_cached_latents_equal_encoding_the_uncached_batches(dataset, vae):
    args = parse(
        small_args(dataset, "--train_batch_size", "2", "--flip_aug", "--cache_latents", "--vae_batch_size", "3")
    )
    plan = build_datasets(args, size_multiple=32, seed=4)
    cache = cache_latents(plan, vae, "tiny-vae", show_progress=False)
    assert sum(vae.calls) == 4 * 2  # 4 images x (plain, flipped), one bucket each
    assert max(vae.calls) <= 3  # --vae_batch_size
    plain = make_loader(replace(plan, args=replace(plan.args, cache_latents=False)))
    cached = make_loader(plan, latent_cache=cache)
    for a, b in zip(plain.epoch(1), cached.epoch(1), strict=True):
        assert a.image_paths == b.image_paths and a.flipped.tolist() == b.flipped.tolist()
        assert b.pixels is None and torch.equal(a.crop_top_lefts, b.crop_top_lefts)
        with torch.no_grad():
            assert torch.allclose(b.latents, vae(a.pixels), atol=1e-5)


def test_disk_cache_is_reused_and_never_stale(dataset, vae, tmp_path):
    cache_dir = tmp_path / "cache"
    before = tree_digest(dataset)
    argv = small_args(dataset, "--cache_latents_to_disk", "--cache_dir", str(cache_dir))
    plan = build_datasets(parse(argv), size_multiple=32)
    cache_latents(plan, vae, "vae-A", show_progress=False)
    assert sum(vae.calls) == 4
    vae.calls.clear()
    cache_latents(build_datasets(parse(argv), size_multiple=32), vae, "vae-A", show_progress=False)
    assert sum(vae.calls) == 0  # a new run reuses every entry
    make_png(dataset / "2_x" / "img1.png", 96, 64, seed=99)  # same name and size, new content
    before["2_x/img1.png"] = tree_digest(dataset)["2_x/img1.png"]
    plan = build_datasets(parse(argv), size_multiple=32)
    cache = cache_latents(plan, vae, "vae-A", show_progress=False)
    assert sum(vae.calls) == 1  # only the edited image
    vae.calls.clear()
    cache_latents(plan, vae, "vae-B", show_progress=False)
    assert sum(vae.calls) == 4  # another VAE: everything
    vae.calls.clear()
    argv_res = [a if a != "64" else "96" for a in argv]  # a new resolution: new buckets, new entries
    cache_latents(build_datasets(parse(argv_res), size_multiple=32), vae, "vae-A", show_progress=False)
    assert sum(vae.calls) == 4
    assert tree_digest(dataset) == before  # the dataset folder only changed where we edited it
    batch = next(iter(make_loader(plan, latent_cache=cache).epoch(0)))
    assert batch.latents.shape[1:] == (4, batch.target_sizes[0, 0] // 8, batch.target_sizes[0, 1] // 8)


def test_to_disk_without_cache_dir_only_adds_our_own_files(dataset, vae):
    before = tree_digest(dataset)
    plan = build_datasets(parse(small_args(dataset, "--cache_latents_to_disk")), size_multiple=32)
    cache_latents(plan, vae, "vae-A", show_progress=False)
    after = tree_digest(dataset)
    assert {k: after[k] for k in before} == before  # no user file touched
    added = sorted(set(after) - set(before))
    assert len(added) == 4 and all(".sdtrain-latent-" in a and a.endswith(".safetensors") for a in added)


def test_text_encoder_cache_matches_direct_encoding(dataset, tiny_parts):
    te = copy.deepcopy(tiny_parts["sd1"].text_encoders[0]).eval()
    tok = tiny_parts["sd1"].tokenizers[0]

    def encode_text(captions: list[str]) -> dict[str, torch.Tensor]:
        ids = tok(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        with torch.no_grad():
            out = te(ids)
        return {"hidden_states": out.last_hidden_state, "pooled": out.pooler_output}

    argv = small_args(
        dataset, "--train_batch_size", "2", "--cache_text_encoder_outputs", "--caption_dropout_rate", "0.3"
    )
    plan = build_datasets(parse(argv), size_multiple=32, seed=2)
    cache = cache_text_encoder_outputs(plan, encode_text, "tiny-clip", show_progress=False)
    assert len(cache.keys) == 4 * 2 + 1  # two lines per caption file, plus the dropped (empty) caption
    seen = set()
    for batch in make_loader(plan, text_cache=cache).epoch(0):
        direct = encode_text(batch.captions)
        assert torch.allclose(batch.text_encoder_outputs["hidden_states"], direct["hidden_states"], atol=1e-5)
        assert torch.allclose(batch.text_encoder_outputs["pooled"], direct["pooled"], atol=1e-5)
        seen.update(batch.captions)
    assert len(seen) > 2


def test_flags_that_contradict_caching_are_errors_up_front(dataset):
    with pytest.raises(ValueError) as e:
        build_datasets(parse(small_args(dataset, "--cache_latents", "--random_crop", "--color_aug")), size_multiple=32)
    assert "random_crop changes the image every step" in str(e.value) and "color_aug" in str(e.value)
    with pytest.raises(ValueError, match="shuffle_caption changes the caption every step"):
        build_datasets(
            parse(small_args(dataset, "--cache_text_encoder_outputs", "--shuffle_caption")), size_multiple=32
        )
    plan = build_datasets(parse(small_args(dataset, "--cache_latents")), size_multiple=32)
    with pytest.raises(ValueError, match="no latent_cache was given"):
        make_loader(plan)
    assert os.path.isdir(dataset)
