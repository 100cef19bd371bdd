"""finetune/ metadata tools (sd-scripts' names and flags) and fine_tune.py reading their metadata JSON."""

from __future__ import annotations

import json
import shutil

import pytest

import fine_tune
from finetune import merge_captions_to_metadata, merge_dd_tags_to_metadata
from library.files.weights import read_metadata
from library.run.demo import make_example_dataset


@pytest.fixture()
def images(tmp_path):
    folder = make_example_dataset(tmp_path / "src") / "10_sks shape"
    out = tmp_path / "images"
    shutil.copytree(folder, out)
    for txt in sorted(out.glob("*.txt")):  # captions in .caption files, tags in .txt files
        txt.with_suffix(".caption").write_text("a drawing\n")
        txt.write_text(txt.read_text().strip().replace(" ", ", ", 1))
    return out


def test_merge_captions_then_tags_then_fine_tune_reads_them(images, tmp_path, tiny_dir):
    cap = tmp_path / "meta_cap.json"
    merge_captions_to_metadata.run([str(images), str(cap)])
    both = tmp_path / "meta_cap_dd.json"
    (images / "extra.png").write_bytes((sorted(images.glob("*.png"))[0]).read_bytes())  # no tag file: left out
    merge_dd_tags_to_metadata.run([str(images), str(both), "--in_json", str(cap)])
    meta = json.loads(both.read_text())
    stems = sorted(p.stem for p in images.glob("*.png") if p.stem != "extra")
    assert sorted(k for k in meta if "tags" in meta[k]) == stems
    first = meta[stems[0]]
    assert first["caption"] == "a drawing" and first["tags"] == (images / f"{stems[0]}.txt").read_text().strip()
    result = fine_tune.run([
        "--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--in_json", str(both), "--train_data_dir",
        str(images), "--resolution", "64", "--output_dir", str(tmp_path / "out"), "--save_model_as", "safetensors",
        "--max_train_steps", "2", "--max_data_loader_n_workers", "0", "--seed", "1",
    ])  # fmt: skip
    assert result.steps == 2 and result.output.exists()
    freq = json.loads(read_metadata(result.output)["ss_tag_frequency"])
    assert any("a drawing" in tags for tags in freq.values())  # caption + tags were the training text


def test_full_path_keys_and_bad_input(images, tmp_path):
    meta = merge_captions_to_metadata.run([str(images), str(tmp_path / "m.json"), "--full_path"])
    assert all(key.startswith(str(images)) for key in meta)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        merge_captions_to_metadata.run([str(tmp_path / "missing"), str(tmp_path / "m.json")])
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected an object"):
        merge_dd_tags_to_metadata.run([str(images), str(tmp_path / "m.json"), "--in_json", str(tmp_path / "bad.json")])


@pytest.mark.parametrize(
    "tags, expected",
    [
        ("1girl, long_hair, white shirt, shirt, smile, rating:safe", "1girl, long hair, white shirt, smile"),
        ("2girls, blue_eyes, red_eyes, long_hair, blonde_hair, black_hair, ponytail, smile",
         "2girls, long hair, ponytail, smile"),  # conflicting per-person tags dropped; one hair length kept
        ("1girl, blue_eyes, blonde_hair, ^_^, hair_ornament, star hair ornament", "1girl, blue eyes, blonde hair, "
         "^_^, star hair ornament"),  # one person: nothing dropped but the redundant tag; the emoticon kept
    ],
)  # fmt: skip
def test_clean_tags(tags, expected):
    from library.data.caption_cleaning import clean_tags

    assert clean_tags(tags) == expected


def test_clean_captions_and_tags_tool(tmp_path):
    from finetune import clean_captions_and_tags

    meta = {"a": {"caption": "a cartoon drawing of a young anime woman", "tags": "1girl, shirt, blue_shirt"},
            "b": {"caption": "people in a park"}}  # fmt: skip
    (tmp_path / "in.json").write_text(json.dumps(meta))
    out = clean_captions_and_tags.run([str(tmp_path / "in.json"), str(tmp_path / "out.json")])
    assert out["a"] == {"caption": "a drawing of a girl", "tags": "1girl, blue shirt"}
    assert out["b"] == {"caption": "girls in a park"} == json.loads((tmp_path / "out.json").read_text())["b"]
    legacy = clean_captions_and_tags.run([str(tmp_path), str(tmp_path / "in.json"), str(tmp_path / "out2.json")])
    assert legacy == out


def test_prepare_buckets_latents_caches_what_fine_tune_reads(images, tmp_path, tiny_dir):
    from finetune import prepare_buckets_latents

    cap = tmp_path / "meta_cap.json"
    merge_captions_to_metadata.run([str(images), str(cap)])
    out = tmp_path / "meta_lat.json"
    meta = prepare_buckets_latents.run([str(images), str(cap), str(out), str(tiny_dir / "sd1"),
                                         "--max_resolution", "64,64", "--min_bucket_reso", "64",
                                         "--max_bucket_reso", "128"])  # fmt: skip
    assert all(entry["train_resolution"] == [64, 64] for entry in meta.values())
    cached = sorted(p.name for p in images.iterdir() if p.suffix not in (".png", ".txt", ".caption"))
    assert len(cached) >= 4, cached  # one latent file per image, next to it
    with pytest.raises(ValueError, match="--recursive without --full_path"):
        prepare_buckets_latents.run([str(images), str(cap), str(out), str(tiny_dir / "sd1"), "--recursive"])
