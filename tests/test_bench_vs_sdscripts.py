"""The paired benchmark's table code (benchmarks/peer/pairs.py) and argument checks, without sd-scripts."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

PEER = Path(__file__).resolve().parents[1] / "benchmarks" / "peer"
sys.path.insert(0, str(PEER))
sys.path.insert(0, str(PEER.parent))
import bench_vs_sdscripts  # noqa: E402
import pairs  # noqa: E402

KEYS = {"lora_unet_a.lora_down.weight": [8, 32], "lora_unet_a.lora_up.weight": [32, 8], "lora_unet_a.alpha": []}


def rec(side, pair, steps, wall, cpu, sps, ttfs, rss, keys=KEYS):
    return {"case": "sd1", "side": side, "pair": pair, "steps": steps, "rc": 0, "wall_s": wall, "cpu_s": cpu,
            "s_per_step": sps, "ttfs_s": ttfs, "peak_rss_mb": rss, "keys": keys,
            "output": {"keys": len(keys), "modules": 1, "modules_by_prefix": {"lora_unet": 1}, "dtypes": ["F32"]}}  # fmt: skip


def records():
    # sd-scripts: per-step wall 0.2 s (pair 0) and 0.3 s (pair 1); sdtrain: 0.1 s and 0.3 s -> ratios 0.5 and 1.0
    out = []
    for p, (a_step, b_step) in enumerate(((0.2, 0.1), (0.3, 0.3))):
        for n in (10, 40):
            out.append(rec("sd-scripts", p, n, 10 + a_step * n, 20 + 2 * a_step * n, a_step, 8.0, 500.0))
            out.append(rec("sdtrain", p, n, 10 + b_step * n, 20 + 2 * b_step * n, b_step, 4.0 + p, 450.0))
            for r, step in zip(out[-2:], (a_step, b_step)):  # the loop's own CPU: 1.5x the wall of a step
                r["loop_cpu_s_per_step"] = 1.5 * step
    return out


def test_paired_ratios_are_medians_of_per_pair_ratios():
    recs = records()
    a = pairs.side_metrics(recs, "sd1", "sd-scripts", 10, 40)
    b = pairs.side_metrics(recs, "sd1", "sdtrain", 10, 40)
    assert a["diff"] == pytest.approx({0: 0.2, 1: 0.3})
    assert b["cdiff"] == pytest.approx({0: 0.2, 1: 0.6})
    assert pairs.paired_ratio(b["diff"], a["diff"]) == pytest.approx(0.75)  # median of 0.5 and 1.0
    assert pairs.paired_ratio(b["ttfs"], a["ttfs"]) == pytest.approx(0.5625)  # 4/8, 4/8, 5/8, 5/8
    assert pairs.paired_ratio(b["rss"], a["rss"]) == pytest.approx(0.9)
    text = pairs.summarize(recs, ["sd-scripts", "sdtrain"], [10, 40])
    row = next(line for line in text.splitlines() if line.startswith("| sd1 |") and "sdtrain" not in line
               and "sd-scripts" not in line)  # fmt: skip
    cells = [c.strip() for c in row.strip("|").split("|")]
    cols = [t for _, t, _ in pairs._metric_keys(10, 40)]
    got = dict(zip(cols, cells[1:]))
    assert got["s/step (wall40-wall10)/30"] == "0.75" and got["time to 1st step s"] == "0.56"
    assert got["peak RSS MB"] == "0.90" and got["CPU s/step (cpu40-cpu10)/30"] == "0.75"
    assert got["CPU s/step loop N=40"] == "0.75" and got["s/step loop mean N=40"] == "-"  # not in these records
    assert "IDENTICAL key+shape set to sd-scripts" in text and "Problems" not in text


def test_three_sides_give_after_over_before_and_key_differences_are_reported():
    recs = records()
    other = dict(KEYS, **{"lora_te_b.lora_down.weight": [8, 32]})
    recs += [dict(r, side="before", keys=other if r["pair"] == 0 else KEYS, wall_s=r["wall_s"] * 2)
             for r in recs if r["side"] == "sdtrain"]  # fmt: skip
    recs.append(dict(recs[0], pair=2, rc=1, log="x/log.txt"))  # a failed run is listed, not averaged
    text = pairs.summarize(recs, ["sd-scripts", "before", "sdtrain"], [10, 40])
    assert "Ratios sdtrain / before" in text and "Ratios before / sd-scripts" in text
    after_before = text.split("Ratios sdtrain / before")[1].splitlines()[4]
    assert after_before.split("|")[2].strip() == "0.50"  # wall N=10 halved
    assert "DIFFERENT from sd-scripts: 0 keys only in sd-scripts, 1 only in before" in text
    assert "rc=1" in text and "x/log.txt" in text


def test_one_step_count_drops_the_difference_columns():
    recs = [r for r in records() if r["steps"] == 40]
    text = pairs.summarize(recs, ["sd-scripts", "sdtrain"], [40])
    assert "wall40-wall" not in text and "s/step stamps N=40" in text


def test_safetensors_summary_counts_modules_per_prefix(tmp_path):
    header = {"lora_te1_x.lora_down.weight": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
              "lora_unet_y.lora_down.weight": {"dtype": "F32", "shape": [2, 4], "data_offsets": [32, 64]},
              "__metadata__": {"ss_network_dim": "2"}}  # fmt: skip
    raw = json.dumps(header).encode()
    (tmp_path / "f.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))
    s = pairs.safetensors_summary(str(tmp_path / "f.safetensors"))
    assert s["modules_by_prefix"] == {"lora_te1": 1, "lora_unet": 1} and s["keys"] == 2 and s["params"] == 16


def test_arguments_name_what_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_vs_sdscripts.parse_args(["--cases", "sd1"])
    assert "--sdscripts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_vs_sdscripts.parse_args(["--sdscripts", str(tmp_path), "--cases", "sd4"])
    assert "unknown case 'sd4'" in capsys.readouterr().err
    a = bench_vs_sdscripts.parse_args(["--sdscripts", str(tmp_path)])
    with pytest.raises(SystemExit, match="not an sd-scripts checkout"):
        bench_vs_sdscripts.make_sides(a)


@pytest.mark.parametrize("case", ["sd3", "anima", "lumina", "chroma"])
def test_dit_cases_give_both_sides_the_same_files_and_flags(tmp_path, case):
    """A DiT case runs the same entry script on both sides with the same arguments; only the reference side goes
    through the wrapper that patches its released configs (the kit's for SD3, run_reference_tiny.py otherwise)."""
    a = bench_vs_sdscripts.parse_args(["--sdscripts", str(tmp_path), "--assets", str(tmp_path), "--cases", case,
                                       "--kit", str(tmp_path / "kit")])  # fmt: skip
    sds = bench_vs_sdscripts.Side("sd-scripts", tmp_path, tmp_path / "venv", sdscripts=True)
    ours = bench_vs_sdscripts.Side("sdtrain", tmp_path, tmp_path / "venv2")
    theirs, mine = (bench_vs_sdscripts.command(a, s, case, 7, tmp_path / "run") for s in (sds, ours))
    script = bench_vs_sdscripts.DIT_CASES[case].script
    assert mine[mine.index(script) + 1 :] == theirs[theirs.index(script) + 1 :]
    wrapper = Path(theirs[theirs.index(script) - 1])
    assert wrapper.parent == (tmp_path / "kit" if case == "sd3" else PEER)
    flags = mine[mine.index(script) + 1 :]
    model = Path(flags[flags.index("--pretrained_model_name_or_path") + 1])
    assert model.parent == tmp_path / "models" / bench_vs_sdscripts.DIT_CASES[case].folder
    assert flags[flags.index("--network_module") + 1] == f"networks.lora_{'flux' if case == 'chroma' else case}"
    assert flags[flags.index("--max_train_steps") + 1] == "7" and "--network_train_unet_only" in flags


def test_branch_cases_run_their_own_scripts_with_the_same_flags(tmp_path):
    """Stable Cascade stage C (networks.lora, the stage C flag) and Würstchen 2 (a full fine-tune: the branch's
    script lives in wuerstchen/, no network flags, no --tokenizer_cache_dir, the prior folder written): the flags
    after the entry script are the same on both sides."""
    sds = bench_vs_sdscripts.Side("sd-scripts", tmp_path, tmp_path / "venv", sdscripts=True)
    ours = bench_vs_sdscripts.Side("sdtrain", tmp_path, tmp_path / "venv2")
    scripts = {"stable_cascade": ("stable_cascade_train_c_network.py", "stable_cascade_train_c_network.py"),
               "wuerstchen": ("wuerstchen/wuerstchen_train.py", "wuerstchen_train.py")}  # fmt: skip
    for case, (theirs_script, ours_script) in scripts.items():
        a = bench_vs_sdscripts.parse_args(["--sdscripts", str(tmp_path), "--assets", str(tmp_path), "--cases", case])
        theirs, mine = (bench_vs_sdscripts.command(a, s, case, 7, tmp_path / "run") for s in (sds, ours))
        flags = mine[mine.index(ours_script) + 1 :]
        assert flags == theirs[theirs.index(theirs_script) + 1 :]
        assert Path(theirs[theirs.index(theirs_script) - 1]) == PEER / "run_reference_tiny.py"
        if case == "stable_cascade":
            assert "--stage_c_checkpoint_path" in flags and "--network_train_unet_only" in flags
            assert flags[flags.index("--network_module") + 1] == "networks.lora"
        else:
            assert "--network_module" not in flags and "--tokenizer_cache_dir" not in flags
            assert flags[flags.index("--save_model_as") + 1] == "diffusers_safetensors"


def test_onetrainer_cases_write_a_config_with_our_flags_numbers(tmp_path, capsys):
    """PixArt against OneTrainer: its side runs scripts/train.py on a config the run writes, whose numbers are our
    side's flags' (LoRA dim / alpha, learning rate, steps as one epoch of that many samples, 64 px, batch 1, the
    same pipeline folder, fused qkv / kv in the kohya file); the cases run in an invocation of their own."""
    with pytest.raises(SystemExit):
        bench_vs_sdscripts.parse_args(["--cases", "pixart_sigma"])
    assert "--onetrainer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_vs_sdscripts.parse_args(["--onetrainer", str(tmp_path), "--sdsvenv", str(tmp_path),
                                       "--cases", "pixart_sigma,sd1"])  # fmt: skip
    assert "invocation of their own" in capsys.readouterr().err
    a = bench_vs_sdscripts.parse_args(["--onetrainer", str(tmp_path), "--sdsvenv", str(tmp_path), "--assets",
                                       str(tmp_path), "--cases", "pixart_alpha"])  # fmt: skip
    with pytest.raises(SystemExit, match="not a OneTrainer checkout"):
        bench_vs_sdscripts.make_sides(a)
    ot = bench_vs_sdscripts.Side("OneTrainer", tmp_path, tmp_path / "venv", sdscripts=True)
    ours = bench_vs_sdscripts.Side("sdtrain", tmp_path, tmp_path / "venv2")
    theirs, mine = (bench_vs_sdscripts.command(a, s, "pixart_alpha", 7, tmp_path / "run") for s in (ot, ours))
    assert theirs[theirs.index("scripts/train.py") + 1] == "--config-path"
    config = json.loads(Path(theirs[theirs.index("--config-path") + 1]).read_text())
    flags = mine[mine.index("pixart_train_network.py") + 1 :]

    def flag(name):
        return flags[flags.index(name) + 1]

    assert config["base_model_name"] == flag("--pretrained_model_name_or_path")
    assert Path(config["base_model_name"]) == tmp_path / "models" / "tiny-pixart_alpha"
    assert (config["lora_rank"], config["lora_alpha"]) == (int(flag("--network_dim")), float(flag("--network_alpha")))
    assert config["learning_rate"] == float(flag("--learning_rate")) and config["model_type"] == "PIXART_ALPHA"
    assert (config["resolution"], config["batch_size"]) == (flag("--resolution"), int(flag("--train_batch_size")))
    assert config["output_model_format"] == "KOHYA_LORA" and flag("--t5xxl_max_token_length") == "120"
    concepts = json.loads(Path(config["concept_file_name"]).read_text())
    assert config["epochs"] == 1 and [c["balancing"] for c in concepts] == [7] == [int(flag("--max_train_steps"))]
    assert Path(concepts[0]["path"]).parent == Path(flag("--train_data_dir"))


def test_progress_stamps_come_from_updated_and_iterated_bars(tmp_path):
    """The stamp hook: sd-scripts' and ours' "steps" bars call update(); OneTrainer iterates its "step" bar. Each
    step of either writes one stamp; other bars write none."""
    import subprocess

    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(bench_vs_sdscripts.HOOK)
    code = ("from tqdm import tqdm\nfor _ in tqdm(range(3), desc='step'): pass\n"
            "for _ in tqdm(range(4), desc='caching'): pass\nbar = tqdm(total=2, desc='steps')\nbar.update(1)\n"
            "bar.update(1)\nbar.close()\n")  # fmt: skip
    stamps = tmp_path / "stamps.txt"
    env = {"PYTHONPATH": str(tmp_path / "hook"), "BENCH_STAMPS": str(stamps), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    assert [int(line.split()[1]) for line in stamps.read_text().splitlines()] == [1, 2, 3, 1, 2]


def test_sides_alternate_which_runs_first():
    sides = ["sd-scripts", "before", "sdtrain"]
    assert [bench_vs_sdscripts.side_order(sides, p)[0] for p in range(4)] == ["sd-scripts", "sdtrain"] * 2
    assert bench_vs_sdscripts.side_order(sides, 1) == ["sdtrain", "before", "sd-scripts"] and sides[0] == "sd-scripts"
