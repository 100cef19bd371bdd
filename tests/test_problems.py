"""One way to report problems (library/cli/problems.py) and one home per flag (library/run/args.py defines none).

A run with problems in several groups (dataset file, network args, optimizer args, noise, EMA, a flag of the
config file) gets one message listing each problem once, as its reader wrote it; entry scripts print it as
``error: ...`` and exit 2."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import train_network
from library.cli.parse import parse_args
from library.cli.problems import ConfigError, Problems, did_you_mean, first, problems_of
from library.run.config import read_config

ROOT = Path(__file__).resolve().parents[1]


def test_format_cut_and_suggestions():
    e = ConfigError([f"p{i}" for i in range(7)], "adapter file", limit=5)
    assert str(e) == "7 problems in the adapter file:\n  p0\n  p1\n  p2\n  p3\n  p4\n  ... and 2 more"
    assert e.problems == [f"p{i}" for i in range(7)]  # the cut is only in the text
    assert str(ConfigError(["only"])) == "1 problem in the configuration:\n  only"
    assert str(ConfigError(["a"], "adapter files", hint="use svd_merge_lora.py")) == (
        "1 problem in the adapter files:\n  a\nuse svd_merge_lora.py"
    )
    assert first(["a.png", "b.png", "c.png"], 2, ", ", " and {n} more") == "a.png, b.png and 1 more"
    assert first(["a", "b"], 2, ", ") == "a, b"
    assert did_you_mean("learnig_rate", ["learning_rate", "seed"]) == "; did you mean 'learning_rate'?"
    assert did_you_mean("zzz", ["learning_rate"], otherwise="known: learning_rate") == "; known: learning_rate"
    assert did_you_mean("zzz", ["learning_rate"]) == ""
    assert did_you_mean("ADAMW", ["AdamW", "AdamW8bit"], form=" ({})", n=3, ignore_case=True) == (
        " (did you mean 'AdamW' or 'AdamW8bit'?)"
    )
    assert did_you_mean("ww", ["w", "h"], show="--{}".format) == "; did you mean --w?"


def test_problems_collects_readers_and_keeps_other_errors_out():
    problems = Problems("dataset configuration")

    def bad(n):
        raise ConfigError([f"x{i}" for i in range(n)], "something else")

    assert problems.read(bad, 2) is None
    assert problems.read(lambda: 5) == 5
    problems.error("f.toml: general.k", "unknown key")
    assert problems.errors == ["x0", "x1", "f.toml: general.k: unknown key"]
    with pytest.raises(ConfigError) as e:
        problems.raise_if_any()
    assert str(e.value).startswith("3 problems in the dataset configuration:\n  x0\n")
    with pytest.raises(TypeError):  # not an input problem: never swallowed
        Problems().read(lambda: None + 1)
    assert problems_of(ValueError("one line")) == ["one line"]


def test_one_message_lists_every_group_s_problems(tiny_dir, dataset, tmp_path):
    """Problems of six readers come back as the readers wrote them: no header line of one reader inside another's
    list, no "- " bullets, each problem once."""
    toml = tmp_path / "d.toml"
    toml.write_text(f'[general]\nshufle_caption = true\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{dataset}"\n')
    argv = ["--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--dataset_config", str(toml),
            "--output_dir", str(tmp_path / "out"), "--network_module", "networks.lora",
            "--network_args", "conv_dimm=4", "--optimizer_args", "betta=0.9", "--noise_offset", "-1",
            "--ema", "--ema_decay", "2", "--resolution", "64,64,64,64"]  # fmt: skip
    args = parse_args(train_network.build_parser(), argv)
    with pytest.raises(ConfigError) as e:
        read_config(args, ("sd1", "sd2"), train_network.AdapterMethod.from_args)
    found = e.value.problems
    expected = [
        "--noise_offset must be >= 0",
        "--network_args conv_dimm: unknown argument; did you mean 'conv_dim'?",
        "has no argument 'betta' (did you mean 'betas'?)",
        "--ema_decay must be in (0, 1), got 2.0",
        f'{toml}: general.shufle_caption: unknown key; did you mean "shuffle_caption"?',
    ]
    for text in expected:
        assert sum(text in p for p in found) == 1, (text, found)
    assert not any(re.match(r"\d+ problems? in the", p) or p.startswith(("- ", " ")) for p in found), found
    assert str(e.value).startswith(f"{len(found)} problems in the configuration:\n  ")


def test_the_entry_script_prints_one_error_and_exits_2(tiny_dir, tmp_path, capsys):
    argv = ["--pretrained_model_name_or_path", str(tiny_dir / "sd1"), "--network_module", "networks.lora",
            "--output_dir", str(tmp_path), "--noise_offset", "-1", "--clip_skip", "0"]  # fmt: skip
    assert train_network.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 problems in the configuration:") and "Traceback" not in err
    assert "--noise_offset must be >= 0" in err and "--clip_skip must be >= 1" in err and "no dataset" in err


# ----------------------------------------------------------------------------------------------------- flags
def _reading_source() -> str:
    """library/, networks/ and the training scripts without the functions that define flags (``add_*`` /
    ``_add_*``): what is left reads the flags."""
    files = [*(ROOT / "library").rglob("*.py"), *(ROOT / "networks").rglob("*.py")]
    files += [ROOT / f for f in ("train_network.py", "train_textual_inversion.py", "fine_tune.py")]
    out = []
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and re.match(r"_?add_", node.name):
                lines[node.lineno - 1 : node.end_lineno] = [""] * (node.end_lineno - node.lineno + 1)
        out.append("\n".join(lines))
    return "\n".join(out)


SCRIPTS = {
    "train_network": lambda: train_network.build_parser(),
    "train_textual_inversion": lambda: __import__("train_textual_inversion").build_parser(),
    **{s: (lambda s=s: __import__(s).build_parser()) for s in ("fine_tune", "sdxl_train", "train_db")},
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_sd_scripts_flag_is_read_outside_its_definition_or_refused(script):
    """Flags live next to their readers now, so "the name appears in the source" must not count the line that
    defines the flag: every accepted flag is read by code other than its ``add_*_args`` function."""
    from library.run.run_files import METADATA_NAMES

    flags = json.loads((ROOT / "tests" / "data" / f"sd_scripts_{script}_flags.json").read_text())
    actions = {opt: a for a in SCRIPTS[script]()._actions for opt in a.option_strings}
    source = _reading_source()
    unread = [
        flag
        for flag in flags
        if not hasattr(actions[flag], "unsupported_reason")
        and actions[flag].dest not in {f"metadata_{n}" for n in METADATA_NAMES}
        and re.search(rf"\b{actions[flag].dest}\b", source) is None
    ]
    assert not unread, f"{script}: flags accepted but read nowhere: {unread}"


def test_args_defines_no_flag_and_no_tool_imports_an_entry_script():
    tree = ast.parse((ROOT / "library" / "run" / "args.py").read_text())
    calls = [n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert "add_argument" not in calls and "add_argument_group" not in calls
    scripts = {p.stem for p in ROOT.glob("*.py")}
    for path in [*(ROOT / "tools").glob("*.py"), *(ROOT / "networks").glob("*.py"), *(ROOT / "library").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not set(names) & scripts, f"{path.relative_to(ROOT)} imports an entry script: {names}"
