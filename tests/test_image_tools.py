"""tools/canny.py against OpenCV's Canny, and tools/detect_face_rotate.py with OpenCV's real YuNet detector
(``cv2.FaceDetectorYN``) running a tiny ONNX model built here whose outputs plant faces at known places (box, eyes,
score): the crops are checked against slices of the input, the rotation against the eye positions."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from tools import canny, detect_face_rotate

cv2 = pytest.importorskip("cv2")
onnx = pytest.importorskip("onnx")

S = 64  # the tiny detector's input size (images are S x S)


def _yunet(path, faces):
    """A YuNet-layout ONNX model (cls/obj/bbox/kps outputs at strides 8, 16, 32) that reports ``faces``:
    ``(stride, col, row, box (dx, dy, log w, log h), 5 landmarks (dx, dy) in cells, score)``."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.array([1, 2, 3], np.int64), "axes"),
        numpy_helper.from_array(np.array([1, 1, 1], np.int64), "shape"),
        numpy_helper.from_array(np.zeros((1, 1, 1), np.float32), "zero"),
    ]
    nodes = [
        helper.make_node("ReduceMean", ["input", "axes"], ["mean"], keepdims=1),
        helper.make_node("Reshape", ["mean", "shape"], ["mean3"]),
        helper.make_node("Mul", ["mean3", "zero"], ["nothing"]),  # the outputs depend on the input (by 0)
    ]
    outputs = []
    for stride in (8, 16, 32):
        cells = (S // stride) ** 2
        arrays = {"cls": np.zeros((1, cells, 1)), "obj": np.zeros((1, cells, 1))}
        arrays |= {"bbox": np.zeros((1, cells, 4)), "kps": np.zeros((1, cells, 10))}
        for s, col, row, box, kps, score in faces:
            if s == stride:
                cell = row * (S // stride) + col
                arrays["cls"][0, cell], arrays["obj"][0, cell] = score, score  # YuNet's score: sqrt(cls * obj)
                arrays["bbox"][0, cell], arrays["kps"][0, cell] = box, np.ravel(kps)
        for kind, values in arrays.items():
            name = f"{kind}_{stride}"
            inits.append(numpy_helper.from_array(values.astype(np.float32), f"{name}_value"))
            nodes.append(helper.make_node("Add", [f"{name}_value", "nothing"], [name]))
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(values.shape)))
    graph = helper.make_graph(
        nodes, "tiny_yunet", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, S, S])], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


# The big face: stride 8, cell (3, 4): centre (28, 36), 24 x 24; right eye (20, 33.6), left eye (36, 38.4)
BIG = (8, 3, 4, (0.5, 0.5, math.log(3), math.log(3)), [(-0.5, 0.2), (1.5, 0.8), (0.5, 0.5), (0, 1), (1, 1)], 1.0)
# A small face: stride 16, cell (0, 0): centre (8, 8), 16 x 16, eyes level; score 0.8
SMALL = (16, 0, 0, (0.5, 0.5, 0.0, 0.0), [(0.25, 0.4), (0.75, 0.4), (0.5, 0.5), (0.3, 0.8), (0.7, 0.8)], 0.8)


@pytest.fixture(scope="module")
def yunet(tmp_path_factory):
    return _yunet(tmp_path_factory.mktemp("yunet") / "tiny_yunet.onnx", [BIG, SMALL])


@pytest.fixture()
def src(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "src"
    folder.mkdir()
    image = rng.integers(0, 200, size=(S, S, 3), dtype=np.uint8)
    cv2.imwrite(str(folder / "photo.png"), image)
    return folder, image


def faces(src, yunet, tmp_path, *flags):
    out = tmp_path / "out"
    written = detect_face_rotate.run(["--src_dir", str(src[0]), "--dst_dir", str(out), "--yunet_model", str(yunet),
                                      *flags])  # fmt: skip
    return {p.name: cv2.imread(str(p)) for p in written}


def test_yunet_faces_and_crops_are_slices_of_the_image(src, yunet, tmp_path):
    image = src[1]
    assert list(faces(src, yunet, tmp_path)) == ["photo_0028_0036_0024_0024.png"]  # largest face, image as it is
    crop = faces(src, yunet, tmp_path, "--crop_size", "32,32")
    np.testing.assert_array_equal(crop["photo_0016_0016_0024_0024.png"], image[20:52, 12:44])
    ratio = faces(src, yunet, tmp_path, "--crop_ratio", "2,2")  # 48 x 48 around the face
    np.testing.assert_array_equal(ratio["photo_0024_0024_0024_0024.png"], image[12:60, 4:52])
    edge = faces(src, yunet, tmp_path, "--crop_size", "40,16")  # moved inside the image at the bottom
    np.testing.assert_array_equal(edge["photo_0020_0008_0024_0024.png"], image[28:44, 8:48])


def test_face_selection_flags(src, yunet, tmp_path):
    assert faces(src, yunet, tmp_path, "--min_size", "25") == {}
    assert faces(src, yunet, tmp_path, "--max_size", "24") == {}  # excluded: no face below 24 with score >= 0.9
    assert list(faces(src, yunet, tmp_path, "--score_threshold", "0.7")) == ["photo_0028_0036_0024_0024.png"]
    several = faces(src, yunet, tmp_path, "--multiple_faces", "--score_threshold", "0.7")
    assert sorted(several) == ["photo_01_0028_0036_0024_0024.png", "photo_02_0008_0008_0016_0016.png"]
    assert list(faces(src, yunet, tmp_path, "--score_threshold", "0.7", "--max_size", "20")) == [
        "photo_0008_0008_0016_0016.png"
    ]


def test_resize_flags(src, yunet, tmp_path):
    image = src[1]
    scaled = faces(src, yunet, tmp_path, "--crop_size", "64,64", "--resize_face_size", "48")  # image x2, then crop
    big = cv2.resize(image, (128, 128), interpolation=cv2.INTER_LANCZOS4)
    np.testing.assert_array_equal(scaled["photo_0032_0032_0048_0048.png"], big[40:104, 24:88])
    fit = faces(src, yunet, tmp_path, "--crop_size", "96,96", "--resize_fit")  # x1.5: the crop is the whole image
    assert [(n, im.shape) for n, im in fit.items()] == [("photo_0042_0054_0036_0036.png", (96, 96, 3))]


def test_rotate_levels_the_eyes(tmp_path, yunet):
    folder = tmp_path / "src"
    folder.mkdir()
    image = np.zeros((S, S, 3), np.uint8)
    for x, y in [(20, 33.6), (36, 38.4)]:  # the planted eyes as bright dots
        cv2.circle(image, (round(x * 16), round(y * 16)), 2 * 16, (255, 255, 255), -1, cv2.LINE_AA, 4)  # sub-pixel
    cv2.imwrite(str(folder / "tilted.png"), image)
    (rotated,) = faces((folder, image), yunet, tmp_path, "--rotate").values()

    def eye_heights(picture):  # intensity-weighted mean row of each dot
        grey = picture[:, :, 0].astype(np.float64)
        rows = np.arange(S)[:, None]
        return [(grey[:, cols] * rows).sum() / grey[:, cols].sum() for cols in (slice(0, 28), slice(28, S))]

    before, after = eye_heights(image), eye_heights(rotated)
    assert after[1] - after[0] == pytest.approx(0, abs=0.3) and before[1] - before[0] == pytest.approx(4.8, abs=0.3)
    assert sum(after) / 2 == pytest.approx(sum(before) / 2, abs=0.5)  # turned about the face centre


def test_debug_draws_the_box(src, yunet, tmp_path):
    (plain,) = faces(src, yunet, tmp_path, "--crop_size", "32,32").values()
    (boxed,) = faces(src, yunet, tmp_path, "--crop_size", "32,32", "--debug").values()
    assert (boxed[4, 4:28] == (255, 0, 255)).all() and (plain != boxed).any()  # the top edge of the 24 px box


def test_detector_and_flag_errors(src, tmp_path, capsys, monkeypatch):
    base = ["--src_dir", str(src[0]), "--dst_dir", str(tmp_path / "out")]
    monkeypatch.setitem(sys.modules, "anime_face_detector", None)  # not installed
    for argv, needle in [
        (base, "no face detector: install sd-scripts' anime face detector"),
        ([*base, "--yunet_model", str(tmp_path / "none.onnx")], "none.onnx: no such file"),
        ([*base, "--crop_size", "32"], "--crop_size '32'"),
        ([*base, "--crop_ratio", "2,2", "--crop_size", "8,8"], "--crop_ratio cannot be used"),
        ([*base, "--resize_fit", "--resize_face_size", "8", "--crop_size", "8,8"], "choose one"),
    ]:
        assert detect_face_rotate.main(argv) == 2
        assert needle in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "cv2", None)
    assert detect_face_rotate.main([*base, "--yunet_model", "x.onnx"]) == 2
    assert 'pip install "sdtrain[canny]"' in capsys.readouterr().err


def test_canny_is_opencvs_canny_and_the_thresholds_matter(tmp_path, capsys):
    grey = np.zeros((48, 48), np.uint8)
    grey[8:40, 8:40] = 40  # a weak square edge
    grey[16:32, 16:32] = 250  # a strong one inside it
    cv2.imwrite(str(tmp_path / "in.png"), cv2.merge([grey, grey, grey]))
    out = canny.run(["--input", str(tmp_path / "in.png"), "--output", str(tmp_path / "edges.png")])
    edges = cv2.imread(str(out), cv2.IMREAD_UNCHANGED)
    np.testing.assert_array_equal(edges, cv2.Canny(grey, 32, 224))
    high = canny.run(["--input", str(tmp_path / "in.png"), "--output", str(tmp_path / "high.png"), "--thres1", "150",
                     "--thres2", "300"])  # fmt: skip
    high_edges = cv2.imread(str(high), cv2.IMREAD_UNCHANGED)
    np.testing.assert_array_equal(high_edges, cv2.Canny(grey, 150, 300))
    assert edges[7:9, 20].any() and not high_edges[7:9, 20].any()  # the weak edge is gone at higher thresholds
    assert edges[15:17, 20].any() and high_edges[15:17, 20].any()  # the strong one stays
    for argv, needle in [
        (["--input", str(tmp_path / "none.png"), "--output", str(tmp_path / "o.png")], "none.png: no such image"),
        (["--input", str(tmp_path / "in.png"), "--output", str(tmp_path / "o.xyz")], "cannot write .xyz"),
        (["--input", str(tmp_path / "in.png"), "--output", str(tmp_path / "o.png"), "--thres1", "300"], "--thres1"),
    ]:
        assert canny.main(argv) == 2
        assert needle in capsys.readouterr().err


def test_anime_face_detector_predictions_become_faces(src, tmp_path, monkeypatch):
    """sd-scripts' detector (not installable here) through its documented output: per face ``bbox`` = (left, top,
    right, bottom, score) and 28 ``keypoints`` (x, y, score), the eyes at 11 (right) and 19 (left); scores below
    --score_threshold are dropped, the angle is atan2 of left minus right eye."""
    import types

    keypoints = np.zeros((28, 3))
    keypoints[11, :2], keypoints[19, :2] = (20, 30), (36, 30 + 16 * math.tan(math.radians(10)))
    predictions = [
        {"bbox": np.array([16, 24, 40, 48, 0.95]), "keypoints": keypoints},
        {"bbox": np.array([0, 0, 60, 60, 0.5]), "keypoints": keypoints},  # larger but below the score threshold
    ]
    asked = []
    module = types.SimpleNamespace(create_detector=lambda name: asked.append(name) or (lambda image: predictions))
    monkeypatch.setitem(sys.modules, "anime_face_detector", module)
    detect = detect_face_rotate.make_detector(None, 0.9)
    (face,) = detect(src[1])
    assert asked == ["yolov3"] and (face.cx, face.cy, face.w, face.h) == (28, 36, 24, 24)
    assert face.angle == pytest.approx(10.0)
    written = detect_face_rotate.run(
        ["--src_dir", str(src[0]), "--dst_dir", str(tmp_path / "out"), "--crop_size", "32,32"]
    )
    assert [p.name for p in written] == ["photo_0016_0016_0024_0024.png"]
