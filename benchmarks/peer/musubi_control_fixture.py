"""Writes tests/data/musubi_control_images.json: kohya-ss/musubi-tuner's own control-image path on a tiny dataset, the
oracle of tests/test_control_images.py (CI has no musubi-tuner). Run in musubi-tuner's venv:

    cd /work/wt-edit && PYTHONPATH=~/musubi/src:/work/shared/peer/helpers/sds_shims \\
        ~/sdtrain-peer/sdsvenv/bin/python benchmarks/peer/musubi_control_fixture.py

The images are seeded noise. For each setting
(default: resize to the target's bucket; control_resolution; no_resize_control; both; buckets off) musubi-tuner's
``ImageDataset`` (architecture Qwen-Image-Edit, resolution 64, buckets on unless the setting turns them off) runs
``retrieve_latent_cache_batches`` and the fixture keeps each target's bucket and, for its control images' pixels
(uint8 (h, w, 3), alpha dropped as its caching step does), the shape and SHA-256. The same batches then go through
``qwen_image_cache_text_encoder_outputs.encode_and_save_batch`` with its prompt encoder replaced by a recorder: the
shape and SHA-256 of each image it hands Qwen2.5-VL (``vl``). The control files' matching (``ImageDirectoryDatasource``)
is stored too. The test makes the same images from the same seeds (numpy's PCG64 stream is the same in both venvs).
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
            "no_resize_max": {"no_resize_control": True, "control_resolution": (64, 64)},
            "no_bucket": {"enable_bucket": False}}  # fmt: skip


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


def _digest(arr: np.ndarray) -> list:
    return [list(arr.shape), hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()]


def _ignore(*_args) -> None:
    return None


def vl_images(batch: list) -> list[list[np.ndarray]]:
    """The images musubi-tuner's text caching gives Qwen2.5-VL for ``batch`` (its prompt encoder recording them)."""
    import torch
    from musubi_tuner import qwen_image_cache_text_encoder_outputs as M

    seen = []

    def record(_processor, _encoder, prompts, images, model_version=None):
        seen.extend(images)
        return torch.zeros(len(prompts), 1, 1), torch.ones(len(prompts), 1)

    encode, save = M.qwen_image_utils.get_qwen_prompt_embeds_with_image, M.save_text_encoder_output_cache_qwen_image
    M.qwen_image_utils.get_qwen_prompt_embeds_with_image, M.save_text_encoder_output_cache_qwen_image = record, _ignore
    try:
        M.encode_and_save_batch(None, None, object(), "edit-2509", batch, torch.device("cpu"), None)
    finally:
        M.qwen_image_utils.get_qwen_prompt_embeds_with_image, M.save_text_encoder_output_cache_qwen_image = encode, save
    return seen


def main() -> None:
    import importlib.machinery

    av = types.ModuleType("av")  # PyAV reads videos only; not installed beside it here
    av.__spec__ = importlib.machinery.ModuleSpec("av", None)
    sys.modules.setdefault("av", av)
    from musubi_tuner.dataset.datasources import ImageDirectoryDatasource
    from musubi_tuner.dataset.image_video_dataset import ImageDataset

    store: dict = {}
    with tempfile.TemporaryDirectory() as root:
        images, control = write_dataset(root)
        source = ImageDirectoryDatasource(images, ".txt", control)
        matched = {os.path.basename(k): [os.path.basename(p) for p in v] for k, v in source.control_paths.items()}
        store["matching"] = matched
        for case, extra in SETTINGS.items():
            extra = dict(extra)
            bucketed = extra.pop("enable_bucket", True)
            ds = ImageDataset((64, 64), ".txt", 1, 1, bucketed, False, image_directory=images,
                              control_directory=control, architecture="qie", **extra)  # fmt: skip
            for _key, batch in ds.retrieve_latent_cache_batches(1):
                for item, shown in zip(batch, vl_images(batch)):
                    name = os.path.basename(item.item_key)
                    controls = [np.ascontiguousarray(c[..., :3]) for c in item.control_content]
                    store.setdefault(case, {})[name] = {
                        "bucket": list(item.bucket_size[:2]),
                        "controls": [_digest(c) for c in controls],
                        "vl": [_digest(np.asarray(im)) for im in shown],
                    }
    out = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "musubi_control_images.json")
    with open(out, "w") as f:
        json.dump({"targets": TARGETS, "controls": CONTROLS, "settings": SETTINGS, **store}, f, indent=1)
    print(f"wrote {os.path.abspath(out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
