"""The Qwen-Image edit models' prompt embeddings with control images beside kohya-ss/musubi-tuner's own function (by
hand; CI has no musubi-tuner):

    cd /work/wt-edit && PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python \\
        benchmarks/qwen_image_edit_prompt_vs_musubi.py

Our side (this venv) builds the tiny Qwen2.5-VL with its vision tower (seeded), writes its weights and config, and
encodes two captions with one and two control images (``qwen25vl_edit.encode_with_images``) for edit and edit-2509.
musubi-tuner's side (``--musubi_python``, default ~/sdtrain-peer/sdsvenv; ``PYTHONPATH`` ~/musubi/src + the shims)
loads the same weights into its transformers' ``Qwen2_5_VLForConditionalGeneration``, builds transformers' own
``Qwen2VLProcessor`` (image processor with Qwen2.5-VL's settings, our shipped tokenizer folder) and runs
``qwen_image_utils.get_qwen_prompt_embeds_with_image`` on the same images. Prints the max |difference| per version.
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
    del torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("both", "musubi"), default="both")
    p.add_argument("--out", default=None)
    p.add_argument("--musubi_python", default=os.path.expanduser("~/sdtrain-peer/sdsvenv/bin/python"))
    a = p.parse_args()
    if a.side == "musubi":
        musubi(Path(a.out))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
