"""Shared fixtures: tiny SD1 / SD2 / SDXL models built once per test session (no downloads)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Tiny models: one thread is several times faster than two (thread hand-offs cost more than the maths), and
# hundreds of times faster on a loaded machine. The scripts and launches the tests start inherit the variable: on
# CI's two cores their second thread only competed with the other test worker (13 min 11 s of the suite without
# it, 11 min 15 s with it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# A test process holds several hundred thousand long-lived objects (torch, transformers, diffusers, the shared tiny
# models, earlier tests' fixtures). Python's default thresholds rescan all of them in a full collection every few
# tens of thousands of allocations: about 30 % of a tiny training run's CPU. Young cycles are still collected
# (generation 0 every 10,000 allocations); the tests that count memory call gc.collect() themselves.
gc.set_threshold(10_000, 20, 20)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()  # what collection imported (every test module's imports) is never scanned again


SLOWEST_FIRST = Path(__file__).with_name("slowest_first.txt")


def _slowest_first(items):
    """The test files of slowest_first.txt first, in its order, then the others as collected (each file's tests stay
    together, in their order). With ``-n 2`` pyproject's ``--dist loadfile`` gives each worker whole files (a module
    fixture is built once), one at a time as it finishes the one before: the long files first, the short ones last,
    so that neither worker waits long for the other at the end."""
    listed = [line.split()[0] for line in SLOWEST_FIRST.read_text().splitlines() if line and not line.startswith("#")]
    rank = {name: i for i, name in enumerate(listed)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1], len(rank)))


def pytest_collection_modifyitems(config, items):
    _slowest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request, monkeypatch):
    """On a machine with a GPU, the tests not marked ``gpu`` still train on the CPU: they check logic bit for bit
    (exact resume, processes that agree), which CUDA's non-deterministic kernels break, and their two-process
    launches (gloo) would ask a one-GPU machine for a second GPU."""
    if torch.cuda.is_available() and "gpu" not in request.keywords:
        monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # accelerate's own switch: Accelerator(cpu=True)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # launched processes see no GPU


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Folder with tiny diffusers models: <dir>/sd1, <dir>/sd2, <dir>/sdxl."""
    from library.families.sd import FAMILIES

    root = tmp_path_factory.mktemp("tiny_models")
    for family in FAMILIES:
        family.tiny.write_folder(family.tiny.build(), root / family.name)
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """The example images and captions of the demo, one copy per test module (a module may override it)."""
    from library.run.demo import make_example_dataset

    return make_example_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def tiny_parts():
    """In-memory tiny models keyed by family name. Do not modify them in a test: deep-copy first."""
    from library.families.sd import FAMILIES

    return {family.name: family.tiny.build() for family in FAMILIES}
