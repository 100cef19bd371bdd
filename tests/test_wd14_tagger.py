"""finetune/tag_images_by_wd14_tagger.py on a tiny ONNX tagger built here with the WD14 input/output layout:
``(N, S, S, 3)`` BGR 0..255 in, one sigmoid score per row of selected_tags.csv out. Each plain-colour image is a
one-hot BGR mean, so the model gives exactly the probabilities of ``PROBS``; the expected tags are derived from that
table with sd-scripts' rule (score >= threshold, label order), and each flag is checked by what it changes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from finetune import tag_images_by_wd14_tagger as tagger
from library.data import wd14_tags

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

TAGS = [  # (name, category): 4 ratings, 4 general, 2 character tags, as in a WD14 selected_tags.csv
    ("general", "9"), ("sensitive", "9"), ("questionable", "9"), ("explicit", "9"),
    ("long_hair", "0"), ("red_eyes", "0"), ("^_^", "0"), ("smile", "0"),
    ("hatsune_miku_(vocaloid)", "4"), ("chara_(costume)_(series)", "4"),
]  # fmt: skip
PROBS = {  # the model's output for a plain image of each colour
    "red": [0.1, 0.7, 0.1, 0.1, 0.9, 0.5, 0.2, 0.36, 0.8, 0.1],
    "green": [0.6, 0.2, 0.1, 0.1, 0.3, 0.34, 0.95, 0.7, 0.2, 0.5],
    "blue": [0.1, 0.1, 0.2, 0.6, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1],
}
RGB = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}
SIZE = 16


def _make_tagger(folder, batch: int | str = "N"):
    """mean over H, W of the BGR pixels / 255 -> MatMul W -> Sigmoid, with W[channel] = logit(PROBS[colour])."""
    from onnx import TensorProto, helper, numpy_helper

    weight = np.zeros((3, len(TAGS)), np.float32)
    for colour, probs in PROBS.items():
        channel = 2 - list(RGB).index(colour)  # BGR order
        p = np.asarray(probs, np.float64)
        weight[channel] = np.log(p / (1 - p)) / 255.0
    nodes = [
        helper.make_node("ReduceMean", ["input_1", "axes"], ["mean"], keepdims=0),
        helper.make_node("MatMul", ["mean", "weight"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["predictions_sigmoid"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_wd14",
        [helper.make_tensor_value_info("input_1", TensorProto.FLOAT, [batch, SIZE, SIZE, 3])],
        [helper.make_tensor_value_info("predictions_sigmoid", TensorProto.FLOAT, [batch, len(TAGS)])],
        [numpy_helper.from_array(np.array([1, 2], np.int64), "axes"), numpy_helper.from_array(weight, "weight")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    rows = ["tag_id,name,category,count"] + [f"{i},{n},{c},100" for i, (n, c) in enumerate(TAGS)]
    (folder / "selected_tags.csv").write_text("\n".join(rows) + "\n")
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wd14")
    _make_tagger(root / "SmilingWolf_wd-v1-4-convnext-tagger-v2")
    return root


@pytest.fixture()
def images(tmp_path):
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for colour, rgb in RGB.items():
        Image.new("RGB", (2 * SIZE, 2 * SIZE), rgb).save(folder / f"{colour}.png")
    Image.new("RGB", (SIZE, SIZE), RGB["red"]).save(folder / "sub" / "small_red.png")
    return folder


def expected(colour, general=0.35, character=0.35):
    """sd-scripts' rule: general then character tags at or above their thresholds, in label order."""
    probs = PROBS[colour]
    return [n for (n, c), p in zip(TAGS, probs) if (c == "0" and p >= general) or (c == "4" and p >= character)]


def tag(images, model_dir, *flags):
    written = tagger.run([str(images), "--model_dir", str(model_dir), "--onnx", *flags])
    return {c: (images / f"{c}.txt").read_text().rstrip("\n") for c in RGB if (images / f"{c}.txt").exists()}, written


def test_default_tags_are_the_scores_above_the_threshold(images, model_dir):
    tags, written = tag(images, model_dir, "--batch_size", "2")
    assert tags == {c: ", ".join(expected(c)) for c in RGB}
    assert tags["red"] == "long_hair, red_eyes, smile, hatsune_miku_(vocaloid)" and tags["blue"] == ""
    assert sorted(written) == sorted(str(images / f"{c}.txt") for c in RGB)  # not recursive
    assert not (images / "sub" / "small_red.txt").exists()


def test_thresholds_choose_which_tags(images, model_dir):
    tags, _ = tag(images, model_dir, "--general_threshold", "0.6", "--character_threshold", "0.15")
    assert tags == {c: ", ".join(expected(c, 0.6, 0.15)) for c in RGB}
    tags, _ = tag(images, model_dir, "--thresh", "0.5")
    assert tags == {c: ", ".join(expected(c, 0.5, 0.5)) for c in RGB}
    tags, _ = tag(images, model_dir, "--character_threshold", "1.1")  # above 1: no character tags
    assert "hatsune_miku_(vocaloid)" not in tags["red"] and "long_hair" in tags["red"]


def test_name_edits(images, model_dir):
    tags, _ = tag(images, model_dir, "--remove_underscore", "--character_threshold", "0.15")
    assert tags["red"] == "long hair, red eyes, smile, hatsune miku (vocaloid)"
    assert tags["green"].startswith("^_^, smile")  # 3 characters or fewer keep their underscore
    tags, _ = tag(images, model_dir, "--character_tag_expand", "--character_threshold", "0.15")
    assert tags["green"] == "^_^, smile, hatsune_miku, vocaloid, chara_(costume), series"
    tags, _ = tag(images, model_dir, "--tag_replacement", "long_hair,very long hair;smile,grin\\, wide")
    assert tags["red"] == "very long hair, red_eyes, grin, wide, hatsune_miku_(vocaloid)"
    tags, _ = tag(images, model_dir, "--undesired_tags", "smile, red_eyes")
    assert tags["red"] == "long_hair, hatsune_miku_(vocaloid)"


def test_order_flags(images, model_dir):
    assert tag(images, model_dir, "--use_rating_tags")[0]["red"].split(", ")[0] == "sensitive"
    assert tag(images, model_dir, "--use_rating_tags_as_last_tag")[0]["blue"] == "explicit"
    assert tag(images, model_dir, "--character_tags_first")[0]["red"].startswith("hatsune_miku_(vocaloid), long_hair")
    assert tag(images, model_dir, "--always_first_tags", "smile")[0]["red"].startswith("smile, long_hair")
    tags, _ = tag(images, model_dir, "--caption_separator", "; ", "--caption_extension", ".txt")
    assert tags["red"] == "; ".join(expected("red"))
    (images / "red.txt").write_text("mine, long_hair\n")
    assert (
        tag(images, model_dir, "--append_tags")[0]["red"] == "mine, long_hair, red_eyes, smile, hatsune_miku_(vocaloid)"
    )


def test_outputs_recursive_and_frequencies(images, model_dir, tmp_path, capsys):
    _, written = tag(images, model_dir, "--recursive", "--caption_extention", ".tags", "--frequency_tags")
    assert (images / "sub" / "small_red.tags").read_text() == ", ".join(expected("red")) + "\n"
    assert len(written) == 4 and "long_hair: 2" in capsys.readouterr().out
    out = tmp_path / "tags.jsonl"
    tag(images, model_dir, "--output_path", str(out), "--max_data_loader_n_workers", "1")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["caption"], r["image_size"]) for r in lines] == [(", ".join(expected(c)), [32, 32]) for c in sorted(RGB)]
    table = json.loads(tagger.run([str(images), "--model_dir", str(model_dir), "--output_path", str(tmp_path / "t.json")])[
        str(tmp_path / "t.json")])  # fmt: skip
    assert table[str(images / "green.png")]["tags"] == ", ".join(expected("green"))


def test_fixed_batch_model_and_model_dir_itself(images, tmp_path):
    folder = _make_tagger(tmp_path / "fixed", batch=2)  # --model_dir holding model.onnx directly, batch fixed at 2
    tags, _ = tag(images, folder, "--batch_size", "1")  # 3 images: the last batch is padded
    assert tags == {c: ", ".join(expected(c)) for c in RGB}


def test_prepare_image_pads_to_a_white_square(tmp_path):
    Image.new("RGBA", (8, 4), (10, 20, 30, 255)).save(tmp_path / "wide.png")
    pixels = wd14_tags.prepare_image(tmp_path / "wide.png", 8)
    want = np.full((8, 8, 3), 255, np.float32)
    want[2:6] = (30, 20, 10)  # BGR, centred
    np.testing.assert_array_equal(pixels, want)


def test_missing_model_and_unsupported_flags_are_named(images, model_dir, tmp_path, capsys, monkeypatch):
    for argv, needle in [
        (["--model_dir", str(tmp_path / "none")], "huggingface-cli download SmilingWolf/wd-v1-4-convnext-tagger-v2"),
        (["--model_dir", str(model_dir), "--force_download"], "never downloads"),
        (
            ["--model_dir", str(model_dir), "--repo_id", "a/b/c"],
            "download a/b c/model_optimized.onnx c/tag_mapping.json",
        ),
        (["--model_dir", str(model_dir), "--meta_threshold", "0.5"], "--meta_threshold"),
        (["--model_dir", str(model_dir), "--tag_replacement", "a;b,c"], "'a' is not `source,target`"),
        (["--model_dir", str(model_dir), "--caption_extension", "txt"], "--caption_extension 'txt'"),
    ]:
        assert tagger.main([str(images), *argv]) == 2
        assert needle in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)  # not installed
    assert tagger.main([str(images), "--model_dir", str(model_dir)]) == 2
    assert 'pip install "sdtrain[tagger]"' in capsys.readouterr().err


MAPPING = {  # tag_mapping.json layout: index -> (tag, category, score of a plain red image); index 5 is unmapped
    0: ("general", "Rating", 0.2), 1: ("sensitive", "Rating", 0.6), 2: ("long_hair", "General", 0.9),
    3: ("smile", "General", 0.5), 4: ("miku_(vocaloid)", "Character", 0.8), 6: ("vocaloid", "Copyright", 0.7),
    7: ("highres", "Meta", 0.4), 8: ("best_quality", "Quality", 0.45), 9: ("normal_quality", "Quality", 0.3),
    10: ("someone", "Artist", 0.36),
}  # fmt: skip


def _make_mapped_tagger(folder):
    """NCHW input in -1..1 -> mean over H, W -> MatMul -> logits; a plain red image gives logit(MAPPING scores), blue
    and green logit(0.05) everywhere."""
    from onnx import TensorProto, helper, numpy_helper

    outputs = max(MAPPING) + 1
    red = np.full(outputs, 0.99)  # the unmapped output scores high and must be ignored
    for index, (_, _, p) in MAPPING.items():
        red[index] = p
    targets = np.stack(
        [np.log(red / (1 - red)), np.full(outputs, np.log(0.05 / 0.95)), np.full(outputs, np.log(0.05 / 0.95))]
    )
    channel_means = np.array([[-1.0, -1.0, 1.0], [-1.0, 1.0, -1.0], [1.0, -1.0, -1.0]])  # BGR of red, green, blue
    weight = np.linalg.solve(channel_means, targets).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["input", "axes"], ["mean"], keepdims=0),
        helper.make_node("MatMul", ["mean", "weight"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_mapped",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", outputs])],
        [numpy_helper.from_array(np.array([2, 3], np.int64), "axes"), numpy_helper.from_array(weight, "weight")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model_optimized.onnx")
    table = {str(i): {"tag": t, "category": c} for i, (t, c, _) in MAPPING.items()}
    (folder / "tag_mapping.json").write_text(json.dumps(table))


def test_tag_mapping_layout(images, tmp_path):
    """--repo_id owner/repo/sub: sigmoid of the logits, per-category thresholds, sorted by score (sd-scripts)."""
    _make_mapped_tagger(tmp_path / "models" / "owner_repo" / "sub")

    def red(*flags):
        tagger.run([str(images), "--model_dir", str(tmp_path / "models"), "--repo_id", "owner/repo/sub", *flags])
        assert (images / "blue.txt").read_text() == "\n"
        return (images / "red.txt").read_text().rstrip("\n")

    def by_score(threshold=0.35, **category_thresholds):
        chosen = [(p, t) for t, c, p in MAPPING.values() if c not in ("Rating", "Quality")
                  and p >= category_thresholds.get(c, threshold)]  # fmt: skip
        return [t for _, t in sorted(chosen, reverse=True)]

    assert red() == ", ".join(by_score()) == "long_hair, miku_(vocaloid), vocaloid, smile, highres, someone"
    assert red("--meta_threshold", "0.5", "--artist_threshold", "0.9", "--copyright_threshold", "0.75") == ", ".join(
        by_score(Meta=0.5, Artist=0.9, Copyright=0.75)
    )
    assert red("--general_threshold", "0.6", "--character_threshold", "0.85") == ", ".join(
        by_score(General=0.6, Character=0.85)
    )
    assert red("--use_rating_tags", "--use_quality_tags_as_last_tag", "--undesired_tags", "smile") == (
        "sensitive, long_hair, miku_(vocaloid), vocaloid, highres, someone, best_quality"
    )
    assert red("--character_tags_first", "--general_threshold", "0.95").startswith("miku_(vocaloid), vocaloid")
    assert red("--remove_underscore", "--use_quality_tags").startswith("best quality, long hair")
