"""musubi-tuner's dataset TOML and its documented Qwen-Image LoRA command line over the tiny files, shared by the
Qwen-Image tests."""

from __future__ import annotations

from pathlib import Path


def musubi_toml(dataset: Path, path: Path, extra: str = "") -> Path:
    """musubi-tuner's dataset config (docs/dataset_config.md's image example) over the demo's images, 64 px."""
    path.write_text(f'[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\nbatch_size = 2\nenable_bucket = true\n'
                    f'bucket_no_upscale = false\n\n[[datasets]]\nimage_directory = "{(dataset / "10_sks shape").as_posix()}"\n'
                    f'cache_directory = "{(path.parent / "cache").as_posix()}"\nnum_repeats = 1\n{extra}')  # fmt: skip
    return path


def doc_command(files, toml, out, *extra):
    """musubi-tuner's docs/qwen_image.md LoRA line with the tiny files (1 epoch, loader workers 0 for the test)."""
    return ["--dit", files["dit"], "--vae", files["vae"], "--text_encoder", files["text_encoder"],
            "--model_version", "original", "--dataset_config", str(toml), "--sdpa", "--mixed_precision", "bf16",
            "--timestep_sampling", "shift", "--weighting_scheme", "none", "--discrete_flow_shift", "2.2",
            "--optimizer_type", "adamw8bit", "--learning_rate", "5e-5", "--gradient_checkpointing",
            "--max_data_loader_n_workers", "0", "--persistent_data_loader_workers", "--network_module",
            "networks.lora_qwen_image", "--network_dim", "16", "--max_train_epochs", "1", "--save_every_n_epochs", "1",
            "--seed", "42", "--output_dir", str(out), "--output_name", "my-lora", *extra]  # fmt: skip
