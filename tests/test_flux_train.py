"""flux_train.py end to end on a tiny FLUX.1-dev (11 double + 20 single blocks, width 32, so that sd-scripts'
``--blocks_to_swap 18`` fits): sd-scripts' docs/fine_tune.md FLUX command line runs; the BFL file it writes has the
input's keys and shapes and reads back through our loader (whose BFL map equals diffusers' single-file converter at
the released width: tests/test_flux_family.py; diffusers' converter hard-codes width 3072, so it cannot read a tiny
file) equal to the trained weights; a diffusers folder output reads back through ``from_pretrained`` equal to them;
the held-out loss falls. Oracles for the memory options, each on the same draws: block swapping
gives the weights of the run without it (ordinary and fused steps); ``--fused_backward_pass`` (Adafactor, a step per
parameter in backward) and ``--blockwise_fused_optimizers`` (a step per block) give the ordinary Adafactor step's;
``--save_state`` + ``--resume`` repeats the uninterrupted run; ``--mem_eff_save`` writes the same tensors."""

from __future__ import annotations

import pytest
import torch
from _train_helpers import write_dataset_toml

import flux_train
from library.families import get_family
from library.families.flux.keys import diffusers_to_bfl
from library.families.flux.options import FluxOptions
from library.families.flux.tiny import build_tiny_flux, write_tiny_files
from library.files.weights import load_state_dict, read_metadata
from library.run.block_swap import BlockSwap

ADAFACTOR = ["--optimizer_type", "adafactor", "--optimizer_args", "relative_step=False", "scale_parameter=False",
             "warmup_init=False"]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """BFL single files with --clip_l --t5xxl --ae, and a diffusers folder (the config diffusers reads)."""
    root = tmp_path_factory.mktemp("flux_ft_model")
    parts = build_tiny_flux("flux-dev", seed=0, blocks=(11, 20))
    files = {k: str(v) for k, v in write_tiny_files(parts, root / "files").items()}
    files["folder"] = str(get_family("flux-dev").save(parts, root / "folder"))
    return files


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "dataset.toml")


def doc_command(model, toml, out, *extra, steps=3) -> list[str]:
    """sd-scripts' docs/fine_tune.md FLUX line (``--pretrained_model_name_or_path --dataset_config --output_dir
    --output_name flux1_finetuned --learning_rate 1e-5 --blocks_to_swap 18``) with the tiny files: added are the
    --clip_l --t5xxl --ae the BFL file needs, a few steps, no workers and a seed."""
    return [
        "--pretrained_model_name_or_path", model["model"], "--clip_l", model["clip_l"], "--t5xxl", model["t5xxl"],
        "--ae", model["ae"], "--dataset_config", str(toml), "--output_dir", str(out), "--output_name",
        "flux1_finetuned", "--learning_rate", "1e-5", "--blocks_to_swap", "18",
        "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0", "--seed", "1", *extra,
    ]  # fmt: skip


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


def trained(result) -> dict[str, torch.Tensor]:
    """The transformer as the run held it at its end (the state folder's trained tensors, diffusers names)."""
    state = load_state_dict(result.state / "trained.safetensors")[0]
    return {k[len("unet.") :]: v for k, v in state.items() if k.startswith("unet.")}


def assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= atol, f"max |difference| {worst}"


def test_docs_example_runs_and_the_bfl_file_reads_back(model, dataset_toml, tmp_path):
    """The docs line trains (18 blocks swapped: 9 double + 18 single on the host); the file has the input BFL file's
    keys and shapes, ModelSpec metadata, and reads back through our loader equal to the trained weights; the
    weights moved."""
    result = flux_train.run(doc_command(model, dataset_toml, tmp_path, "--save_state_on_train_end"))
    assert result.steps == 3 and result.output.name == "flux1_finetuned.safetensors" and not result.failed
    out, source = load_state_dict(result.output)[0], load_state_dict(model["model"])[0]
    assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in source.items()}
    meta = read_metadata(result.output)
    assert meta["modelspec.architecture"] == "flux-1-dev" and meta["sdtrain.family"] == "flux-dev"
    state = trained(result)
    ours = get_family("flux-dev").load(
        result.output, options=FluxOptions(clip_l=model["clip_l"], t5xxl=model["t5xxl"], ae=model["ae"])
    )
    assert_same(state, ours.denoiser.state_dict())
    assert sum(not torch.equal(out[k], source[k]) for k in source) > len(source) // 2


def test_held_out_loss_falls(model, dataset_toml, tmp_path):
    """10 steps at lr 1e-3 (diffusers folder input and output): the held-out flow loss falls; diffusers'
    ``FluxTransformer2DModel.from_pretrained`` reads the output folder's transformer equal to the trained one."""
    from diffusers import FluxTransformer2DModel

    argv = ["--pretrained_model_name_or_path", model["folder"], "--dataset_config", str(dataset_toml), "--output_dir",
            str(tmp_path), "--learning_rate", "1e-3", "--max_train_steps", "10", "--validation_split", "0.25",
            "--validate_every_n_steps", "5", "--max_data_loader_n_workers", "0", "--seed", "1",
            "--save_model_as", "diffusers_safetensors", "--save_state_on_train_end"]  # fmt: skip
    result = flux_train.run(argv)
    values = [v for _, v in result.validation]
    assert len(values) == 2 and values[-1] < 0.97 * values[0], values
    theirs = FluxTransformer2DModel.from_pretrained(result.output, subfolder="transformer")
    assert_same(trained(result), theirs.state_dict())


@pytest.fixture(scope="module")
def adafactor_runs(model, dataset_toml, tmp_path_factory, request):
    """4 Adafactor steps (lr 1e-3, the same draws) four ways: "plain" (no swap, the step after backward), "swap_fused"
    (--blocks_to_swap 18 --fused_backward_pass), "blockwise" (--blockwise_fused_optimizers), and "resumed" (the
    swap_fused run stopped after 2 steps with --save_state, then --resume to 4). ``chunks``: the sizes of the fused
    steps of the blockwise run."""
    from library.optim.fused import FusedStep

    root = tmp_path_factory.mktemp("adafactor_runs")
    common = [*ADAFACTOR, "--learning_rate", "1e-3", "--save_state_on_train_end"]
    argv = doc_command(model, dataset_toml, root / "plain", *common, "--blocks_to_swap", "0", steps=4)
    runs = {"plain": flux_train.run(argv)}
    swap = doc_command(model, dataset_toml, root / "swap", *common, "--fused_backward_pass", steps=4)
    swappers = []
    place = BlockSwap.place
    BlockSwap.place = lambda self, m: (swappers.append(self), place(self, m))[1]
    try:
        runs["swap_fused"] = flux_train.run(swap)
    finally:
        BlockSwap.place = place
    runs["swapper"] = swappers[0]
    half = [*with_flag(with_flag(swap, "--output_dir", str(root / "half")), "--max_train_steps", "2"), "--save_state"]
    flux_train.run(half)
    runs["resumed"] = flux_train.run([*with_flag(half, "--max_train_steps", "4"), "--resume",
                                      str(root / "half" / "flux1_finetuned-state")])  # fmt: skip
    chunks: list[int] = []
    original = FusedStep.step_chunk
    FusedStep.step_chunk = lambda self, ps: (chunks.append(len(ps)), original(self, ps))[1]
    try:
        runs["blockwise"] = flux_train.run([*with_flag(argv, "--output_dir", str(root / "bw")),
                                            "--blockwise_fused_optimizers"])  # fmt: skip
    finally:
        FusedStep.step_chunk = original
    runs["source"] = model["model"]
    return runs, chunks


def test_block_swap_and_fused_backward_give_the_ordinary_step(adafactor_runs):
    """--blocks_to_swap 18 (27 blocks' trained weights on the host, each stepped on the device in backward, one
    parameter at a time: sd-scripts' fused backward pass) == no swap and Adafactor's step after backward. Not bit for
    bit: a swapped weight is a fresh copy at another address than the loader's tensor, and CPU matmul kernels round
    by alignment (measured: losses differ by <= 1e-7 relative); the steps are 1e3 times larger than the tolerance."""
    runs, _ = adafactor_runs
    plain, swapped = runs["plain"], runs["swap_fused"]
    swapper = runs["swapper"]  # every weight of the 9 + 18 swapped blocks was on the host, and moved in and out
    assert len(swapper.swapped) == 27 and all(len(s.params) == len(list(s.block.parameters())) for s in swapper.swapped)
    assert swapper.moves_in >= 4 * 27 * 2 and swapper.moves_out >= 4 * 27 * 2
    torch.testing.assert_close(swapped.losses, plain.losses, rtol=1e-6, atol=0)
    assert_same(trained(swapped), trained(plain), atol=1e-6)
    base = load_state_dict(runs["source"])[0]  # BFL names
    moved = diffusers_to_bfl(trained(plain))
    assert max(float((moved[k] - base[k]).abs().max()) for k in base) > 1e-3


def test_blockwise_fused_optimizers_step_each_block_once(adafactor_runs):
    """--blockwise_fused_optimizers: 11 double + 20 single blocks + the rest = 32 steps per optimizer step, covering
    every parameter (sd-scripts' one optimizer per block); the weights equal the ordinary step's."""
    runs, chunks = adafactor_runs
    n_params = len(trained(runs["plain"]))
    assert len(chunks) == 4 * (11 + 20 + 1) and sum(chunks) == 4 * n_params
    assert_same(trained(runs["plain"]), trained(runs["blockwise"]), atol=1e-7)


def test_resume_with_swap_and_fused_steps_repeats_the_uninterrupted_run(adafactor_runs):
    """2 steps + --save_state, then --resume to 4 (swap + fused backward): the losses and weights of 4 steps at once,
    bit for bit (the optimizer state reloaded onto the host copies is moved to the device at each fused step)."""
    runs, _ = adafactor_runs
    assert runs["resumed"].losses == runs["swap_fused"].losses
    assert_same(trained(runs["swap_fused"]), trained(runs["resumed"]))
    (a, _), (b, _) = load_state_dict(runs["swap_fused"].output), load_state_dict(runs["resumed"].output)
    assert_same(a, b)


def test_ordinary_steps_with_swap_give_the_weights_of_no_swap(model, dataset_toml, tmp_path, monkeypatch):
    """The docs line's AdamW (the step after backward: swapped weights and their gradients on the host) with
    --blocks_to_swap 18 against 0, 2 steps. The second run has --mem_eff_save: its file is written by the streaming
    writer, and holds the same tensors as the first run's ordinary save (within the tolerance of the swap)."""
    from library.files import weights as weight_files

    argv = doc_command(model, dataset_toml, tmp_path / "a", "--learning_rate", "1e-3", "--save_state_on_train_end",
                       steps=2)  # fmt: skip
    swapped = flux_train.run(argv)
    calls = []
    original = weight_files.write_safetensors_streamed
    monkeypatch.setattr(weight_files, "write_safetensors_streamed", lambda *a: (calls.append(a[1]), original(*a)))
    plain = flux_train.run([*with_flag(with_flag(argv, "--blocks_to_swap", "0"), "--output_dir", str(tmp_path / "b")),
                            "--mem_eff_save"])  # fmt: skip
    torch.testing.assert_close(swapped.losses, plain.losses, rtol=1e-6, atol=0)
    assert_same(trained(swapped), trained(plain), atol=1e-6)
    assert len(calls) == 1 and calls[0].parent == tmp_path / "b"
    assert_same(load_state_dict(swapped.output)[0], load_state_dict(plain.output)[0], atol=1e-6)


def test_mem_eff_save_writes_the_same_tensors(tmp_path):
    """--mem_eff_save (the BFL tensors made and written one at a time) gives the file of the ordinary save: the same
    keys, dtypes and bytes, and the same metadata but the date and title (the file's name); safetensors reads it."""
    from safetensors import safe_open

    from library.files.weights import streamed_saves

    parts = build_tiny_flux("flux-dev", seed=3)
    family = get_family("flux-dev")
    meta = {"ss_note": "x"}
    family.save(parts, tmp_path / "a.safetensors", dtype=torch.bfloat16, metadata=meta)
    with streamed_saves():
        family.save(parts, tmp_path / "b.safetensors", dtype=torch.bfloat16, metadata=meta)
    (a, ma), (b, mb) = load_state_dict(tmp_path / "a.safetensors"), load_state_dict(tmp_path / "b.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.bfloat16 and a[k].shape == b[k].shape
        assert a[k].view(torch.int16).equal(b[k].view(torch.int16)), k
    for m in (ma, mb):
        del m["modelspec.date"], m["modelspec.title"]
    assert ma == mb and ma["ss_note"] == "x"
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        assert set(f.keys()) == set(a)
