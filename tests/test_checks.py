"""Configuration problems are found before training, all at once, with hints that fit the case."""

from __future__ import annotations

import pytest
from _data_utils import make_png, parse, small_args

import train_network
from library.cli.parse import ConfigError, read_config_file
from library.data import build_datasets


def test_a_missing_dataset_is_reported_with_the_other_problems(tiny_dir, tmp_path):
    argv = ["--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--network_module", "networks.lora",
            "--output_dir", str(tmp_path), "--clip_skip", "0"]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        train_network.run(argv)
    text = str(e.value)
    assert "2 problems" in text and "--clip_skip must be >= 1" in text and "no dataset given" in text
    assert "[[datasets" not in text


def test_a_missing_folder_is_one_error(tmp_path):
    with pytest.raises(ValueError) as e:
        build_datasets(parse(["--train_data_dir", str(tmp_path / "nope"), "--resolution", "64"]))
    assert "folder not found" in str(e.value) and "[[datasets" not in str(e.value)


def test_min_bucket_reso_rounded_to_zero_says_why(tmp_path):
    make_png(tmp_path / "t" / "1_x" / "a.png", 64, 64)
    args = parse(["--train_data_dir", str(tmp_path / "t"), "--resolution", "128", "--enable_bucket",
                  "--min_bucket_reso", "32", "--bucket_reso_steps", "64"])  # fmt: skip
    with pytest.raises(ValueError) as e:
        build_datasets(args)
    text = str(e.value)
    assert "--min_bucket_reso: 32 becomes 0 when rounded down to a multiple of 64" in text
    assert "bucket sides are multiples of bucket_reso_steps 64" in text and "must be between 1" not in text


@pytest.mark.parametrize("bucket", [False, True])
def test_upscale_advice_fits_the_bucket_setting(tmp_path, caplog, bucket):
    make_png(tmp_path / "t" / "1_x" / "a.png", 64, 64)
    extra = ["--enable_bucket", "--min_bucket_reso", "64", "--max_bucket_reso", "256"] if bucket else []
    build_datasets(parse(["--train_data_dir", str(tmp_path / "t"), "--resolution", "128", *extra]))
    upscaled = next(r.getMessage() for r in caplog.records if "upscaled" in r.getMessage())
    assert ("bucket_no_upscale (buckets from" in upscaled) == bucket
    assert "smaller resolution" in upscaled or bucket


def test_a_folder_without_images_gets_no_caption_extension_advice(tmp_path):
    (tmp_path / "t" / "1_x").mkdir(parents=True)
    (tmp_path / "t" / "1_x" / "a.txt").write_text("a caption")
    with pytest.raises(ValueError) as e:
        build_datasets(parse(["--train_data_dir", str(tmp_path / "t"), "--resolution", "64"]))
    assert "caption_extension" not in str(e.value) and "no training images found in" in str(e.value)


def test_a_bom_in_a_toml_is_named(tmp_path):
    dataset = tmp_path / "d.toml"
    dataset.write_text("\ufeff[general]\nresolution = 64\n", encoding="utf-8")
    with pytest.raises(ValueError, match="byte-order mark"):
        build_datasets(parse(["--dataset_config", str(dataset)]))
    config = tmp_path / "c.toml"
    config.write_text("\ufeffmax_train_steps = 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="byte-order mark"):
        read_config_file(train_network.build_parser(), config)


@pytest.mark.parametrize("saved", [False, True])
def test_starved_bucket_warning_names_images_and_the_report_only_when_written(tmp_path, saved):
    for i in range(5):
        make_png(tmp_path / "t" / "1_x" / f"tall{i}.png", 32, 128, seed=i)
    for i in range(4):
        make_png(tmp_path / "t" / "1_x" / f"square{i}.png", 64, 64, seed=i)
    report = tmp_path / "report.txt"
    extra = ["--train_batch_size", "8", *(["--bucket_report", str(report)] if saved else [])]
    plan = build_datasets(parse(small_args(tmp_path / "t", *extra)), size_multiple=32)
    warning = next(w for w in plan.report.warnings if "never fill a batch" in w)
    assert "tall0.png, tall1.png, tall2.png and 6 more" in warning or "square0.png" in warning
    assert "and 6 more" in warning
    assert (str(report) in warning) == saved and report.exists() == saved


def test_dataset_problems_come_with_the_flag_problems(tiny_dir, tmp_path):
    argv = ["--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--network_module", "networks.lora",
            "--output_dir", str(tmp_path), "--clip_skip", "0", "--train_data_dir", str(tmp_path / "nope")]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        train_network.run(argv)
    assert "--clip_skip must be >= 1" in str(e.value) and "nope: folder not found" in str(e.value)
