"""benchmarks/bench_sd3_memory.py's ``--tiny`` smoke mode: sd3_train_network.run on the simulated device with the
bench's flags (fp8 base, cached latents and text, checkpointing, block swapping, a sample, the save), every phase
counted; and its row check. The real-size table is in docs/training.md (the bench's own run, minutes of CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_sd3_memory  # noqa: E402

PHASES = ["load", "latent caching", "text caching", "step", "sampling", "save"]


def test_tiny_rows_run_every_phase(tmp_path, monkeypatch):
    from safetensors import safe_open

    from library.run import config as run_config

    # the bench patches SDPA (fused kernel on meta) and the swap check (uncounted) globally: restored after the test
    functional = torch.nn.functional
    monkeypatch.setattr(functional, "scaled_dot_product_attention", functional.scaled_dot_product_attention)
    monkeypatch.setattr(run_config, "block_swap_problems", run_config.block_swap_problems)
    monkeypatch.setitem(bench_sd3_memory.TINY_BLOCKS, "sd3.5-medium", 4)  # (24 by default: every released N runs)
    rows = bench_sd3_memory.main(["--tiny", "--rows", "medium:2", "--resolution", "64", "--workdir", str(tmp_path)])
    (row,) = rows
    assert row["variant"] == "sd3.5-medium" and row["blocks_to_swap"] == 2 and row["model"] == "tiny"
    assert list(row["peak_gib"]) == PHASES  # the sample ran (sampling phase) and the file was saved
    lora = tmp_path / "out" / "lora-medium2.safetensors"
    with safe_open(str(lora), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("lora_unet_joint_blocks_3_") for k in keys)  # a swapped block's adapter trained too
    assert not any(k.startswith("lora_te") for k in keys)  # --network_train_unet_only


@pytest.mark.parametrize("row", ["xl:0", "medium", "medium:-1"])
def test_bad_rows_are_refused(row, capsys):
    with pytest.raises(SystemExit):
        bench_sd3_memory.main(["--tiny", "--rows", row])
    assert "--rows" in capsys.readouterr().err
