"""The tiny Z-Image files the Z-Image tests share: written once per session from ``ZIMAGE.tiny.build(seed=0)``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def zimage_files(tmp_path_factory) -> dict:
    """{"parts": the tiny model, "dit" (original / ComfyUI names, fused qkv), "text_encoder" (model.-prefixed,
    ComfyUI's layout), "vae" (BFL names), "root": their folder}."""
    from library.families.zimage import ZIMAGE

    root = tmp_path_factory.mktemp("zimage_tiny")
    parts = ZIMAGE.tiny.build(seed=0)
    files = {k: str(v) for k, v in ZIMAGE.tiny.write_files(parts, root, "tiny").items()}
    return {"parts": parts, "root": Path(root), **files}


def musubi_toml(dataset: Path, path: Path, extra: str = "") -> Path:
    """musubi-tuner's dataset config (docs/dataset_config.md's image example) over the demo's images, 64 px."""
    path.write_text(f'[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\nbatch_size = 2\nenable_bucket = true\n'
                    f'bucket_no_upscale = false\n\n[[datasets]]\nimage_directory = "{(dataset / "10_sks shape").as_posix()}"\n'
                    f'cache_directory = "{(path.parent / "cache").as_posix()}"\nnum_repeats = 1\n{extra}')  # fmt: skip
    return path


def doc_command(files: dict, toml: Path, out: Path, *extra: str) -> list[str]:
    """musubi-tuner's docs/zimage.md LoRA line with the tiny files (1 epoch, loader workers 0 for the test)."""
    return ["--dit", files["dit"], "--vae", files["vae"], "--text_encoder", files["text_encoder"],
            "--dataset_config", str(toml), "--sdpa", "--mixed_precision", "bf16",
            "--timestep_sampling", "shift", "--weighting_scheme", "none", "--discrete_flow_shift", "2.0",
            "--optimizer_type", "adamw8bit", "--learning_rate", "1e-4", "--gradient_checkpointing",
            "--max_data_loader_n_workers", "0", "--persistent_data_loader_workers", "--network_module",
            "networks.lora_zimage", "--network_dim", "32", "--max_train_epochs", "1", "--save_every_n_epochs", "1",
            "--seed", "42", "--output_dir", str(out), "--output_name", "my-lora", *extra]  # fmt: skip
