"""lumina_train.py (full fine-tuning) on tiny Lumina 2 files: the file it writes has the input Alpha-VLLM file's
keys and shapes (sd-scripts' NextDiT state dict, what ComfyUI loads by its key rule) and reads back through our
loader equal to the trained weights; diffusers' ``Lumina2Transformer2DModel.from_pretrained`` reads the diffusers
output equal too; the held-out loss falls; ``--save_state`` + ``--resume`` repeats the uninterrupted run bit for bit;
``--mem_eff_save`` writes the same tensors."""

from __future__ import annotations

import pytest
import torch
from _lumina_helpers import write_layouts
from _train_helpers import write_dataset_toml

import lumina_train
from library.families.lumina import LUMINA2
from library.families.lumina.options import LuminaOptions
from library.families.lumina.tiny import build_tiny_lumina
from library.files.weights import load_state_dict, read_metadata


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return write_layouts(build_tiny_lumina(seed=0), tmp_path_factory.mktemp("lumina_ft"))


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "dataset.toml")


def command(files, toml, out, *extra, steps=3) -> list[str]:
    return ["--pretrained_model_name_or_path", files["model"], "--gemma2", files["gemma2"], "--ae", files["ae"],
            "--dataset_config", str(toml), "--output_dir", str(out), "--output_name", "lumina_ft",
            "--learning_rate", "1e-3", "--timestep_sampling", "nextdit_shift", "--max_train_steps", str(steps),
            "--max_data_loader_n_workers", "0", "--seed", "1", "--cache_latents", "--cache_text_encoder_outputs",
            *extra]  # fmt: skip


def trained(result) -> dict[str, torch.Tensor]:
    state = load_state_dict(result.state / "trained.safetensors")[0]
    return {k[len("unet.") :]: v for k, v in state.items() if k.startswith("unet.")}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def test_the_alpha_vllm_file_reads_back_in_both_readers(layouts, dataset_toml, tmp_path):
    result = lumina_train.run(command(layouts, dataset_toml, tmp_path, "--save_state_on_train_end",
                                      "--save_model_as", "safetensors"))  # fmt: skip
    assert result.steps == 3 and result.output.name == "lumina_ft.safetensors" and not result.failed
    out, source = load_state_dict(result.output)[0], load_state_dict(layouts["model"])[0]
    assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in source.items()}
    assert read_metadata(result.output)["modelspec.architecture"] == "lumina-2"
    ours = LUMINA2.load(result.output, options=LuminaOptions(gemma2=layouts["gemma2"], ae=layouts["ae"]))
    assert_same(trained(result), ours.denoiser.state_dict())
    assert sum(not torch.equal(out[k], source[k]) for k in source) > len(source) // 2


def test_the_docs_fine_tune_line_runs_on_comfyuis_all_in_one_file(layouts, dataset_toml, tmp_path):
    """sd-scripts' docs/fine_tune.md Lumina line (``accelerate launch --mixed_precision bf16 lumina_train.py
    --pretrained_model_name_or_path ... --dataset_config ... --output_dir ... --output_name lumina_finetuned
    --learning_rate 1e-5``) with the tiny all-in-one file (Gemma and the AE inside it, so no --gemma2 / --ae), 2 steps
    (its default is 1600): the transformer is written under Alpha-VLLM names without the file's prefix."""
    argv = ["--mixed_precision", "bf16", "--pretrained_model_name_or_path", layouts["allinone"], "--dataset_config",
            str(dataset_toml), "--output_dir", str(tmp_path), "--output_name", "lumina_finetuned", "--learning_rate",
            "1e-5", "--max_train_steps", "2", "--max_data_loader_n_workers", "0"]  # fmt: skip
    result = lumina_train.run(argv)
    assert result.steps == 2 and result.output.name == "lumina_finetuned.safetensors"
    out, source = load_state_dict(result.output)[0], load_state_dict(layouts["model"])[0]
    assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in source.items()}


def test_held_out_loss_falls_and_diffusers_reads_the_folder(layouts, dataset_toml, tmp_path):
    from diffusers import Lumina2Transformer2DModel

    argv = [
        *command(layouts, dataset_toml, tmp_path, steps=10),
        "--validation_split",
        "0.25",
        "--validate_every_n_steps",
        "5",
        "--save_model_as",
        "diffusers_safetensors",
        "--save_state_on_train_end",
    ]
    result = lumina_train.run(argv)
    values = [v for _, v in result.validation]
    assert len(values) == 2 and values[-1] < values[0], values
    theirs = Lumina2Transformer2DModel.from_pretrained(result.output, subfolder="transformer")
    assert_same(trained(result), theirs.state_dict())


def test_resume_repeats_the_uninterrupted_run(layouts, dataset_toml, tmp_path):
    full = lumina_train.run(command(layouts, dataset_toml, tmp_path / "full", "--save_state_on_train_end", steps=4))
    half = command(layouts, dataset_toml, tmp_path / "half", "--save_state", "--save_every_n_steps", "2", steps=2)
    first = lumina_train.run(half)
    resumed = lumina_train.run([*command(layouts, dataset_toml, tmp_path / "half", "--save_state_on_train_end",
                                         steps=4), "--resume", str(first.state)])  # fmt: skip
    assert resumed.losses == full.losses and first.losses == full.losses[:2] and first.state.is_dir()
    assert_same(trained(full), trained(resumed))


def test_mem_eff_save_writes_the_same_tensors(layouts, dataset_toml, tmp_path):
    a = lumina_train.run(command(layouts, dataset_toml, tmp_path / "a", steps=1))
    b = lumina_train.run(command(layouts, dataset_toml, tmp_path / "b", "--mem_eff_save", steps=1))
    assert_same(load_state_dict(a.output)[0], load_state_dict(b.output)[0])
