"""The Qwen-Image edit models' control images as Qwen2.5-VL and the VAE get them, beside kohya-ss/musubi-tuner's own
functions (by hand; CI has no musubi-tuner):

    cd /work/wt-qedit && PYTHONPATH=$PWD /work/main/.venv/bin/python \\
        benchmarks/peer/qwen_edit_control_images_vs_musubi.py

Writes control images of several sizes (RGB and RGBA, smaller and larger than the areas), then runs musubi-tuner's
side in its venv (``--musubi_python``, default ~/sdtrain-peer/sdsvenv; ``PYTHONPATH`` ~/musubi/src + the shims):
what ``qwen_image_cache_text_encoder_outputs.py`` gives the VL model (``calculate_bucket_resolution`` of the 384 x 384
area, ``resize_image_to_bucket``, alpha dropped) and what ``qwen_image_generate_image.py`` makes of
``--control_image_path`` (``preprocess_control_image``, with and without ``--resize_control_to_official_size``).
Prints, per image, the max |difference| of ours (``qwen_image/edit.py``: ``vl_image`` of a control image trained at
its own size, ``generation_controls``). The dataset's resize before it: tests/test_control_images.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = [(300, 500), (1024, 768), (97, 131), (2000, 1500), (384, 384), (50, 700)]  # (height, width)


def musubi_side(paths: list[str]) -> None:
    import importlib.machinery
    import types

    av = types.ModuleType("av")  # PyAV reads videos only; not installed beside it here
    av.__spec__ = importlib.machinery.ModuleSpec("av", None)
    sys.modules.setdefault("av", av)
    import numpy as np
    from musubi_tuner.dataset.bucket import BucketSelector
    from musubi_tuner.dataset.media_utils import resize_image_to_bucket
    from musubi_tuner.qwen_image import qwen_image_utils as Q
    from PIL import Image

    for path in paths:
        img = Image.open(path)
        cc = np.array(img.convert("RGBA") if img.mode == "RGBA" else img.convert("RGB"))
        size = BucketSelector.calculate_bucket_resolution((cc.shape[1], cc.shape[0]), Q.CONDITION_IMAGE_RESOLUTION,
                                                          architecture="qie")  # fmt: skip
        np.save(path + ".train.npy", resize_image_to_bucket(cc[..., :3], size))
        for official in (0, 1):
            tensor, shown, _ = Q.preprocess_control_image(path, bool(official), None)
            np.save(path + f".vl{official}.npy", shown[..., :3])
            np.save(path + f".px{official}.npy", tensor[:, :3].numpy())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--musubi_python", default=os.path.expanduser("~/sdtrain-peer/sdsvenv/bin/python"))
    parser.add_argument("--musubi_side", nargs="*", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.musubi_side is not None:
        return musubi_side(args.musubi_side)
    import numpy as np
    import torch
    from PIL import Image

    from library.families.qwen_image import edit

    folder = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(SIZES):
        mode = "RGBA" if i % 2 else "RGB"
        paths.append(str(folder / f"c{i}.png"))
        Image.fromarray(rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8), mode).save(paths[-1])
    env = dict(os.environ, PYTHONPATH=f"{os.path.expanduser('~/musubi/src')}:/work/shared/peer/helpers/sds_shims")
    subprocess.run([args.musubi_python, __file__, "--musubi_side", *paths], check=True, env=env)

    def diff(a, b) -> str:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        return f"{np.abs(a - b).max():g}" if a.shape == b.shape else f"shapes {a.shape} / {b.shape}"

    for path, (h, w) in zip(paths, SIZES):
        line = [
            f"{Path(path).name} {w}x{h}",
            f"training VL {diff(np.load(path + '.train.npy'), edit.vl_image(path, (w, h)))}",
        ]
        for official in (0, 1):
            pixels, shown = edit.generation_controls([path], bool(official), None)
            line.append(f"generate(official={official}) VL {diff(np.load(path + f'.vl{official}.npy'), shown[0])} "
                        f"VAE {diff(np.load(path + f'.px{official}.npy'), pixels[0].to(torch.float32))}")  # fmt: skip
        print(" | ".join(line))


if __name__ == "__main__":
    main()
