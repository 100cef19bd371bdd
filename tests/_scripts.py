"""Every training script's command line on the tiny models, for the tests that run each of them the same way."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from _token_helpers import TOKEN

import fine_tune
import sdxl_train
import sdxl_train_network
import sdxl_train_textual_inversion
import train_db
import train_network
import train_textual_inversion

# script -> (family, run function, the flags of what it trains)
SCRIPTS: dict[str, tuple[str, Callable, list[str]]] = {
    "train_network": ("sd1", train_network.run, ["--network_module", "networks.lora", "--network_dim", "4",
                                                 "--network_alpha", "2"]),
    "sdxl_train_network": ("sdxl", sdxl_train_network.run, ["--network_module", "networks.lora", "--network_dim",
                                                            "4", "--network_alpha", "2"]),
    "train_textual_inversion": ("sd1", train_textual_inversion.run, ["--token_string", TOKEN, "--init_word", "shape",
                                                                     "--num_vectors_per_token", "2"]),
    "sdxl_train_textual_inversion": ("sdxl", sdxl_train_textual_inversion.run, ["--token_string", TOKEN,
                                                                               "--init_word", "shape"]),
    "fine_tune": ("sd1", fine_tune.run, ["--train_text_encoder"]),
    "sdxl_train": ("sdxl", sdxl_train.run, []),
    "train_db": ("sd1", train_db.run, []),
}  # fmt: skip


def script_args(script: str, model: Path, data: Path, out: Path, *extra: str, steps: int = 2) -> list[str]:
    """The script's command line: ``model`` (a tiny model folder), ``data`` (a train_data_dir), 64 px, batch 1."""
    return [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension", ".txt",
        "--resolution", "64", "--output_dir", str(out), "--output_name", "t", "--learning_rate", "1e-3",
        "--train_batch_size", "1", "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0",
        "--seed", "1", *SCRIPTS[script][2], *extra,
    ]  # fmt: skip


def run_script(script: str, argv: Sequence[str]):
    return SCRIPTS[script][1](list(argv))


def family_of(script: str) -> str:
    return SCRIPTS[script][0]
