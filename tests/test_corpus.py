"""Published command lines and dataset TOMLs (tests/corpus/, sources in its README.md) run unchanged on the tiny
models. Only what the tiny setting forces is substituted, by flag name (never by editing the text): model, data,
output and prompt paths; sizes divided by 4 (8 for the SDXL guide's 1024 px); one optimizer step; at most 2 images per batch and 2 accumulated
batches; DataLoader workers 0 (in-process); ``--xformers`` -> ``--sdpa`` on a machine without CUDA.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

import train_network
from library.demo import make_example_dataset
from library.weight_files import read_metadata

CORPUS = Path(__file__).resolve().parent / "corpus"
SIZE_FLAGS = ("resolution", "min_bucket_reso", "max_bucket_reso", "skip_image_resolution")
CAPS = {"train_batch_size": 2, "gradient_accumulation_steps": 2}
PLACEHOLDER_ONLY = {"output_name"}  # kept as published unless the document leaves it as <...>
FIXED = {"max_train_steps": "1", "max_train_epochs": "1", "max_data_loader_n_workers": "0"}


def read_command(path: Path) -> tuple[str, list[str]]:
    """(script name, its arguments) from a shell command as published (``\\`` continuations or one flag a line;
    ``<placeholder>`` values become one token); the launcher before the script is dropped."""
    text = re.sub(r"<[^>]*>", "PLACEHOLDER", path.read_text()).replace("\\\n", " ")
    tokens = shlex.split(text)
    i = next(i for i, t in enumerate(tokens) if t.endswith(".py"))
    return Path(tokens[i]).name, tokens[i + 1 :]


def _groups(argv: list[str]) -> list[list[str]]:
    out: list[list[str]] = []
    for token in argv:
        if token.startswith("--"):
            out.append(token.split("=", 1))
        else:
            out[-1].append(token)
    return out


def for_tiny(argv: list[str], paths: dict[str, str], shrink: int = 4) -> list[str]:
    """The substitutions of the module docstring, applied by flag name."""
    out = []
    for flag, *values in _groups(argv):
        name = flag[2:]
        if name in paths and (name not in PLACEHOLDER_ONLY or values == ["PLACEHOLDER"]):
            values = [paths[name]]
        elif name in SIZE_FLAGS:
            values = [",".join(str(int(v) // shrink) for v in values[0].split(","))]
        elif name in CAPS:
            values = [str(min(int(values[0]), CAPS[name]))]
        elif name in FIXED:
            values = [FIXED[name]]
        elif name == "xformers" and not torch.cuda.is_available():
            flag = "--sdpa"
        out += [flag, *values]
    return out


def dataset_toml_for_tiny(text: str, folders: dict[str, str]) -> str:
    """A published dataset TOML with its folders replaced and its sizes / batch sizes cut as for_tiny does."""
    for name, path in folders.items():
        text = text.replace(f"'C:\\{name}'", repr(path))
    text = text.replace("'C:\\piyo\\piyo_md.json'", repr(str(Path(folders["piyo"]) / "piyo_md.json")))

    def sizes(m: re.Match) -> str:
        return m.group(1) + re.sub(r"\d+", lambda n: str(int(n.group()) // 4), m.group(2))

    text = re.sub(rf"^(\s*(?:{'|'.join(SIZE_FLAGS)})\s*=\s*)(.+)$", sizes, text, flags=re.M)
    return re.sub(
        r"^(\s*batch_size\s*=\s*)(\d+)", lambda m: m.group(1) + str(min(2, int(m.group(2)))), text, flags=re.M
    )


@pytest.fixture(scope="module")
def corpus_data(tmp_path_factory):
    """The demo's four images in the layouts the corpus expects: <repeats>_<class> folders, plain image folders
    (hoge, fuga, reg) and a fine-tune folder with its metadata JSON (piyo)."""
    root = tmp_path_factory.mktemp("corpus_data")
    make_example_dataset(root / "train")
    shapes = sorted((root / "train" / "10_sks shape").glob("*.png"))
    folders = {}
    for name in ("hoge", "fuga", "reg", "piyo"):
        folder = root / name
        folder.mkdir()
        for png in shapes:
            (folder / png.name).write_bytes(png.read_bytes())
            if name != "piyo":
                (folder / png.with_suffix(".txt").name).write_text(png.with_suffix(".txt").read_text())
        folders[name] = str(folder)
    meta = {p.stem: {"caption": p.with_suffix(".txt").read_text().strip()} for p in shapes}
    (root / "piyo" / "piyo_md.json").write_text(json.dumps(meta))
    (root / "prompts.txt").write_text("sks shape, a red circle --w 64 --h 64 --s 2\n")
    return root, folders


def _run(script: str, argv: list[str]):
    families = ("sdxl",) if script.startswith("sdxl_") else ("sd1", "sd2")
    result = train_network.run(argv, family_names=families)
    assert result is not None and result.output.exists() and result.steps == 1 and not result.failed
    assert all(torch.isfinite(torch.tensor(result.losses)))
    return read_metadata(result.output)


def _paths(tiny_dir, corpus_data, tmp_path, family: str, dataset_config: str | None = None) -> dict[str, str]:
    root, _ = corpus_data
    paths = {
        "pretrained_model_name_or_path": str(tiny_dir / family),
        "train_data_dir": str(root / "train"),
        "output_dir": str(tmp_path / "out"),
        "output_name": "corpus",
        "sample_prompts": str(root / "prompts.txt"),
        "logging_dir": str(tmp_path / "logs"),
    }
    if dataset_config:
        paths["dataset_config"] = dataset_config
    return paths


def test_guide_sdxl_locon_command(tiny_dir, corpus_data, tmp_path, caplog):
    """The LoRA guide's full sdxl_train_network.py command (seed 004): --dataset_repeats=0, LyCORIS locon with
    conv_dim=256 (above some layers' width), --network_dim 8, fp16, latents cached to disk, multires noise."""
    script, argv = read_command(CORPUS / "guide_sdxl_locon.sh")
    assert script == "sdxl_train_network.py" and "--dataset_repeats=0" in argv
    with caplog.at_level("INFO"):
        meta = _run(script, for_tiny(argv, _paths(tiny_dir, corpus_data, tmp_path, "sdxl"), shrink=8))
    assert meta["ss_network_module"] == "lycoris.kohya" and meta["ss_network_dim"] == "8"
    assert (tmp_path / "out" / "yifftoolkit.safetensors").exists()  # --output_name kept as published
    assert any("conv_dim 256 is above the width of" in r.getMessage() for r in caplog.records)


def _readme_command(tiny_dir, corpus_data, tmp_path, dataset_toml: str = "config_readme_example.toml"):
    _, folders = corpus_data
    toml = tmp_path / "dataset.toml"
    toml.write_text(dataset_toml_for_tiny((CORPUS / dataset_toml).read_text(), folders))
    script, argv = read_command(CORPUS / "train_network_readme.sh")
    return script, for_tiny(argv, _paths(tiny_dir, corpus_data, tmp_path, "sd1", str(toml)))


@pytest.mark.parametrize(
    "dataset_toml",
    ["config_readme_example.toml", "config_readme_two_resolutions.toml", "config_readme_skip_image_resolution.toml"],
)
def test_train_network_readme_command_with_config_readme_datasets(tiny_dir, corpus_data, tmp_path, dataset_toml):
    script, argv = _readme_command(tiny_dir, corpus_data, tmp_path, dataset_toml)
    meta = _run(script, argv)
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_optimizer"].startswith("bitsandbytes")


NETWORK_ARGS = [line for line in (CORPUS / "network_args_readme.txt").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("line", NETWORK_ARGS, ids=[f"network_args{i}" for i in range(len(NETWORK_ARGS))])
def test_train_network_readme_network_args(tiny_dir, corpus_data, tmp_path, line):
    script, argv = _readme_command(tiny_dir, corpus_data, tmp_path)
    _run(script, argv + shlex.split(line))


@pytest.mark.parametrize("toml", ["network_args_readme.toml", "network_args_block_dims_readme.toml"])
def test_train_network_readme_network_args_in_a_config_file(tiny_dir, corpus_data, tmp_path, toml):
    script, argv = _readme_command(tiny_dir, corpus_data, tmp_path)
    _run(script, argv + ["--config_file", str(CORPUS / toml)])
