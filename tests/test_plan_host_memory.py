"""``--plan_memory``'s host column (library/measure/plan_report.py): plans run one after another in one process
count what each counts alone, and the host peak is split into pinned (page-locked) and pageable bytes.

Oracles: the same plan run again after another plan, JSON equal (an earlier plan's objects, or its host tensors,
must not be counted); the pinned bytes against block swap's own count of the host copies it keeps
(``BlockSwap.host_bytes``: what a CUDA run pins) and the loader's pinned batches (``Batch.pin_memory``'s outputs
alive at once, followed by their storages' finalizers: the step's batch and the next one, which the loop fetches
while it still holds the step's, as torch's loader does on CUDA).
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest

from library.data.loader import Batch
from library.measure.phantom import _phantoms
from library.measure.plan import plan_command
from library.run.block_swap import BlockSwap
from library.run.demo import make_example_dataset
from tests.test_plan_memory import model_flags

NAME = "flux-dev"  # two block lists (4 + 4 blocks in the tiny model): swap 2 keeps one of each on the host
SWAP = ["--blocks_to_swap", "2"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Plan B (no swap), plan A (block swap), plan B again, in one process; with the bytes block swap counted on
    the host and the most bytes of pinned batches alive at once."""
    import flux_train_network as script

    root = tmp_path_factory.mktemp("host_plan")
    data = make_example_dataset(root / "data")
    argv = [*model_flags(NAME, root), "--train_data_dir", str(data), "--caption_extension", ".txt",
            "--resolution", "64", "--output_dir", str(root / "out"), "--network_module", "networks.lora",
            "--network_dim", "4", "--network_train_unet_only", "--learning_rate", "1e-3",
            "--max_data_loader_n_workers", "0", "--seed", "1", "--cache_latents", "--cache_text_encoder_outputs",
            "--plan_memory"]  # fmt: skip
    seen = {"swap_bytes": [], "batch_bytes": 0}
    place, pin = BlockSwap.place, Batch.pin_memory

    def placed(self, model):
        place(self, model)
        seen["swap_bytes"].append(self.host_bytes)

    live = {"bytes": 0}

    def freed(size):
        live["bytes"] -= size

    def pinned(self):  # the pinned batches' bytes alive at once, followed by the storages' own finalizers
        out = pin(self)
        storages = {}
        out._map(lambda t: storages.setdefault(t.untyped_storage()._cdata, t.untyped_storage()))
        for storage in storages.values():
            live["bytes"] += storage.nbytes()
            weakref.finalize(storage, freed, storage.nbytes())
        seen["batch_bytes"] = max(seen["batch_bytes"], live["bytes"])
        return out

    BlockSwap.place, Batch.pin_memory = placed, pinned
    try:
        gc.collect()
        phantoms = len(_phantoms)
        first = plan_command(lambda: script.run(argv), out=lambda line: None)
        swapped = plan_command(lambda: script.run([*argv, *SWAP]), out=lambda line: None)
        gc.collect()
        left = len(_phantoms) - phantoms  # host tensors of the two plans still alive
        again = plan_command(lambda: script.run(argv), out=lambda line: None)
    finally:
        BlockSwap.place, Batch.pin_memory = place, pin
    return {"first": first, "swapped": swapped, "again": again, "left": left, **seen}


def test_a_plan_after_another_in_one_process_equals_its_plan_alone(plans):
    """The bigger plan (block swap: more host copies) before it changes nothing in the second plan of the same
    command, and nothing of the plans' runs stays alive (the planner held the run's model through the finalizers of
    the tensors it counted: benchmarks/flux_controlnet_plan.py's second row counted the first one's host tensors)."""
    assert plans["left"] == 0
    assert json.dumps(plans["again"], sort_keys=True) == json.dumps(plans["first"], sort_keys=True)


def test_pinned_host_bytes_are_the_swapped_blocks_and_the_batch(plans):
    """A CUDA run pins block swap's host copies (from placement on) and the loader's batch: the plan's most pinned
    bytes of each phase are exactly the batch without block swap and the swapped blocks more with it; nothing is
    pinned before the steps; pinned and pageable peaks bound the host peak."""
    (swap,) = plans["swap_bytes"]  # one plan swaps
    batch = plans["batch_bytes"]
    assert swap > 0 and batch > 0
    alone = {phase: row["host_pinned_bytes"] for phase, row in plans["first"]["phases"].items()}
    swapped = {phase: row["host_pinned_bytes"] for phase, row in plans["swapped"]["phases"].items()}
    assert alone.keys() == swapped.keys() and alone["step"] == batch
    for phase in ("load", "latent caching", "text caching"):
        assert alone[phase] == swapped[phase] == 0
    for phase in ("step", "sampling", "save"):
        assert swapped[phase] - alone[phase] == swap
    for plan in (plans["first"], plans["swapped"]):
        for row in plan["phases"].values():
            assert row["host_pinned_bytes"] <= row["host_bytes"]
            assert max(row["host_pinned_mib"], row["host_pageable_mib"]) <= row["host_mib"]
            assert row["host_mib"] <= row["host_pinned_mib"] + row["host_pageable_mib"] + 0.11
    assert plans["swapped"]["host_pinned_peak_mib"] == round((swap + batch) / 2**20, 1)


def test_the_ram_verdict_says_how_much_is_page_locked(plans):
    """``--ram``: the host tensors against the RAM, and the pinned part named as memory the system cannot swap out
    (none named without pinned bytes)."""
    from library.measure.plan_report import lines

    plan = dict(plans["swapped"], ram_gib=1.0, fits_ram=True)
    pinned = plan["host_pinned_peak_mib"]
    (verdict,) = [line for line in lines(plan) if line.startswith("--ram 1:")]
    assert f"{pinned:.1f} MiB of them are pinned (page-locked: the system cannot swap them out" in verdict
    assert "pinned" in lines(plan)[1]  # the table's column
    assert "pinned" not in [line for line in lines(dict(plan, host_pinned_peak_mib=0)) if line.startswith("--ram")][0]
