"""The loader: repeats per epoch, determinism (workers, resume, sharding), the batch contract, bad input, and the
user's folder is never modified."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch
from _data_utils import make_png, parse, small_args, tree_digest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from library.data import build_datasets, make_loader
from library.data.dataset_plan import balance_regularisation
from library.data.sources import ImageRecord

SIZES = [(64, 64), (96, 64), (64, 96), (80, 80), (128, 64), (64, 64)]


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "train"
    for i, (w, h) in enumerate(SIZES):
        folder = root / ("3_dog" if i < 4 else "1_cat")
        make_png(folder / f"img{i}.png", w, h, seed=i)
        (folder / f"img{i}.txt").write_text(f"tag{i}, a, b, c\nline two {i}, d")
    return root


def _epoch_counts(loader, epoch):
    counts = collections.Counter()
    for batch in loader.epoch(epoch):
        counts.update(batch.image_paths)
    return counts


def test_every_image_appears_repeats_times_per_epoch(dataset):
    plan = build_datasets(parse(small_args(dataset, "--train_batch_size", "2")), size_multiple=32, seed=3)
    loader = make_loader(plan)
    for epoch in range(2):
        counts = _epoch_counts(loader, epoch)
        want = {r.path: r.num_repeats for r in plan.datasets[0].records}
        assert counts == want
    assert sorted(set(want.values())) == [1, 3]
    assert plan.report.samples_per_epoch == sum(want.values()) == 4 * 3 + 2


@settings(max_examples=40, deadline=None, derandomize=True)
@given(repeats=st.lists(st.integers(1, 5), min_size=1, max_size=6), reg=st.lists(st.integers(1, 3), max_size=8))
def test_regularisation_balancing_matches_sd_scripts(repeats, reg):
    recs = [ImageRecord(f"t{i}", (8, 8), "", 0, False, n) for i, n in enumerate(repeats)]
    recs += [ImageRecord(f"r{i}", (8, 8), "", 0, True, n) for i, n in enumerate(reg)]
    kept, unused = balance_regularisation(recs)
    train = sum(repeats)
    reg_samples = sum(r.num_repeats for r in kept if r.is_reg)
    if reg:
        first_pass = 0  # sd-scripts registers reg images in order until their repeats reach the training count
        for n in reg:
            first_pass += n
            if first_pass >= train:
                break
        assert reg_samples == max(train, first_pass)
        assert len(unused) + sum(r.is_reg for r in kept) == len(reg)
    else:
        assert reg_samples == 0 and unused == []


def test_batch_contract_and_order_of_size_fields(dataset):
    args = parse(small_args(dataset, "--train_batch_size", "2", "--prior_loss_weight", "0.5", "--flip_aug"))
    plan = build_datasets(args, size_multiple=32, seed=0)
    for batch in make_loader(plan).epoch(0):
        b = len(batch)
        h, w = batch.pixels.shape[-2:]
        assert batch.pixels.shape == (b, 3, h, w) and batch.latents is None and batch.masks is None
        assert -1.0 <= batch.pixels.min() and batch.pixels.max() <= 1.0
        assert batch.target_sizes.tolist() == [[h, w]] * b  # (h, w)
        for path, orig, crop in zip(batch.image_paths, batch.original_sizes, batch.crop_top_lefts):
            width, height = SIZES[int(path.rsplit("img", 1)[1][0])]
            assert orig.tolist() == [height, width]
            assert crop[0] >= 0 and crop[1] >= 0
        assert batch.loss_weights.tolist() == [1.0] * b and batch.is_reg.tolist() == [False] * b
        assert len(batch.captions) == b and batch.flipped.dtype == torch.bool


def test_crop_offsets_are_the_applied_crop_and_mirror_when_flipped(tmp_path):
    # one 128x64 image into a 64x64 bucket: resized 128x64, crop left 32 (centre); flipping keeps it at 32
    make_png(tmp_path / "t" / "8_x" / "wide.png", 128, 64)
    args = parse(["--train_data_dir", str(tmp_path / "t"), "--resolution", "64", "--flip_aug", "--random_crop"])
    plan = build_datasets(args, size_multiple=32, seed=0)
    seen = set()
    src = torch.from_numpy(np.array(Image.open(tmp_path / "t" / "8_x" / "wide.png"))).float()
    src = src.permute(2, 0, 1) / 127.5 - 1
    for batch in make_loader(plan).epoch(0):
        top, left = batch.crop_top_lefts[0].tolist()
        assert top == 0
        crop = src[:, :, left : left + 64] if not batch.flipped[0] else src.flip(-1)[:, :, left : left + 64]
        assert torch.allclose(batch.pixels[0], crop, atol=1e-5)  # offset is in the (flipped) resized image
        seen.add((left, bool(batch.flipped[0])))
    assert len(seen) > 2  # random crops and flips happen


def test_resume_skip_and_workers_give_identical_batches(dataset):
    args = parse(
        small_args(
            dataset, "--train_batch_size", "2", "--shuffle_caption", "--flip_aug", "--color_aug", "--random_crop"
        )
    )
    plan = build_datasets(args, size_multiple=32, seed=11)
    full = list(make_loader(plan).epoch(1))
    resumed = list(make_loader(plan).epoch(1, skip=3))
    workers = list(make_loader(plan, num_workers=2).epoch(1))
    assert len(resumed) == len(full) - 3
    for a, b in zip(full[3:], resumed):
        assert a.image_paths == b.image_paths and a.captions == b.captions and torch.equal(a.pixels, b.pixels)
    for a, b in zip(full, workers, strict=True):
        assert a.image_paths == b.image_paths and a.captions == b.captions and torch.equal(a.pixels, b.pixels)
    other = list(make_loader(plan).epoch(2))
    assert [b.image_paths for b in other] != [b.image_paths for b in full]  # a new order each epoch


def test_sharding_covers_every_batch_evenly(dataset):
    plan = build_datasets(
        parse(small_args(dataset, "--train_batch_size", "1")), size_multiple=32, seed=0, num_processes=3
    )
    ranks = [[tuple(b.image_paths) for b in make_loader(plan, rank=r).epoch(0)] for r in range(3)]
    assert len({len(r) for r in ranks}) == 1
    single = [tuple(b.image_paths) for b in make_loader(plan, world_size=1).epoch(0)]
    merged = [b for step in zip(*ranks) for b in step]
    assert merged[: len(single)] == single  # round-robin over the same global order, padded at the end


def test_multi_resolution_each_sample_draws_one(tmp_path):
    for i in range(4):
        make_png(tmp_path / "t" / "5_x" / f"{i}.png", 128, 128, seed=i)
    args = parse(["--train_data_dir", str(tmp_path / "t"), "--resolution", "32,64,96", "--train_batch_size", "2"])
    plan = build_datasets(args, size_multiple=32, seed=0)
    sizes = collections.Counter()
    loader = make_loader(plan)
    for epoch in range(3):
        n = 0
        for batch in loader.epoch(epoch):
            sizes[tuple(batch.pixels.shape[-2:])] += len(batch)
            n += 1
        assert n == loader.num_batches(epoch)
    assert set(sizes) == {(32, 32), (64, 64), (96, 96)} and sum(sizes.values()) == 3 * 20


def test_bucket_report_lists_images_that_never_fill_a_batch(tmp_path):
    for i in range(4):
        make_png(tmp_path / "t" / "1_x" / f"sq{i}.png", 64, 64, seed=i)
    make_png(tmp_path / "t" / "1_x" / "tall.png", 32, 96)
    report_path = tmp_path / "out" / "buckets.json"
    args = parse(small_args(tmp_path / "t", "--train_batch_size", "3", "--bucket_report", str(report_path)))
    plan = build_datasets(args, size_multiple=32, grad_accum=2, num_processes=1)
    rows = {r.bucket: r for r in plan.report.rows}
    assert (rows["64x64"].images, rows["64x64"].batches, rows["64x64"].last_batch) == (4, 2, 1)
    assert plan.report.never_full == [str(tmp_path / "t" / "1_x" / "tall.png")]
    assert any("never fill a batch" in w for w in plan.report.warnings)
    saved = json.loads(report_path.read_text())
    assert saved["batches_per_epoch"] == 3 and saved["steps_per_epoch"] == 2
    assert "tall.png" in "".join(saved["never_full"])


def test_masks_from_masklabel_files_follow_crop_and_flip(tmp_path):
    img = make_png(tmp_path / "t" / "4_x" / "a.png", 128, 64)
    mask = Image.new("L", (128, 64), 0)
    mask.paste(255, (0, 0, 64, 64))  # left half white
    mask.save(tmp_path / "t" / "4_x" / "a-masklabel.png")
    args = parse(
        ["--train_data_dir", str(tmp_path / "t"), "--resolution", "64", "--masked_loss", "--flip_aug", "--random_crop"]
    )
    plan = build_datasets(args, size_multiple=32, seed=5)
    assert len(plan.datasets[0].records) == 1  # the mask file is not a training image
    for batch in make_loader(plan).epoch(0):
        left = batch.crop_top_lefts[0, 1].item()
        full = torch.zeros(128)
        full[:64] = 1
        if batch.flipped[0]:
            full = full.flip(0)
        assert batch.masks.shape == (1, 1, 64, 64)
        assert torch.allclose(batch.masks[0, 0, 0], full[left : left + 64], atol=0.02)
    assert img


def _jpeg_bytes() -> bytes:
    """A 64 px JPEG of noise (a truncated one decodes its header fine; only decoding every byte finds the cut)."""
    import io

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8")).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize(
    "make, expect",
    [
        (lambda d: (d / "zero.png").write_bytes(b""), "zero.png: empty file"),
        (lambda d: (d / "junk.jpg").write_bytes(b"not an image at all"), "junk.jpg: not a readable image"),
        (
            lambda d: (d / "cut.png").write_bytes(open(make_png(d / "tmp" / "f.png", 64, 64), "rb").read()[:200]),
            "cut.png: not a readable image",
        ),
        (lambda d: (d / "cut.jpg").write_bytes(_jpeg_bytes()[:-200]), "cut.jpg: not a readable image"),  # truncated
    ],
)
def test_corrupt_images_stop_with_the_list_unless_skipped(tmp_path, make, expect):
    folder = tmp_path / "t" / "1_x"
    make_png(folder / "good.png", 64, 64)
    make(folder)
    with pytest.raises(ValueError) as e:
        build_datasets(parse(small_args(tmp_path / "t")), size_multiple=32)
    assert expect in str(e.value) and "--skip_corrupt_images" in str(e.value)
    plan = build_datasets(parse(small_args(tmp_path / "t", "--skip_corrupt_images")), size_multiple=32)
    assert [r.path.rsplit("/", 1)[1] for r in plan.datasets[0].records] == ["good.png"]
    assert any(expect in w for w in plan.warnings)


def test_many_images_are_checked_in_order_on_threads(tmp_path):
    """Enough images for the threaded check: the records keep the folder's order and the truncated one is named."""
    folder = tmp_path / "t" / "1_x"
    for i in range(20):
        make_png(folder / f"{i:02d}.png", 64, 64)
    (folder / "07.png").unlink()
    (folder / "07.jpg").write_bytes(_jpeg_bytes()[:-200])
    with pytest.raises(ValueError, match="07.jpg: not a readable image"):
        build_datasets(parse(small_args(tmp_path / "t")), size_multiple=32)
    plan = build_datasets(parse(small_args(tmp_path / "t", "--skip_corrupt_images")), size_multiple=32)
    names = [r.path.rsplit("/", 1)[1] for r in plan.datasets[0].records]
    assert names == [f"{i:02d}.png" for i in range(20) if i != 7]


def test_unsupported_type_too_small_and_empty(tmp_path):
    folder = tmp_path / "t" / "1_x"
    make_png(folder / "ok.png", 64, 64)
    Image.new("RGB", (64, 64)).save(folder / "anim.gif")
    plan = build_datasets(parse(small_args(tmp_path / "t")), size_multiple=32)
    assert any("anim.gif" in w and "unsupported image types" in w for w in plan.warnings)
    make_png(folder / "tiny.png", 20, 200)
    with pytest.raises(ValueError, match=r"tiny.png: image 20x200 is too small"):
        build_datasets(parse(small_args(tmp_path / "t", "--bucket_no_upscale")), size_multiple=32)
    (tmp_path / "e" / "1_empty").mkdir(parents=True)
    with pytest.raises(ValueError, match="no training images found"):
        build_datasets(parse(small_args(tmp_path / "e")), size_multiple=32)


def test_missing_captions_use_class_tokens_with_a_count(tmp_path):
    make_png(tmp_path / "t" / "2_sks dog" / "a.png", 64, 64)
    make_png(tmp_path / "t" / "2_sks dog" / "b.png", 64, 64)
    (tmp_path / "t" / "2_sks dog" / "a.txt").write_text("a photo")
    plan = build_datasets(parse(small_args(tmp_path / "t")), size_multiple=32)
    assert sorted(r.caption for r in plan.datasets[0].records) == ["a photo", "sks dog"]
    assert any(
        '1 of 2 images have no (or an empty) .txt caption and use class tokens "sks dog"' in w for w in plan.warnings
    )


def test_users_dataset_folder_is_never_modified(dataset, tmp_path):
    before = tree_digest(dataset)
    args = parse(small_args(dataset, "--bucket_report", str(tmp_path / "r.txt"), "--flip_aug"))
    plan = build_datasets(args, size_multiple=32)
    for batch in make_loader(plan, num_workers=1).epoch(0):
        assert len(batch)
    assert tree_digest(dataset) == before


def test_alpha_mask_is_the_cropped_alpha_channel(tmp_path):
    path = make_png(tmp_path / "t" / "2_x" / "a.png", 96, 64, alpha=True)
    alpha = torch.from_numpy(np.array(Image.open(path))[..., 3].astype(np.float32) / 255.0)
    plan = build_datasets(
        parse(["--train_data_dir", str(tmp_path / "t"), "--resolution", "64", "--alpha_mask"]), size_multiple=32
    )
    for batch in make_loader(plan).epoch(0):
        left = batch.crop_top_lefts[0, 1].item()
        assert left == 16
        assert torch.allclose(batch.masks[0, 0], alpha[:, left : left + 64], atol=1e-6)


def test_face_crop_keeps_the_face_in_view(tmp_path):
    # 256x128 image with a 32-px face centred at (200, 64): face_crop_aug_range 2..2 scales the face to 1/2 of 64
    make_png(tmp_path / "t" / "3_x" / "p_200_64_32_32.png", 256, 128)
    args = parse(["--train_data_dir", str(tmp_path / "t"), "--resolution", "64", "--face_crop_aug_range", "2.0,2.0"])
    plan = build_datasets(args, size_multiple=32)
    assert plan.datasets[0].records[0].face == (200, 64, 32, 32)
    for batch in make_loader(plan).epoch(0):
        assert batch.pixels.shape == (1, 3, 64, 64)
        top, left = batch.crop_top_lefts[0].tolist()
        # scale = 64 / (32 * 2) = 1 -> face centre stays at (200, 64); the 64-px crop is centred on it
        assert (left, top) == (200 - 32, 64 - 32)


def test_fine_tune_jsonl_captions_and_color_aug(tmp_path):
    make_png(tmp_path / "img" / "a.png", 64, 64)
    meta = tmp_path / "meta.jsonl"
    meta.write_text(json.dumps({"image_path": "a.png", "caption": "a frog", "tags": "green, cute"}) + "\n")
    (tmp_path / "d.toml").write_text(
        f"[general]\nresolution = 64\ncolor_aug = true\n[[datasets]]\n[[datasets.subsets]]\n"
        f"image_dir = '{tmp_path / 'img'}'\nmetadata_file = '{meta}'\nnum_repeats = 40\n"
    )
    plan = build_datasets(parse(["--dataset_config", str(tmp_path / "d.toml")]), size_multiple=32)
    batches = list(make_loader(plan).epoch(0))
    assert {b.captions[0] for b in batches} == {"a frog, green, cute"}
    plain = torch.from_numpy(np.array(Image.open(tmp_path / "img" / "a.png"))).permute(2, 0, 1).float() / 127.5 - 1
    changed = sum(not torch.allclose(b.pixels[0], plain, atol=1e-6) for b in batches)
    assert 0 < changed < 40  # colour augmentation hits about a third of the samples


def test_regularisation_images_get_prior_loss_weight(tmp_path):
    make_png(tmp_path / "t" / "2_dog" / "a.png", 64, 64)
    for i in range(3):
        make_png(tmp_path / "r" / "1_dog" / f"r{i}.png", 64, 64, seed=i + 1)
    argv = small_args(tmp_path / "t", "--reg_data_dir", str(tmp_path / "r"), "--prior_loss_weight", "0.25")
    plan = build_datasets(parse(argv), size_multiple=32)
    assert len(plan.report.unused) == 1  # 2 training samples -> 2 regularisation images used, 1 never
    weights = {}
    for batch in make_loader(plan).epoch(0):
        for path, w, reg in zip(batch.image_paths, batch.loss_weights.tolist(), batch.is_reg.tolist()):
            weights[path.rsplit("/", 1)[1]] = (w, reg)
    assert weights == {"a.png": (1.0, False), "r0.png": (0.25, True), "r1.png": (0.25, True)}


def test_mask_file_weights_by_its_red_channel(tmp_path):
    """A subset's ``conditioning_data_dir`` mask: the red channel of an RGB file is the per-pixel loss weight (as
    sd-scripts), a greyscale file is used as is, and a mask of another size is resized to the image."""
    from library.data.images import load_mask_source, to_mask

    rgb = np.zeros((4, 4, 3), np.uint8)
    rgb[:2, :, 0] = 255  # red on the top half
    rgb[:, :, 1] = 255  # green everywhere: must not count
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    mask = to_mask(load_mask_source(str(tmp_path / "rgb.png"), Image.new("RGB", (4, 4)), alpha_mask=False))
    assert mask.shape == (1, 4, 4) and mask[0, :2].eq(1).all() and mask[0, 2:].eq(0).all()
    Image.fromarray(np.full((2, 2), 255, np.uint8)).save(tmp_path / "grey.png")
    grey = to_mask(load_mask_source(str(tmp_path / "grey.png"), Image.new("RGB", (8, 6)), alpha_mask=False))
    assert grey.shape == (1, 6, 8) and grey.eq(1).all()


def test_the_validation_split_follows_the_images_not_the_folder_they_lie_in():
    """--validation_split holds out the same images of a dataset wherever its folder lies (a moved copy, another
    machine, pytest's numbered temporary folders), a different set for another seed, never an image twice."""
    from library.data.dataset_plan import split_validation
    from library.data.sources import ImageRecord

    def records(root: str) -> list[ImageRecord]:
        return [ImageRecord(f"{root}/10_sks/{i:02d}.png", (64, 64), "", 0, False, 10) for i in range(20)]

    def held(root: str, seed: int) -> list[str]:
        train, val = split_validation(records(root), 0.25, seed)
        assert len(val) == 5 and len(train) == 15 and not {r.path for r in val} & {r.path for r in train}
        return sorted(r.path.removeprefix(root) for r in val)

    assert held("/data/a", 1) == held("/mnt/copy/b", 1) == held("/tmp/pytest-7/data0", 1)
    assert held("/data/a", 1) != held("/data/a", 2)
