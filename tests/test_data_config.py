"""Dataset config: sd-scripts' documented TOML examples, the folder convention, --in_json, and error messages."""

from __future__ import annotations

import json
import math

import pytest
from _data_utils import make_png, parse

from library.data import load_dataset_configs
from library.data.buckets import predefined_buckets
from library.data.resolution import parse_resolutions


def _dirs(tmp_path, *names):
    out = {}
    for i, name in enumerate(names):
        out[name] = make_png(tmp_path / name / f"img{i}.png", 64, 64, seed=i).rsplit("/", 1)[0]
    return out


def test_sd_scripts_readme_example(tmp_path):
    d = _dirs(tmp_path, "hoge", "fuga", "reg", "piyo")
    meta = tmp_path / "piyo" / "piyo_md.json"
    meta.write_text(json.dumps({"img3": {"caption": "a frog", "tags": "green"}}))
    # docs/config_README-en.md, first example, with the Windows paths replaced
    toml = f"""
[general]
shuffle_caption = true
caption_extension = '.txt'
keep_tokens = 1

# This is a DreamBooth-style dataset
[[datasets]]
resolution = 512
batch_size = 4
keep_tokens = 2

  [[datasets.subsets]]
  image_dir = '{d["hoge"]}'
  class_tokens = 'hoge girl'

  [[datasets.subsets]]
  image_dir = '{d["fuga"]}'
  class_tokens = 'fuga boy'
  keep_tokens = 3

  [[datasets.subsets]]
  is_reg = true
  image_dir = '{d["reg"]}'
  class_tokens = 'human'
  keep_tokens = 1

# This is a fine-tuning dataset
[[datasets]]
resolution = [768, 768]
batch_size = 2

  [[datasets.subsets]]
  image_dir = '{d["piyo"]}'
  metadata_file = '{meta}'
"""
    path = tmp_path / "dataset.toml"
    path.write_text(toml)
    (db, ft), _ = load_dataset_configs(parse(["--dataset_config", str(path)]))
    assert (db.resolutions, db.batch_size, ft.resolutions, ft.batch_size) == (((512, 512),), 4, ((768, 768),), 2)
    assert [s.kind for s in db.subsets] == ["dreambooth"] * 3 and ft.subsets[0].kind == "finetune"
    assert [s.captions.keep_tokens for s in db.subsets + ft.subsets] == [2, 3, 1, 1]
    assert [s.class_tokens for s in db.subsets] == ["hoge girl", "fuga boy", "human"]
    assert [s.is_reg for s in db.subsets] == [False, False, True]
    assert all(s.captions.shuffle_caption and s.caption_extension == ".txt" for s in db.subsets)
    assert [s.num_repeats for s in db.subsets + ft.subsets] == [1, 1, 1, 1]
    assert predefined_buckets(db.bucket_spec()) == [(512, 512)]  # enable_bucket not set: one bucket


def _independent_count(res: int, lo: int, hi: int, step: int) -> int:
    area, out = res * res, {(math.isqrt(res * res) // step * step,) * 2}
    for w in range(lo, hi + 1, step):
        h = min(hi, area // w // step * step)
        if h >= lo:
            out |= {(w, h), (h, w)}
    return len(out)


def test_bucket_sets_through_the_config(tmp_path):
    d = _dirs(tmp_path, "a")
    path = tmp_path / "d.toml"
    path.write_text(
        f"""[general]
enable_bucket = true
[[datasets]]
resolution = 512
  [[datasets.subsets]]
  image_dir = '{d["a"]}'
  num_repeats = 10
[[datasets]]
resolution = 1024
max_bucket_reso = 2048
  [[datasets.subsets]]
  image_dir = '{d["a"]}'
"""
    )
    (a, b), _ = load_dataset_configs(parse(["--dataset_config", str(path)]))
    assert len(predefined_buckets(a.bucket_spec())) == _independent_count(512, 256, 1024, 64) == 17
    assert len(predefined_buckets(b.bucket_spec())) == _independent_count(1024, 256, 2048, 64) == 41
    assert a.subsets[0].num_repeats == 10 and b.subsets[0].num_repeats == 1  # same dir in two datasets is fine


def test_secondary_separator_example_and_cli_fallback(tmp_path):
    d = _dirs(tmp_path, "img")
    path = tmp_path / "d.toml"
    path.write_text(
        f"""[general]
flip_aug = true
color_aug = false
resolution = [1024, 1024]

[[datasets]]
batch_size = 6
enable_bucket = true
bucket_no_upscale = true
caption_extension = ".txt"
keep_tokens_separator= "|||"
shuffle_caption = true
caption_tag_dropout_rate = 0.1
secondary_separator = ";;;"
enable_wildcard = true

  [[datasets.subsets]]
  image_dir = "{d["img"]}"
  num_repeats = 1
  caption_prefix = "1girl, hatsune miku, vocaloid |||"
  caption_suffix = ", anime screencap ||| masterpiece, rating: general"
"""
    )
    (ds,), _ = load_dataset_configs(parse(["--dataset_config", str(path), "--keep_tokens", "5", "--random_crop"]))
    s = ds.subsets[0]
    assert ds.batch_size == 6 and ds.bucket_no_upscale and ds.resolutions == ((1024, 1024),)
    assert s.flip_aug and not s.color_aug and s.random_crop  # random_crop from the command line
    assert s.captions.keep_tokens == 5 and s.captions.keep_tokens_separator == "|||"
    assert s.captions.caption_tag_dropout_rate == 0.1 and s.captions.enable_wildcard


def test_all_errors_at_once_with_file_key_path_and_fix(tmp_path):
    d = _dirs(tmp_path, "a")
    path = tmp_path / "dataset.toml"
    path.write_text(
        f"""[general]
shufle_caption = true
prior_loss_weight = 2.0
[[datasets]]
resolution = 512
  [[datasets.subsets]]
  image_dir = '{d["a"]}'
[[datasets]]
resolution = 512
batch_size = 0
  [[datasets.subsets]]
  image_dir = '{d["a"]}'
  num_repeats = "ten"
  imgae_dir = 'x'
  batch_size = 2
"""
    )
    with pytest.raises(ValueError) as e:
        load_dataset_configs(parse(["--dataset_config", str(path)]))
    msg = str(e.value)
    f = str(path)
    assert f'{f}: datasets[1].subsets[0].num_repeats: expected an integer >= 1, got "ten"' in msg
    assert f'{f}: general.shufle_caption: unknown key; did you mean "shuffle_caption"?' in msg
    assert f'{f}: datasets[1].subsets[0].imgae_dir: unknown key; did you mean "image_dir"?' in msg
    assert f"{f}: general.prior_loss_weight: not a dataset-file key; it is a command-line flag" in msg
    assert f"{f}: datasets[1].batch_size: expected an integer >= 1, got 0" in msg
    assert f"{f}: datasets[1].subsets[0].batch_size: batch_size can only be set in [general] or a [[datasets]]" in msg
    assert msg.startswith("6 problems")


def test_missing_required_keys_and_paths(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(
        json.dumps({"datasets": [{"resolution": 64, "subsets": [{"class_tokens": "x"}, {"image_dir": "nope"}]}]})
    )
    with pytest.raises(ValueError) as e:
        load_dataset_configs(parse(["--dataset_config", str(path)]), size_multiple=64)
    msg = str(e.value)
    assert "datasets[0].subsets[0].image_dir: required" in msg
    assert 'datasets[0].subsets[1].image_dir: folder "nope" not found' in msg


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[general]\nshuffle_caption = tru\n")
    with pytest.raises(ValueError, match=r"bad.toml: not valid TOML: .*line 2"):
        load_dataset_configs(parse(["--dataset_config", str(path)]))


def test_dataset_repeats_only_matters_with_in_json(tmp_path):
    """sd-scripts reads --dataset_repeats for an --in_json dataset only; guides pass --dataset_repeats=0 with
    folder datasets, which must train with the folder names' repeats."""
    make_png(tmp_path / "train" / "3_dog" / "a.png", 64, 64)
    args = parse(["--train_data_dir", str(tmp_path / "train"), "--dataset_repeats", "0", "--resolution", "64"])
    (ds,), _ = load_dataset_configs(args)
    assert ds.subsets[0].num_repeats == 3
    with pytest.raises(ValueError, match="--dataset_repeats: must be >= 1 with --in_json, got 0"):
        parse(["--in_json", "m.json", "--train_data_dir", str(tmp_path), "--dataset_repeats", "0"])


def test_folder_convention(tmp_path):
    make_png(tmp_path / "train" / "10_sks dog" / "a.png", 64, 64)
    make_png(tmp_path / "train" / "2_sks_cat" / "b.png", 64, 64)
    (tmp_path / "train" / "logs").mkdir()  # a folder without images and without a prefix is ignored
    make_png(tmp_path / "reg" / "1_dog" / "r.png", 64, 64)
    args = parse(
        ["--train_data_dir", str(tmp_path / "train"), "--reg_data_dir", str(tmp_path / "reg"), "--resolution", "64"]
    )
    (ds,), _ = load_dataset_configs(args)
    got = [(s.num_repeats, s.class_tokens, s.is_reg) for s in ds.subsets]
    assert got == [(10, "sks dog", False), (2, "sks_cat", False), (1, "dog", True)]


def test_folder_without_repeat_prefix_and_loose_images_are_errors(tmp_path):
    make_png(tmp_path / "train" / "cats" / "a.png", 64, 64)
    make_png(tmp_path / "train" / "loose.png", 64, 64)
    with pytest.raises(ValueError) as e:
        load_dataset_configs(parse(["--train_data_dir", str(tmp_path / "train"), "--resolution", "64"]))
    msg = str(e.value)
    assert "cats: folder name has no repeat count" in msg and '"10_cats"' in msg
    assert "1 images lie directly in this folder" in msg


def test_in_json_fine_tune_mode(tmp_path):
    make_png(tmp_path / "img" / "a.png", 64, 64)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"a": {"caption": "x"}}))
    args = parse(
        [
            "--in_json",
            str(meta),
            "--train_data_dir",
            str(tmp_path / "img"),
            "--dataset_repeats",
            "3",
            "--resolution",
            "64",
        ]
    )
    (ds,), _ = load_dataset_configs(args)
    s = ds.subsets[0]
    assert (s.kind, s.num_repeats, s.metadata_file) == ("finetune", 3, str(meta))


def test_missing_in_json_and_image_folder_are_named_by_their_flags(tmp_path):
    """A missing --in_json file (or its --train_data_dir) is named by the flag, as given on the command line (it
    was "--in_json missing.json.metadata_file", a dataset-file key path glued to the flag)."""
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError) as e:
        load_dataset_configs(parse(["--in_json", str(missing), "--train_data_dir", str(tmp_path / "no_images"),
                                    "--resolution", "64"]))  # fmt: skip
    assert f"--in_json {missing}: file not found" in str(e.value)
    assert f"--train_data_dir {tmp_path / 'no_images'}: folder not found" in str(e.value)
    assert ".metadata_file" not in str(e.value) and ".image_dir" not in str(e.value)


def test_resolution_forms():
    assert parse_resolutions("512") == ((512, 512),)
    assert parse_resolutions("768,512") == ((768, 512),)
    assert parse_resolutions([768, 512]) == ((768, 512),)
    assert parse_resolutions("896,960,1024,1088,1152") == tuple((r, r) for r in (896, 960, 1024, 1088, 1152))
    assert parse_resolutions("512;768") == ((512, 512), (768, 768))
    assert parse_resolutions("1024;832x1216") == ((1024, 1024), (832, 1216))
    assert parse_resolutions([[512, 512], [768, 768]]) == ((512, 512), (768, 768))
    with pytest.raises(ValueError, match="expected a resolution"):
        parse_resolutions("big")


def test_flag_defaults_match_sd_scripts_and_bad_flags_are_clear():
    a = parse([])
    assert (a.caption_extension, a.caption_separator, a.min_bucket_reso, a.max_bucket_reso) == (
        ".caption",
        ",",
        256,
        1024,
    )
    assert (a.bucket_reso_steps, a.vae_batch_size, a.token_warmup_min, a.prior_loss_weight) == (64, 1, 1, 1.0)
    assert parse(["--caption_extention", ".txt"]).caption_extension == ".txt"
    assert parse(["--cache_latents_to_disk"]).cache_latents
    with pytest.raises(ValueError) as e:
        parse(["--resolution", "huge", "--train_batch_size", "0"])
    msg = str(e.value)
    assert "--resolution: expected a resolution like" in msg and "--train_batch_size: must be >= 1" in msg
    import argparse

    from library.cli.parse import ConfigError, parse_args
    from library.data.data_args import add_dataset_args

    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    with pytest.raises(ConfigError) as e:
        parse_args(parser, ["--dataset_class", "x.Y", "--debug_dataset"])
    assert "--dataset_class is not supported yet" in str(e.value) and "--debug_dataset is not supported" in str(e.value)


def test_bucket_parameter_rules(tmp_path):
    make_png(tmp_path / "t" / "1_a" / "a.png", 64, 64)
    args = parse(
        ["--train_data_dir", str(tmp_path / "t"), "--resolution", "512", "--enable_bucket", "--bucket_reso_steps", "32"]
    )
    with pytest.raises(ValueError, match="--bucket_reso_steps: 32 is not a multiple of 64"):
        load_dataset_configs(args, size_multiple=64)
    (ds,), warnings = load_dataset_configs(
        parse(
            [
                "--train_data_dir",
                str(tmp_path / "t"),
                "--resolution",
                "512",
                "--enable_bucket",
                "--min_bucket_reso",
                "300",
            ]
        )
    )
    assert ds.min_bucket_reso == 256 and any("rounded down to 256" in w for w in warnings)
    with pytest.raises(ValueError, match=r"--resolution: 500x500 is not a multiple of 64 .*; try 512x512"):
        load_dataset_configs(parse(["--train_data_dir", str(tmp_path / "t"), "--resolution", "500"]))
