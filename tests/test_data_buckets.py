"""Bucket sets and assignment, checked against sd-scripts' formula written out independently here."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from library.data.buckets import BucketSpec, make_bucket_resolutions, predefined_buckets, select_bucket


def expected_buckets(w: int, h: int, lo: int, hi: int, step: int) -> set[tuple[int, int]]:
    """sd-scripts' library/model_util.py make_bucket_resolutions in words: the square floor(sqrt(area)/step)*step,
    plus for every width from min to max in `step` increments the height min(max, floor(area/width/step)*step) and its
    transpose when >= min."""
    area = w * h
    out = {(math.isqrt(area) // step * step,) * 2}
    for width in range(lo, hi + 1, step):
        height = min(hi, (area // width) // step * step)
        if height >= lo:
            out |= {(width, height), (height, width)}
    return out


def test_512_defaults_give_17_buckets():
    got = make_bucket_resolutions((512, 512), 256, 1024, 64)
    assert len(got) == 17
    assert set(got) == expected_buckets(512, 512, 256, 1024, 64)
    assert got == sorted(got)
    assert {(512, 512), (256, 1024), (1024, 256), (576, 448), (448, 576)} <= set(got)


def test_1024_with_256_to_2048_gives_41_buckets():
    got = make_bucket_resolutions((1024, 1024), 256, 2048, 64)
    assert len(got) == 41
    assert set(got) == expected_buckets(1024, 1024, 256, 2048, 64)


def test_non_square_resolution_uses_its_area():
    got = make_bucket_resolutions((768, 512), 256, 1024, 64)
    assert set(got) == expected_buckets(768, 512, 256, 1024, 64)
    assert (576, 576) in got  # floor(sqrt(768*512)/64)*64


def test_exact_size_wins_then_nearest_aspect_and_cover_resize():
    spec = BucketSpec((512, 512), enable_bucket=True)
    buckets = predefined_buckets(spec)
    a = select_bucket(448, 576, spec, buckets)
    assert a.bucket == (448, 576) and a.resized == (448, 576)
    a = select_bucket(1000, 500, spec, buckets)  # aspect 2.0 -> nearest bucket aspect
    best = min(buckets, key=lambda b: abs(b[0] / b[1] - 2.0))
    assert a.bucket == best
    assert a.resized[0] >= a.bucket[0] and a.resized[1] >= a.bucket[1]  # covers the bucket
    assert min(a.resized[0] - a.bucket[0], a.resized[1] - a.bucket[1]) <= 1  # one side fits exactly


def test_without_buckets_everything_goes_to_the_resolution():
    spec = BucketSpec((64, 96))
    a = select_bucket(300, 200, spec, predefined_buckets(spec))
    assert a.bucket == (64, 96)
    assert a.resized[0] >= 64 and a.resized[1] >= 96


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    w=st.integers(8, 4000),
    h=st.integers(8, 4000),
    res=st.sampled_from([256, 512, 768, 1024]),
    step=st.sampled_from([8, 32, 64]),
)
def test_bucket_no_upscale_never_upscales(w, h, res, step):
    spec = BucketSpec((res, res), enable_bucket=True, bucket_reso_steps=step, bucket_no_upscale=True)
    a = select_bucket(w, h, spec, predefined_buckets(spec))
    assert a.resized[0] <= w and a.resized[1] <= h  # never larger than the image
    assert a.bucket[0] <= a.resized[0] and a.bucket[1] <= a.resized[1]  # bucket is cropped out of it
    assert a.bucket[0] % step == 0 and a.bucket[1] % step == 0
    # within the area budget, up to sd-scripts' rounding of the short side to the nearest step (e.g. 327x3052 at
    # 512 with step 8 -> 168x1568, 1280 px over)
    assert a.bucket[0] * a.bucket[1] <= res * res + step * max(a.bucket)
