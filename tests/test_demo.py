"""``--demo`` for every algorithm: each file is checked by the consumer that reads its format (diffusers for
LoRA/LoCon, lycoris-lora's loader and forward pass for LoHa/LoKr/DoRA, compared with sdtrain's own reading), the
SD1 and SDXL demos write to different files, and no library's progress bar shows between ours."""

from __future__ import annotations

import pytest

import train_network


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("demo")


def _demo(demo_dir, families, *extra):
    argv = ["--demo", "--demo_dir", str(demo_dir), "--max_train_steps", "2", *extra]
    return train_network.run(argv, family_names=families)


@pytest.mark.parametrize(
    "algo,reader",
    [("lora", "diffusers"), ("locon", "diffusers"), ("loha", "lycoris-lora"), ("lokr", "lycoris-lora"),
     ("dora", "lycoris-lora"), ("diag-oft", "lycoris-lora"), ("boft", "lycoris-lora")],
)  # fmt: skip
def test_demo_exits_cleanly_for_every_algorithm(demo_dir, capsys, algo, reader):
    result = _demo(demo_dir, ("sd1", "sd2"), "--network_args", f"algo={algo}", "conv_dim=4")
    assert result.output.exists() and not result.failed
    out, err = capsys.readouterr()
    line = next(x for x in out.splitlines() if x.startswith("demo: the adapter is at"))
    assert f"{reader} loads it" in line and str(result.output) in line
    # the demo writes the model and loads the file with diffusers: their bars stay off (tests/test_console.py)
    assert not any(bar in err for bar in ("Writing model shards", "Loading pipeline components", "Loading weights"))


def test_demo_of_sd_scripts_oft_is_checked_against_its_forward(demo_dir, capsys):
    result = _demo(demo_dir, ("sd1", "sd2"), "--network_module", "networks.oft", "--output_name", "oft")
    assert result.output.exists() and not result.failed
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("demo: the adapter is at"))
    assert "sd-scripts' networks.oft forward" in line and "reads it the same" in line


def test_sd1_and_sdxl_demos_write_different_files(demo_dir, capsys):
    sd1 = _demo(demo_dir, ("sd1", "sd2"))
    sdxl = _demo(demo_dir, ("sdxl",), "--network_args", "algo=lokr")
    assert sd1.output != sdxl.output and sd1.output.exists() and sdxl.output.exists()
    assert "lycoris-lora loads it" in capsys.readouterr().out
