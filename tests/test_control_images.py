"""The edit models' control images (library/data/control_images.py) against kohya-ss/musubi-tuner's own dataset code.

The oracle, tests/data/musubi_control_images.json, is musubi-tuner's ``ImageDirectoryDatasource`` matching, its
``ImageDataset.retrieve_latent_cache_batches`` pixels (shape + SHA-256 of each control image as its caching step
encodes it) and the images its ``qwen_image_cache_text_encoder_outputs.py`` hands Qwen2.5-VL (same), on seeded
images, written by

    PYTHONPATH=~/musubi/src:/work/shared/peer/helpers/sds_shims ~/sdtrain-peer/sdsvenv/bin/python \\
        benchmarks/peer/musubi_control_fixture.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from library.cli.problems import ConfigError
from library.data import build_datasets, cache_latents, cache_text_encoder_outputs, make_loader
from library.data import control_images as CI
from library.families.qwen_image import edit
from tests._data_utils import parse

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks" / "peer"))
import musubi_control_fixture as FIX  # noqa: E402 - the fixture's own image generator (numpy only)

ORACLE = json.loads((Path(__file__).parent / "data" / "musubi_control_images.json").read_text())


def _oracle_dataset(tmp_path_factory, name: str):
    root = tmp_path_factory.mktemp(name)
    os.rmdir(root)
    os.makedirs(root)
    return FIX.write_dataset(str(root))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _oracle_dataset(tmp_path_factory, "controls")


@pytest.fixture(scope="module")
def unedited(tmp_path_factory):
    """The oracle's folders, for tests that need every control image as written (one test edits one in place)."""
    return _oracle_dataset(tmp_path_factory, "unedited")


def _settings(case: str, folder: str) -> CI.ControlSettings:
    raw = ORACLE["settings"][case]
    res = raw.get("control_resolution")
    return CI.ControlSettings(folder, raw.get("no_resize_control", False), tuple(res) if res else None)


def _digest(arr: np.ndarray) -> list:
    return [list(arr.shape), hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()]


def test_matching_as_musubi(folders):
    images, control = folders
    paths = [os.path.join(images, n + ".png") for n in FIX.TARGETS]
    found = {os.path.basename(k): [os.path.basename(p) for p in v] for k, v in CI.match(paths, control).items()}
    assert found == ORACLE["matching"]


@pytest.mark.parametrize("case", list(FIX.SETTINGS))
def test_pixels_as_musubi(folders, case):
    """Each control image at its target's bucket, for each setting: the same uint8 pixels as musubi-tuner's, and
    control_pixels is them in [-1, 1]."""
    images, control = folders
    settings = _settings(case, control)
    matched = CI.match([os.path.join(images, n + ".png") for n in FIX.TARGETS], control)
    for target, want in ORACLE[case].items():
        bucket = tuple(want["bucket"])
        paths = matched[os.path.join(images, target)]
        got = []
        for path in paths:
            img = CI.open_control(path)
            arr = CI.resize_to(img, CI.target_size(img.size, bucket, settings, 16))[..., :3]
            got.append(_digest(arr))
            px = CI.control_pixels(path, bucket, settings, 16)
            torch.testing.assert_close(px, torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 127.5 - 1.0)
        assert got == want["controls"], (case, target)


def _toml(tmp_path, images, control, extra: str = "", general: str = "") -> str:
    path = tmp_path / "dataset.toml"
    path.write_text(f"[general]\nresolution = 64\ncaption_extension = \".txt\"\nbatch_size = 1\n{general}\n"
                    f"[[datasets]]\nimage_directory = \"{images}\"\ncontrol_directory = \"{control}\"\n{extra}")  # fmt: skip
    return str(path)


def _plan(toml: str, takes: bool = True, *flags: str):
    args = dataclasses.replace(parse(["--dataset_config", toml, *flags]), control_images=takes)
    return build_datasets(args, size_multiple=16)


def test_cached_control_latents_in_the_batch(folders, tmp_path):
    """musubi-tuner's TOML with control_directory: every batch carries its target's control images, encoded by the
    caller's encoder at musubi-tuner's pixels (target "a": the same bucket as musubi-tuner's); the entries are
    keyed on the control file's bytes (an edited control image is encoded again, the others are reused)."""
    images, control = folders
    toml = _toml(tmp_path, images, control)
    plan = _plan(toml, True, "--cache_latents_to_disk", "--cache_dir", str(tmp_path / "cache"))
    calls = []

    def encode(pixels):
        calls.append(pixels.shape[0])
        return F.avg_pool2d(pixels, 8)

    cache = cache_latents(plan, encode, "enc", show_progress=False)
    assert sum(calls) == 3 + 6  # three targets, six control images
    batches = list(make_loader(plan, latent_cache=cache).epoch(0))
    assert len(batches) == 3
    seen = set()
    for batch in batches:
        name = os.path.basename(batch.image_paths[0])
        ds, rec = plan.datasets[0], next(r for r in plan.datasets[0].records if r.path == batch.image_paths[0])
        bucket = (batch.target_sizes[0, 1].item(), batch.target_sizes[0, 0].item())
        assert len(batch.controls) == len(ORACLE["default"][name]["controls"])
        for path, got in zip(rec.controls, batch.controls):
            want = F.avg_pool2d(CI.control_pixels(path, bucket, ds.subset(rec).control, 16)[None], 8)
            torch.testing.assert_close(got, want)
        if bucket == tuple(ORACLE["default"][name]["bucket"]):
            seen.add(name)
    assert "a.png" in seen
    # content-keyed: rewrite one control image -> only it is encoded again
    arr = np.asarray(Image.open(os.path.join(control, "bb_2.png"))).copy()
    arr[0, 0] ^= 255
    Image.fromarray(arr).save(os.path.join(control, "bb_2.png"))
    calls.clear()
    plan = _plan(toml, True, "--cache_latents_to_disk", "--cache_dir", str(tmp_path / "cache"))
    cache_latents(plan, encode, "enc", show_progress=False)
    assert calls == [1]
    # without a latent cache the batch carries the control pixels
    batch = next(iter(make_loader(_plan(toml, True)).epoch(0)))
    rec = next(r for r in plan.datasets[0].records if r.path == batch.image_paths[0])
    bucket = (batch.target_sizes[0, 1].item(), batch.target_sizes[0, 0].item())
    for path, got in zip(rec.controls, batch.controls):
        torch.testing.assert_close(got[0], CI.control_pixels(path, bucket, plan.datasets[0].subset(rec).control, 16))


def test_refused_before_training(folders, tmp_path):
    images, control = folders
    with pytest.raises(ConfigError, match="control_directory: the edit models' control images: this model does not"):
        _plan(_toml(tmp_path, images, control), False)
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    Image.new("RGB", (64, 64)).save(lonely / "zz.png")
    (lonely / "zz.txt").write_text("zz")
    with pytest.raises(ConfigError, match=r"zz.png: no control image zz\.\* or zz_<n>\.\* in control_directory"):
        _plan(_toml(tmp_path, lonely, control), True)
    with pytest.raises(ConfigError, match="flip_aug: would change the target image but not its control image"):
        _plan(_toml(tmp_path, images, control), True, "--flip_aug")
    with pytest.raises(ConfigError, match="control_resolution: expected an integer or"):
        _plan(_toml(tmp_path, images, control, 'control_resolution = "big"\n'), True)
    with pytest.raises(ConfigError, match="control_directory: folder .*nowhere.* not found"):
        _plan(_toml(tmp_path, images, tmp_path / "nowhere"), True)


def test_batch_of_mixed_controls_refused():
    a, b = [torch.zeros(3, 8, 8)], [torch.zeros(3, 8, 8), torch.zeros(3, 8, 8)]
    assert [t.shape for t in CI.stack([a, a], ["x", "y"])] == [(2, 3, 8, 8)]
    with pytest.raises(ValueError, match="a batch mixes control images of different counts or sizes \\(x, y\\)"):
        CI.stack([a, b], ["x", "y"])


def _musubi_toml(tmp_path, images, control, case: str, layout: str = "musubi") -> str:
    """The dataset TOML with the oracle's setting ``case`` (buckets on unless it turns them off) in musubi-tuner's
    layout, or in sd-scripts' (a subset; buckets of musubi-tuner's step and range)."""
    raw = {"enable_bucket": True, **ORACLE["settings"][case]}
    keys = "".join(f"{k} = {json.dumps(v)}\n" for k, v in raw.items() if k != "enable_bucket")
    if layout == "musubi":
        return _toml(tmp_path, images, control, f"enable_bucket = {json.dumps(raw['enable_bucket'])}\n" + keys)
    path, bucketed = tmp_path / "dataset.toml", json.dumps(raw["enable_bucket"])
    path.write_text(f"[[datasets]]\nresolution = 64\nbatch_size = 1\nenable_bucket = {bucketed}\n"
                    "bucket_reso_steps = 16\nmin_bucket_reso = 16\nmax_bucket_reso = 128\n\n[[datasets.subsets]]\n"
                    f'image_dir = "{images}"\ncaption_extension = ".txt"\n'
                    f'control_directory = "{control}"\n{keys}')  # fmt: skip
    return str(path)


@pytest.mark.parametrize("layout", ["musubi", "sd-scripts"])
@pytest.mark.parametrize("case", list(FIX.SETTINGS))
def test_prompt_images_as_musubi(unedited, tmp_path, case, layout):
    """An edit model's prompt sees each control image as musubi-tuner's text caching hands it to Qwen2.5-VL: at the
    size the dataset plan trains it at (the setting's dataset TOML: the same buckets as musubi-tuner's), then at the
    384 x 384 area's bucket of that image: the same shapes and uint8 values."""
    images, control = unedited
    ds = _plan(_musubi_toml(tmp_path, images, control, case, layout)).datasets[0]
    for i, rec in enumerate(ds.records):
        want = ORACLE[case][os.path.basename(rec.path)]
        assert list(ds.assignments[0][i].bucket) == want["bucket"]
        assert [_digest(edit.vl_image(p, size)) for p, size in CI.sized(ds, i, 0)] == want["vl"], (case, rec.path)


def test_prompt_cache_keyed_on_control_size(unedited, tmp_path):
    """The edit models' text cache: one entry per caption and control images at the sizes they are trained at, given
    to the encoder with those sizes; each batch reads its own sample's entry; a setting that changes only the
    control images' sizes (control_resolution) gives new keys, so an entry made at another size is not reused."""
    images, control = unedited
    seen = []

    def encode(captions, controls):  # states: the pixel count of the control images it was given
        seen.extend(controls)
        return {"hidden_states": torch.tensor([[float(sum(w * h for _p, (w, h) in c))] for c in controls])}

    keys = {}
    for case in ("default", "control_resolution", "default"):
        plan = _plan(_musubi_toml(tmp_path, images, control, case), True, "--cache_text_encoder_outputs")
        ds = plan.datasets[0]
        cache = cache_text_encoder_outputs(plan, encode, "te", batch_size=1, show_progress=False, with_controls=True)
        sized = [CI.sized(ds, i, 0) for i in range(len(ds.records))]
        assert sorted(seen, key=str) == sorted(sized, key=str) and len(cache.keys) == 3
        seen.clear()
        for batch in make_loader(plan, text_cache=cache).epoch(0):
            i = next(i for i, r in enumerate(ds.records) if r.path == batch.image_paths[0])
            want = sum(w * h for _p, (w, h) in sized[i])
            assert batch.text_encoder_outputs["hidden_states"].flatten().tolist() == [want]
        keys.setdefault(case, set(cache.keys.values()))
        assert set(cache.keys.values()) == keys[case]
    assert not keys["default"] & keys["control_resolution"]


def test_opencv_is_needed_only_by_control_images(folders, tmp_path, monkeypatch):
    """OpenCV is optional: the trainers import without it (README's quick start installs no extras), and a dataset
    with control images is refused before training, naming the install."""
    import subprocess

    code = "import sys; sys.modules['cv2'] = None\nimport train_network, qwen_image_train_network\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
    images, control = folders
    monkeypatch.setitem(sys.modules, "cv2", None)
    with pytest.raises(
        ConfigError, match=r"control_directory: control images are downscaled .* opencv-python-headless"
    ):
        _plan(_toml(tmp_path, images, control), True)
