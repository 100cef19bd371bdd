"""The Qwen-Image edit models' prompt embeddings with control images beside kohya-ss/musubi-tuner's own function (by
hand; CI has no musubi-tuner):

    cd /work/wt-editctl && PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python \\
        benchmarks/qwen_image_edit_prompt_vs_musubi.py

Our side (this venv) builds the tiny Qwen2.5-VL with its vision tower (seeded), writes its weights and config, and
encodes two captions with one and two control images (``qwen25vl_edit.encode_with_images``) for edit and edit-2509.
musubi-tuner's side (``--musubi_python``, default ~/sdtrain-peer/sdsvenv; ``PYTHONPATH`` ~/musubi/src + the shims)
loads the same weights into its transformers' ``Qwen2_5_VLForConditionalGeneration``, builds transformers' own
``Qwen2VLProcessor`` (image processor with Qwen2.5-VL's settings, our shipped tokenizer folder) and runs
``qwen_image_utils.get_qwen_prompt_embeds_with_image`` on the same images. Prints the max |difference| per version.

Then the whole text-caching path on a dataset (musubi-tuner's TOML, buckets on, resolution 64; ``--target`` and
``--control`` sizes, default 64x64 targets beside 80x48 control images, two for the second target): ours
(``cache_steps.write_text``, as ``qwen_image_cache_text_encoder_outputs.py`` runs it; ``--control_keys``: e.g.
control_resolution, no_resize_control) and musubi-tuner's
(``ImageDataset.retrieve_latent_cache_batches`` into ``qwen_image_cache_text_encoder_outputs.encode_and_save_batch``,
its cache writer replaced by a recorder). Prints, per target and version, both sides' prompt rows and the max
|difference| of the states.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CAPTIONS = ["a red cube on a table", "make it blue"]
VERSIONS = ("edit", "edit-2509")


def images():
    import numpy as np

    rng = np.random.default_rng(0)
    return [[rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)],
            [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8), rng.integers(0, 256, (28, 84, 3), dtype=np.uint8)]]  # fmt: skip


def write_dataset(root: Path, target: tuple[int, int], control: tuple[int, int], keys: dict) -> Path:
    """Two targets of size ``target`` with control images of size ``control`` (two for the second); the TOML, its
    dataset with the control ``keys`` (also in keys.json for musubi-tuner's side)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    (root / "images").mkdir()
    (root / "control").mkdir()
    for name, controls in (("t0", ["t0"]), ("t1", ["t1", "t1_1"])):
        Image.fromarray(rng.integers(0, 256, (target[1], target[0], 3), dtype=np.uint8)).save(
            root / "images" / f"{name}.png"
        )
        (root / "images" / f"{name}.txt").write_text(f"edit {name}")
        for c in controls:
            Image.fromarray(rng.integers(0, 256, (control[1], control[0], 3), dtype=np.uint8)).save(
                root / "control" / f"{c}.png"
            )
    toml = root / "dataset.toml"
    toml.write_text(f"""[general]\nresolution = 64\ncaption_extension = ".txt"\nbatch_size = 1\nenable_bucket = true\n
[[datasets]]\nimage_directory = "{(root / "images").as_posix()}"\ncontrol_directory = "{(root / "control").as_posix()}"\n"""
                    + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))  # fmt: skip
    (root / "keys.json").write_text(json.dumps(keys))
    return toml


def ours_dataset(model, out: Path) -> dict:
    """Our text cache of the dataset, per version: {version/target: (rows, states)}."""
    from library.families.base import Parts
    from library.families.encoders import qwen25vl
    from library.families.qwen_image import QWEN_IMAGE
    from library.families.qwen_image.options import QwenImageOptions
    from library.run import cache_steps

    plan = cache_steps.dataset_plan(str(out / "data" / "dataset.toml"), QWEN_IMAGE, control_images=True,
                                    cache_dir=str(out / "ours_cache"))  # fmt: skip
    result = {}
    for v in VERSIONS:
        options = QwenImageOptions(text_encoder="tiny", model_version=v)
        parts = Parts(None, None, [model], [qwen25vl.load_tokenizer(None)], {}, QWEN_IMAGE.name, options=options)
        cache = cache_steps.write_text(plan, QWEN_IMAGE, parts, "cpu", 1)
        for slot, key in cache.keys.items():
            first = slot[1][0]  # a control image: its path (or (path, size))
            target = Path(first if isinstance(first, str) else first[0]).stem.split("_")[0]
            entry = cache.store.load(key, cache.anchors[slot])
            rows = int(entry["mask"].sum())
            result[f"{v}/{target}"] = entry["hidden_states"][:rows].float().contiguous()
    return result


def musubi_dataset(model, proc, out: Path) -> dict:
    """musubi-tuner's text caching of the dataset (module docstring), per version: {version/target: states}."""
    import torch
    from musubi_tuner import qwen_image_cache_text_encoder_outputs as M
    from musubi_tuner.dataset.image_video_dataset import ImageDataset

    root = out / "data"
    keys = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads((root / "keys.json").read_text()).items()}
    result, version = {}, [None]

    def record(item, embed):
        result[f"{version[0]}/{Path(item.item_key).stem}"] = embed.float().contiguous()

    M.save_text_encoder_output_cache_qwen_image = record
    for v in VERSIONS:
        version[0] = v
        ds = ImageDataset((64, 64), ".txt", 1, 1, True, False, image_directory=str(root / "images"),
                          control_directory=str(root / "control"), architecture="qie", **keys)  # fmt: skip
        for _key, batch in ds.retrieve_latent_cache_batches(1):
            with torch.no_grad():
                M.encode_and_save_batch(proc.tokenizer, model, proc, v, batch, torch.device("cpu"), None)
    return result


def ours(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from library.families.encoders import qwen25vl
    from library.families.encoders import qwen25vl_edit as E

    model = E.randomize(E.build(qwen25vl.TINY_TEXT, E.TINY_VISION).eval(), 0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "vl.safetensors"))
    (out / "config.json").write_text(json.dumps({"text": qwen25vl.TINY_TEXT, "vision": E.TINY_VISION,
                                                 "processor": E.PROCESSOR,
                                                 "tokenizer": str(qwen25vl._bundled_folder())}))  # fmt: skip
    proc = E.processor()
    result = {}
    with torch.no_grad():
        for v in VERSIONS:
            states, mask = E.encode_with_images(model, proc, CAPTIONS, images(), v)
            result[f"{v}/states"], result[f"{v}/mask"] = states, mask
    save_file(result, str(out / "ours.safetensors"))
    save_file(ours_dataset(model, out), str(out / "ours_dataset.safetensors"))


def musubi(out: Path) -> None:
    import types

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2TokenizerFast, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    sys.modules.setdefault("av", types.ModuleType("av"))  # PyAV reads videos only; not installed beside it here

    from musubi_tuner.qwen_image import qwen_image_utils as U

    cfg = json.loads((out / "config.json").read_text())
    text = {k: v for k, v in cfg["text"].items()}
    config = Qwen2_5_VLConfig(**text, vision_config=cfg["vision"], image_token_id=151655, vision_start_token_id=151652,
                              vision_end_token_id=151653)  # fmt: skip
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    missing, unexpected = model.load_state_dict(load_file(str(out / "vl.safetensors")), strict=False)
    print("musubi side: missing", missing, "unexpected", unexpected, file=sys.stderr)
    tok = Qwen2TokenizerFast(
        tokenizer_file=os.path.join(cfg["tokenizer"], "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )  # the shipped file (its config is transformers 5's)
    proc = object.__new__(Qwen2VLProcessor)  # its video processor needs torchvision: the image path's attributes only
    proc.image_processor, proc.tokenizer, proc.chat_template = Qwen2VLImageProcessor(**cfg["processor"]), tok, None
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id, proc.video_token_id = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    result = {}
    for v in VERSIONS:
        states, mask = U.get_qwen_prompt_embeds_with_image(proc, model, CAPTIONS, images(), model_version=v)
        result[f"{v}/states"], result[f"{v}/mask"] = states.float().contiguous(), mask.contiguous()
    save_file(result, str(out / "musubi.safetensors"))
    save_file(musubi_dataset(model, proc, out), str(out / "musubi_dataset.safetensors"))
    del torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("both", "musubi"), default="both")
    p.add_argument("--out", default=None)
    p.add_argument("--musubi_python", default=os.path.expanduser("~/sdtrain-peer/sdsvenv/bin/python"))
    p.add_argument("--target", type=int, nargs=2, default=(64, 64), metavar=("W", "H"))
    p.add_argument("--control", type=int, nargs=2, default=(80, 48), metavar=("W", "H"))
    p.add_argument(
        "--control_keys", default="{}", help="the dataset's control keys as JSON, e.g. '{\"no_resize_control\": true}'"
    )
    a = p.parse_args()
    if a.side == "musubi":
        musubi(Path(a.out))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "data").mkdir()
        write_dataset(out / "data", tuple(a.target), tuple(a.control), json.loads(a.control_keys))
        ours(out)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.expanduser("~/musubi/src"),
                                                            "/work/shared/peer/helpers/sds_shims"]))  # fmt: skip
        subprocess.run([a.musubi_python, __file__, "--side", "musubi", "--out", str(out)], check=True, env=env)
        from safetensors.torch import load_file

        x, y = load_file(str(out / "ours.safetensors")), load_file(str(out / "musubi.safetensors"))
        for v in VERSIONS:
            same_mask = x[f"{v}/mask"].shape == y[f"{v}/mask"].shape and bool((x[f"{v}/mask"] == y[f"{v}/mask"]).all())
            diff = (x[f"{v}/states"] - y[f"{v}/states"]).abs().max().item() if same_mask else float("nan")
            print(f"{v}: masks equal {same_mask}, states max |diff| {diff:.3g}, shape {tuple(x[f'{v}/states'].shape)}")
        x, y = load_file(str(out / "ours_dataset.safetensors")), load_file(str(out / "musubi_dataset.safetensors"))
        print(
            f"dataset: targets {a.target[0]}x{a.target[1]}, control images {a.control[0]}x{a.control[1]} {a.control_keys}"
        )
        for name in sorted(y):
            got, want = x.get(name), y[name]
            rows = "missing" if got is None else str(got.shape[0])
            same = got is not None and got.shape == want.shape
            diff = f"{(got - want).abs().max().item():.3g}" if same else "n/a (rows differ)"
            print(f"  {name}: musubi-tuner {want.shape[0]} rows, ours {rows}, states max |diff| {diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
