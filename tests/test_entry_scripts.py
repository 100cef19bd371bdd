"""Every entry script is an importable module with ``main(argv=None) -> int`` (the command line) and ``run(argv)``
(the same work, returning what it made); after ``pip install -e .`` they import from any folder, as a notebook
user's ``import train_network; train_network.main([...])`` does."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def entry_modules() -> list[str]:
    """Every file with a ``__main__`` block at the top level: the root scripts, tools/, finetune/ and networks/."""
    files = [*ROOT.glob("*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("finetune/*.py"), *ROOT.glob("networks/*.py")]
    found = []
    for path in sorted(files):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):
            found.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


ENTRIES = entry_modules()


def test_the_scripts_are_found():
    expected = {"train_network", "sdxl_train_network", "train_textual_inversion", "sdxl_train_textual_inversion",
                "fine_tune", "sdxl_train", "train_db", "gen_img", "tools.convert_model", "tools.cache_latents",
                "finetune.prepare_buckets_latents", "networks.resize_lora", "networks.svd_merge_lora"}  # fmt: skip
    assert expected <= set(ENTRIES)


@pytest.mark.parametrize("name", ENTRIES)
def test_every_entry_script_has_main_argv_and_help_exits_0(name, capsys):
    module = importlib.import_module(name)
    for function in (module.main, module.run):
        params = list(inspect.signature(function).parameters.values())
        assert params and params[0].name == "argv" and params[0].default is None, f"{name}.{function.__name__}"
    assert inspect.signature(module.main).return_annotation in (int, "int"), name
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code in (0, None)
    hooks = [f for f in sys.meta_path if type(f).__module__ == "library.cli.deferred_imports"]
    assert not hooks  # main()'s start-up import hook is gone again
    assert "usage:" in capsys.readouterr().out


def test_main_returns_the_exit_status_of_bad_input(tmp_path, capsys):
    import gen_img
    import train_network

    assert train_network.main(["--pretrained_model_name_or_path", str(tmp_path / "missing")]) == 2
    assert gen_img.main(["--ckpt", str(tmp_path / "missing"), "--prompt", "x", "--outdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 2 and "Traceback" not in err


# script -> the script of the same training type for the other family (sdxl_train.py takes DreamBooth folders too)
SAME_TYPE = {"train_network": "sdxl_train_network.py", "sdxl_train_network": "train_network.py",
             "train_textual_inversion": "sdxl_train_textual_inversion.py",
             "sdxl_train_textual_inversion": "train_textual_inversion.py", "fine_tune": "sdxl_train.py",
             "sdxl_train": "fine_tune.py", "train_db": "sdxl_train.py"}  # fmt: skip


@pytest.mark.parametrize("script", sorted(SAME_TYPE))
def test_a_model_of_the_other_family_names_the_script_of_the_same_training_type(script, tiny_dir, dataset, tmp_path):
    from _scripts import family_of, run_script, script_args

    from library.cli.problems import ConfigError

    other = "sd1" if family_of(script) == "sdxl" else "sdxl"
    with pytest.raises(ConfigError, match=rf"is an {other} model but this script trains \w+; use ") as e:
        run_script(script, script_args(script, tiny_dir / other, dataset, tmp_path / "o"))
    assert str(e.value).rstrip().endswith(f"; use {SAME_TYPE[script]}"), str(e.value)


def _installed() -> bool:
    try:
        importlib.metadata.distribution("sdtrain")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason="sdtrain is not pip-installed in this environment")
def test_importable_and_trains_from_outside_the_clone(tmp_path):
    """A fresh interpreter in another folder, without the clone on its path: every entry module imports (from this
    checkout), and ``train_network.main`` trains the demo LoRA for 2 steps and returns 0."""
    code = f"""
import importlib, sys
import train_network
print("FROM", train_network.__file__, flush=True)  # before the others: an install of another checkout skips
names = {ENTRIES!r}
modules = [importlib.import_module(n) for n in names]
assert all(callable(m.main) and callable(m.run) for m in modules)
sys.exit(train_network.main(["--demo", "--demo_dir", "demo", "--max_train_steps", "2"]))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    origin = next((line[5:] for line in done.stdout.splitlines() if line.startswith("FROM ")), None)
    if origin is not None and Path(origin).resolve().parent != ROOT:
        pytest.skip(f"sdtrain is installed from another checkout ({origin})")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert (tmp_path / "demo" / "output" / "sd1" / "demo_lora.safetensors").exists()
