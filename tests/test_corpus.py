"""Published command lines and dataset TOMLs (tests/corpus/, sources in its README.md) run unchanged on the tiny
models. Only what the tiny setting forces is substituted, by flag name (never by editing the text): model, data,
output and prompt paths; sizes divided by 4 (8 for the SDXL guide's 1024 px); one optimizer step; at most 2 images per batch and 2 accumulated
batches; DataLoader workers 0 (in-process); ``--xformers`` -> ``--sdpa`` on a machine without CUDA.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import torch

import train_network
from library.files.weights import load_state_dict, read_metadata
from library.run.demo import make_example_dataset

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


def _run(script: str, argv: list[str], files: list | None = None):
    families = ("sdxl",) if script.startswith("sdxl_") else ("sd1", "sd2")
    result = train_network.run(argv, family_names=families)
    assert result is not None and result.output.exists() and result.steps == 1 and not result.failed
    assert all(torch.isfinite(torch.tensor(result.losses)))
    if files is not None:
        files.append(load_state_dict(result.output)[0])
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


# sd-scripts' networks/lora.py, typed in: the block of an SD 1.x UNet module (get_block_index: IN01-IN11 = 1-11,
# MID = 12, OUT00-OUT11 = 13-24) and the lr-weight presets (get_block_lr_weight)
RE_UPDOWN = re.compile(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")


def sd_scripts_block(name: str) -> int:
    m = RE_UPDOWN.search(name)
    if m:
        kind, i, part, j = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
        idx = 3 * i + 2 if part in ("upsamplers", "downsamplers") else 3 * i + j
        return 1 + idx if kind == "down" else 13 + idx
    return 12 if "mid_block_" in name else -1


def lr_preset(text: str) -> list[float]:
    name, _, base = text.partition("+")
    base, n = float(base or 0), 12
    curve = {"sine": [math.sin(math.pi * (i / (n - 1)) / 2) for i in range(n)],
             "cosine": [math.sin(math.pi * (i / (n - 1)) / 2) for i in reversed(range(n))]}[name]  # fmt: skip
    return [v + base for v in curve]


def expected_effects(network_args: list[str]) -> dict:
    """What sd-scripts' README says each argument does to the trained file (network_dim 4, alpha 1: the command's
    defaults; conv_alpha defaults to 1; block_alphas to network_alpha)."""
    kw = dict(a.split("=", 1) for a in network_args)
    floats = lambda v: [float(x) for x in v.split(",")]  # noqa: E731
    weights = None
    if any(k.endswith("_lr_weight") for k in kw):
        down = kw.get("down_lr_weight", "1" + ",1" * 11)
        up = kw.get("up_lr_weight", "1" + ",1" * 11)
        down = lr_preset(down) if "," not in down else floats(down)
        up = lr_preset(up) if "," not in up else floats(up)
        mid = floats(kw.get("mid_lr_weight", "1"))
        threshold = float(kw.get("block_lr_zero_threshold", 0))
        weights = [w if w > threshold else 0.0 for w in down + mid + up]  # IN00-IN11, MID, OUT00-OUT11
    return {
        "conv_dim": int(kw["conv_dim"]) if "conv_dim" in kw else None,
        "conv_alpha": float(kw.get("conv_alpha", 1)),
        "block_dims": [0] + [int(v) for v in kw["block_dims"].split(",")][1:] if "block_dims" in kw else None,
        "block_alphas": [0] + floats(kw["block_alphas"])[1:] if "block_alphas" in kw else None,
        "conv_block_dims": [0] + [int(v) for v in kw["conv_block_dims"].split(",")][1:]
        if "conv_block_dims" in kw
        else None,  # fmt: skip
        "lr_weights": weights,
    }


def check_effects(sd: dict, network_args: list[str], base_lr: float = 1e-4) -> None:
    e = expected_effects(network_args)
    modules = {k.rsplit(".", 2)[0] for k in sd if k.endswith("lora_down.weight")}
    unet = {m for m in modules if m.startswith("lora_unet_")}
    conv3 = {m for m in unet if sd[f"{m}.lora_down.weight"].dim() == 4 and sd[f"{m}.lora_down.weight"].shape[-1] == 3}
    if e["conv_dim"] is None and e["conv_block_dims"] is None:
        assert not conv3, sorted(conv3)[:3]  # no 3x3 convolutions without conv_dim
    else:
        assert any("resnets" in m for m in conv3) and any("samplers" in m for m in conv3)
    for m in unet:
        rank, alpha = sd[f"{m}.lora_down.weight"].shape[0], float(sd[f"{m}.alpha"])
        block = sd_scripts_block(m)
        if m in conv3:
            dims = e["conv_block_dims"]
            assert rank == (dims[block] if dims else e["conv_dim"]), m
            assert alpha == (e["block_alphas"][block] if dims and e["block_alphas"] else e["conv_alpha"]), m
        else:
            assert rank == (e["block_dims"][block] if e["block_dims"] else 4), m
            assert alpha == pytest.approx(e["block_alphas"][block] if e["block_alphas"] else 1.0), m
    if e["lr_weights"] is not None:  # one AdamW step moves a zero-initialised lora_up by about its learning rate
        moved: dict[int, float] = {}
        for m in unet:
            b = sd_scripts_block(m)
            moved[b] = max(moved.get(b, 0.0), float(sd[f"{m}.lora_up.weight"].float().abs().max()))
        assert all(e["lr_weights"][b] > 0 for b in moved)  # blocks at learning rate 0 get no module
        for b, largest in moved.items():
            assert largest == pytest.approx(base_lr * e["lr_weights"][b], rel=0.05), (b, largest)
        assert len({round(v / base_lr, 2) for v in moved.values()}) > 1  # the blocks did move at different rates


@pytest.mark.parametrize("line", NETWORK_ARGS, ids=[f"network_args{i}" for i in range(len(NETWORK_ARGS))])
def test_train_network_readme_network_args(tiny_dir, corpus_data, tmp_path, line):
    """Each README line does what the README says to the trained file: conv modules and their ranks/alphas, ranks
    and alphas per block, learning rates per block (one AdamW step moves each block by its rate)."""
    script, argv = _readme_command(tiny_dir, corpus_data, tmp_path)
    files: list = []
    _run(script, argv + shlex.split(line), files)
    check_effects(files[0], shlex.split(line)[1:])


@pytest.mark.parametrize("toml", ["network_args_readme.toml", "network_args_block_dims_readme.toml"])
def test_train_network_readme_network_args_in_a_config_file(tiny_dir, corpus_data, tmp_path, toml):
    import toml as toml_reader

    script, argv = _readme_command(tiny_dir, corpus_data, tmp_path)
    files: list = []
    _run(script, argv + ["--config_file", str(CORPUS / toml)], files)
    check_effects(files[0], toml_reader.load(CORPUS / toml)["network_args"])
