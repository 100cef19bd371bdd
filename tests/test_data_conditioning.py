"""Conditioning images (ControlNet-LLLite training): paired by base name, cut exactly like their training image,
every pairing problem reported before training, and the masked-loss meaning of the key kept for other trainers."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from _data_utils import make_png, parse

from library.cli.problems import ConfigError
from library.data import DataArgs, build_datasets, make_loader
from library.data.data_args import add_dataset_args


def parse_cond(argv: list[str]) -> DataArgs:
    """The dataset flags of a trainer that takes conditioning images."""
    parser = argparse.ArgumentParser()
    add_dataset_args(parser, conditioning=True)
    return DataArgs.from_args(parser.parse_args(argv))


def _pairs(tmp_path, sizes):
    for i, (w, h) in enumerate(sizes):
        img = make_png(tmp_path / "img" / f"p{i}.png", w, h, seed=i)
        (tmp_path / "img" / f"p{i}.txt").write_text(f"picture {i}")
        (tmp_path / "cond").mkdir(exist_ok=True)
        shutil.copy(img, tmp_path / "cond" / f"p{i}.png")  # the training image itself: the pixels must line up
    return ["--train_data_dir", str(tmp_path / "img"), "--conditioning_data_dir", str(tmp_path / "cond")]


def test_conditioning_pixels_follow_resize_crop_and_flip_of_their_image(tmp_path):
    """A conditioning image that is a copy of its training image comes out equal to the training pixels, whatever
    bucket resize, centre crop and flip the sample got; the batch carries it as (B, 3, H, W) in [-1, 1]."""
    flags = _pairs(tmp_path, [(96, 64), (80, 112), (128, 128)])
    flags += ["--resolution", "64", "--enable_bucket", "--min_bucket_reso", "32", "--max_bucket_reso", "128"]
    flags += ["--bucket_reso_steps", "32", "--caption_extension", ".txt", "--flip_aug", "--train_batch_size", "1"]
    plan = build_datasets(parse_cond(flags), size_multiple=32, seed=1)
    assert plan.report.conditioning_images == 3 and "paired with conditioning images" in plan.report.to_text()
    flipped = set()
    for epoch in range(3):
        for batch in make_loader(plan).epoch(epoch):
            cond = batch.conditioning_images
            assert cond is not None and cond.shape == batch.pixels.shape and cond.dtype == torch.float32
            assert torch.equal(cond, batch.pixels)
            assert -1 <= cond.min() and cond.max() <= 1
            flipped.add(bool(batch.flipped[0]))
    assert flipped == {True, False}  # both branches were seen


def test_every_pairing_problem_is_reported_before_training_naming_both_files(tmp_path):
    flags = _pairs(tmp_path, [(64, 64), (64, 64), (64, 64)])
    (tmp_path / "cond" / "p0.png").unlink()  # missing
    make_png(tmp_path / "cond" / "p1.png", 64, 96)  # another size
    make_png(tmp_path / "cond" / "stray.png", 64, 64)  # no training image
    with pytest.raises(ValueError) as e:
        build_datasets(parse_cond(flags + ["--resolution", "64"]), size_multiple=32)
    text = str(e.value)
    assert "p0.png" in text and "no conditioning image named p0.*" in text
    assert "p1.png" in text and str(tmp_path / "cond" / "p1.png") in text and "64x96" in text
    assert "stray.png" in text


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["--random_crop"], "--random_crop: not supported with conditioning images"),
        (["--masked_loss"], "--masked_loss: this trainer reads conditioning_data_dir"),
    ],
)
def test_settings_that_clash_with_conditioning_images_are_refused(tmp_path, extra, expect):
    flags = _pairs(tmp_path, [(64, 64)]) + ["--resolution", "64", *extra]
    with pytest.raises(ConfigError, match=expect):
        build_datasets(parse_cond(flags), size_multiple=32)


def test_dataset_file_subsets_need_the_folder_and_other_trainers_keep_masks(tmp_path):
    _pairs(tmp_path, [(64, 64)])
    toml = tmp_path / "d.toml"
    toml.write_text(f'[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "img"}"\n')
    with pytest.raises(ConfigError, match=r"subsets\[0\]\.conditioning_data_dir: required"):
        build_datasets(parse_cond(["--dataset_config", str(toml)]), size_multiple=32)
    toml.write_text(toml.read_text() + f'conditioning_data_dir = "{tmp_path / "cond"}"\n')
    plan = build_datasets(parse_cond(["--dataset_config", str(toml)]), size_multiple=32)
    assert plan.datasets[0].records[0].conditioning_path == str(tmp_path / "cond" / "p0.png")
    # a trainer without conditioning images: the key is the masks' folder (needs --masked_loss), no conditioning
    with pytest.raises(ConfigError, match="masks need --masked_loss"):
        build_datasets(parse(["--dataset_config", str(toml)]), size_multiple=32)
    plan = build_datasets(parse(["--dataset_config", str(toml), "--masked_loss"]), size_multiple=32)
    rec = plan.datasets[0].records[0]
    assert rec.mask_path == str(tmp_path / "cond" / "p0.png") and rec.conditioning_path is None
    assert next(iter(make_loader(plan).epoch(0))).conditioning_images is None
