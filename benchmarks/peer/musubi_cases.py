"""bench_vs_sdscripts.py's cases for the families kohya-ss/musubi-tuner trains (the reference there, not sd-scripts).

musubi-tuner caches latents and text-encoder outputs with its own scripts from a dataset TOML before training; each
run here does the same on each side (musubi-tuner's caching scripts, or ours of the same names and command lines)
into the run's own cache folder, untimed, then times the training script alone. Both sides get the same tiny single
files (benchmarks/peer/tiny_families.py under ``ASSETS/models/<folder>``), the same 8 images at 64 px, batch 1, and
the same flags: LoRA dim 4 alpha 2 with the family's ``networks.lora_<family>``, AdamW lr 1e-4, seed 1, ``--sdpa``,
``--mixed_precision bf16`` (musubi-tuner trains these DiTs in bfloat16 whatever the flag says), no loader workers.
musubi-tuner runs unmodified through run_reference_tiny.py, which puts the tiny sizes of the ``tiny_config.json``
beside the model files in place of its hard-coded released configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

COMMON = ["--network_dim", "4", "--network_alpha", "2", "--seed", "1", "--sdpa", "--mixed_precision", "bf16",
          "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--max_data_loader_n_workers", "0"]  # fmt: skip


@dataclass(frozen=True)
class MusubiCase:
    train: str  # the training script (ours at the checkout root, musubi-tuner's under src/musubi_tuner)
    folder: str  # under ASSETS/models, written by tiny_families.py's builder of the same family
    family: str
    caches: tuple[tuple[str, tuple[str, ...]], ...]  # (caching script, its flags; file names in the folder)
    files: tuple[tuple[str, str], ...]  # the training script's (flag, file name in the folder)
    flags: tuple[str, ...]
    control: str | None = None  # the dataset's control_directory, a folder in the model folder (edit models)


MUSUBI_CASES = {
    "qwen_image": MusubiCase("qwen_image_train_network.py", "tiny-qwen_image", "qwen_image",
                             (("qwen_image_cache_latents.py", ("--vae", "tiny_vae.safetensors")),
                              ("qwen_image_cache_text_encoder_outputs.py",
                               ("--text_encoder", "tiny_te.safetensors", "--batch_size", "1"))),
                             (("--dit", "tiny_dit.safetensors"), ("--vae", "tiny_vae.safetensors"),
                              ("--text_encoder", "tiny_te.safetensors")),
                             ("--network_module", "networks.lora_qwen_image", "--timestep_sampling", "shift",
                              "--discrete_flow_shift", "2.2", "--weighting_scheme", "none")),
    "zimage": MusubiCase("zimage_train_network.py", "tiny-zimage", "zimage",
                         (("zimage_cache_latents.py", ("--vae", "tiny_vae.safetensors")),
                          ("zimage_cache_text_encoder_outputs.py",
                           ("--text_encoder", "tiny_te.safetensors", "--batch_size", "1"))),
                         (("--dit", "tiny_dit.safetensors"), ("--vae", "tiny_vae.safetensors"),
                          ("--text_encoder", "tiny_te.safetensors")),
                         ("--network_module", "networks.lora_zimage", "--timestep_sampling", "shift",
                          "--discrete_flow_shift", "2.0", "--weighting_scheme", "none")),
    "flux2": MusubiCase("flux_2_train_network.py", "tiny-flux2", "flux2",
                        (("flux_2_cache_latents.py", ("--vae", "tiny_ae.safetensors", "--model_version",
                                                      "klein-base-4b")),
                         ("flux_2_cache_text_encoder_outputs.py",
                          ("--text_encoder", "tiny_te-00001-of-00002.safetensors", "--batch_size", "1",
                           "--model_version", "klein-base-4b"))),
                        (("--dit", "tiny-base_dit.safetensors"), ("--vae", "tiny_ae.safetensors"),
                         ("--text_encoder", "tiny_te-00001-of-00002.safetensors")),
                        ("--model_version", "klein-base-4b", "--network_module", "networks.lora_flux_2",
                         "--timestep_sampling", "shift", "--discrete_flow_shift", "2.0", "--weighting_scheme", "none")),
    "qwen_image_edit": MusubiCase("qwen_image_train_network.py", "tiny-qwen_image_edit", "qwen_image_edit",
                                  (("qwen_image_cache_latents.py", ("--vae", "tiny_vae.safetensors", "--edit")),
                                   ("qwen_image_cache_text_encoder_outputs.py",
                                    ("--text_encoder", "tiny_te.safetensors", "--batch_size", "1", "--edit"))),
                                  (("--dit", "tiny_edit_dit.safetensors"), ("--vae", "tiny_vae.safetensors"),
                                   ("--text_encoder", "tiny_te.safetensors")),
                                  ("--edit", "--network_module", "networks.lora_qwen_image", "--timestep_sampling",
                                   "shift", "--discrete_flow_shift", "2.2", "--weighting_scheme", "none"), "control"),
    "flux2_dev": MusubiCase("flux_2_train_network.py", "tiny-flux2_dev", "flux2_dev",
                            (("flux_2_cache_latents.py", ("--vae", "tiny_ae.safetensors", "--model_version", "dev")),
                             ("flux_2_cache_text_encoder_outputs.py",
                              ("--text_encoder", "text_encoder/model-00001-of-00002.safetensors", "--batch_size", "1",
                               "--model_version", "dev"))),
                            (("--dit", "tiny_dev_dit.safetensors"), ("--vae", "tiny_ae.safetensors"),
                             ("--text_encoder", "text_encoder/model-00001-of-00002.safetensors")),
                            ("--model_version", "dev", "--network_module", "networks.lora_flux_2",
                             "--timestep_sampling", "shift", "--discrete_flow_shift", "2.0", "--weighting_scheme", "none")),
}  # fmt: skip


def write_dataset_toml(path: Path, images: Path, cache: Path, control: Path | None = None) -> Path:
    """The run's dataset config: the shared images, 64 px, batch 1, the run's own cache folder (and ``control``: the
    edit models' control images, one per image of the same name)."""
    extra = f'control_directory = "{control.as_posix()}"\n' if control else ""
    path.write_text(f'[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\nbatch_size = 1\n'
                    f'enable_bucket = false\n\n[[datasets]]\nimage_directory = "{images.as_posix()}"\n'
                    f'cache_directory = "{cache.as_posix()}"\nnum_repeats = 1\n{extra}')  # fmt: skip
    return path


def control_folder(name: str, models: Path) -> Path | None:
    case = MUSUBI_CASES[name]
    return models / case.folder / case.control if case.control else None


def _in_folder(case: MusubiCase, models: Path, flags: tuple[str, ...]) -> list[str]:
    """``flags`` with every ``*.safetensors`` value made a path in the case's model folder."""
    return [str(models / case.folder / f) if f.endswith(".safetensors") else f for f in flags]


def cache_commands(name: str, models: Path, toml: Path) -> list[list[str]]:
    """Each caching step as ``[script, flags...]`` (the caller prefixes the side's python and wrapper)."""
    case = MUSUBI_CASES[name]
    return [[script, "--dataset_config", str(toml), *_in_folder(case, models, flags)] for script, flags in case.caches]


def train_flags(name: str, models: Path, toml: Path, steps: int, out: Path) -> list[str]:
    case = MUSUBI_CASES[name]
    files = [x for flag, f in case.files for x in (flag, str(models / case.folder / f))]
    return files + list(case.flags) + COMMON + ["--dataset_config", str(toml), "--max_train_steps", str(steps),
                                                "--output_dir", str(out), "--output_name", "lora"]  # fmt: skip
