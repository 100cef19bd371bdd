"""A LoRA run's ss_* metadata against what sd-scripts' train_network.py wrote for the same dataset and flags.

The oracle is ``tests/data/sd_scripts_lora_metadata.json``: the metadata of sd-scripts v0.10.1's own run (peer kit,
its tiny SD1 model) on eight 64 px training images in ``10_sks`` and four regularisation images in ``1_shape``, with
the flags stored beside it. Civitai and the metadata viewers read these keys with sd-scripts' meaning (e.g.
``ss_num_train_images`` counts repeats, regularisation folders keep their configured repeats).
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

import train_network
from library.files.weights import read_metadata

REFERENCE = json.loads((Path(__file__).parent / "data" / "sd_scripts_lora_metadata.json").read_text())

# differ by run or by machine: ids, clocks, the model's name and hashes (sd-scripts hashes a folder as "IsADirectory")
VOLATILE = {"ss_session_id", "ss_training_started_at", "ss_training_finished_at", "ss_sd_model_name",
            "ss_sd_model_hash", "ss_new_sd_model_hash", "ss_sd_scripts_commit_hash"}  # fmt: skip
# ours writes no key where sd-scripts writes the string "None" or "null" (the same meaning to every reader), and
# three keys of features sd-scripts has no counterpart for
OURS_ONLY = {"ss_ema", "ss_masked_loss", "ss_timestep_sampling"}


def write_dataset(root: Path, folders: dict[str, list[str]], size: int) -> Path:
    for folder, captions in folders.items():
        (root / folder).mkdir(parents=True)
        for i, caption in enumerate(captions):
            Image.new("RGB", (size, size), (40 * i % 256, 90, 160)).save(root / folder / f"img{i:02d}.png")
            (root / folder / f"img{i:02d}.txt").write_text(caption)
    return root


def test_lora_metadata_means_what_sd_scripts_writes(tiny_dir, tmp_path):
    data = REFERENCE["dataset"]
    train = write_dataset(tmp_path / "train", data["train_data_dir"], data["size"])
    reg = write_dataset(tmp_path / "reg", data["reg_data_dir"], data["size"])
    result = train_network.run(["--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--train_data_dir", str(train),
                                "--reg_data_dir", str(reg), "--output_dir", str(tmp_path / "out"), *REFERENCE["flags"]])  # fmt: skip
    ours = {k: v for k, v in read_metadata(result.output).items() if k.startswith("ss_")}
    theirs = REFERENCE["metadata"]
    assert (ours["ss_num_train_images"], ours["ss_num_reg_images"]) == ("80", "4")  # images x repeats, as listed
    differ = {}
    for key in (set(ours) | set(theirs)) - VOLATILE - OURS_ONLY:
        mine, ref = ours.get(key), theirs.get(key)
        if ref in ("None", "null") and mine is None:
            continue
        if key in ("ss_dataset_dirs", "ss_reg_dataset_dirs", "ss_tag_frequency"):
            mine, ref = json.loads(mine or "null"), json.loads(ref)
        if mine != ref:
            differ[key] = (mine, ref)
    assert not differ, differ
