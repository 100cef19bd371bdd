"""Writes tests/data/musubi_control_images.json: kohya-ss/musubi-tuner's own control-image path on a tiny dataset, the
oracle of tests/test_control_images.py (CI has no musubi-tuner). Run in musubi-tuner's venv:

    cd /work/wt-edit && PYTHONPATH=~/musubi/src:/work/shared/peer/helpers/sds_shims \\
        ~/sdtrain-peer/sdsvenv/bin/python benchmarks/peer/musubi_control_fixture.py

The images are seeded noise . For each setting
(default: resize to the target's bucket; control_resolution; no_resize_control; both) musubi-tuner's ``ImageDataset``
(architecture Qwen-Image-Edit, resolution 64, buckets on) runs ``retrieve_latent_cache_batches`` and the fixture keeps
each target's bucket and, for its control images' pixels (uint8 (h, w, 3), alpha dropped as its caching step does),
the shape and SHA-256. The control files' matching (``ImageDirectoryDatasource``) is stored too. The test makes the
same images from the same seeds (numpy's PCG64 stream is the same in both venvs).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import types

import numpy as np
from PIL import Image

# name -> (width, height, mode); targets in images/, controls in control/
TARGETS = {"a": (64, 64, "RGB"), "bb": (80, 48, "RGB"), "bb_1": (50, 70, "RGB")}
CONTROLS = {"a.png": (37, 23, "RGB"), "a_0.png": (90, 120, "RGBA"), "bb_0.png": (64, 64, "L"),
            "bb_2.png": (41, 77, "RGB"), "bb_10.png": (100, 30, "RGB"), "bb_1.png": (64, 48, "RGB")}  # fmt: skip
SETTINGS = {"default": {}, "control_resolution": {"control_resolution": (96, 96)},
            "no_resize": {"no_resize_control": True},
            "no_resize_max": {"no_resize_control": True, "control_resolution": (64, 64)}}  # fmt: skip


def pixels(name: str, width: int, height: int, mode: str) -> np.ndarray:
    rng = np.random.default_rng(sum(map(ord, name)))
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return arr[..., 0] if mode == "L" else arr


def write_dataset(root: str) -> tuple[str, str]:
    images, control = os.path.join(root, "images"), os.path.join(root, "control")
    os.makedirs(images)
    os.makedirs(control)
    for name, (w, h, mode) in TARGETS.items():
        arr = pixels(name, w, h, mode)
        Image.fromarray(arr, mode).save(os.path.join(images, name + ".png"))
        with open(os.path.join(images, name + ".txt"), "w") as f:
            f.write(name)
    for name, (w, h, mode) in CONTROLS.items():
        arr = pixels(name, w, h, mode)
        Image.fromarray(arr, mode).save(os.path.join(control, name))
    return images, control


def main() -> None:
    sys.modules.setdefault("av", types.ModuleType("av"))  # PyAV reads videos only; not installed beside it here
    from musubi_tuner.dataset.datasources import ImageDirectoryDatasource
    from musubi_tuner.dataset.image_video_dataset import ImageDataset

    store: dict = {}
    with tempfile.TemporaryDirectory() as root:
        images, control = write_dataset(root)
        source = ImageDirectoryDatasource(images, ".txt", control)
        matched = {os.path.basename(k): [os.path.basename(p) for p in v] for k, v in source.control_paths.items()}
        store["matching"] = matched
        for case, extra in SETTINGS.items():
            ds = ImageDataset((64, 64), ".txt", 1, 1, True, False, image_directory=images, control_directory=control,
                              architecture="qie", **extra)  # fmt: skip
            for _key, batch in ds.retrieve_latent_cache_batches(1):
                for item in batch:
                    name = os.path.basename(item.item_key)
                    controls = [np.ascontiguousarray(c[..., :3]) for c in item.control_content]
                    store.setdefault(case, {})[name] = {
                        "bucket": list(item.bucket_size[:2]),
                        "controls": [[list(c.shape), hashlib.sha256(c.tobytes()).hexdigest()] for c in controls],
                    }
    out = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "musubi_control_images.json")
    with open(out, "w") as f:
        json.dump({"targets": TARGETS, "controls": CONTROLS, "settings": SETTINGS, **store}, f, indent=1)
    print(f"wrote {os.path.abspath(out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
