"""sd3_train.py end to end on a tiny SD3 medium (12 joint blocks of width 32, so that sd-scripts' ``--blocks_to_swap
10`` fits): sd-scripts' docs/fine_tune.md SD3 command line runs unchanged on the SAI file with its encoders embedded;
the output is what sd-scripts' sd3_train.py writes (the SAI file with the transformer and VAE, the trained CLIP-L /
CLIP-G next to it) and reads back equal to the trained weights through diffusers' ``from_single_file`` and our loader;
the encoders whose learning rate is 0 and the parameters ``--num_last_block_to_freeze`` names stay bit for bit, the
others move; the held-out loss falls. Oracles for the memory options, each on the same draws: ``--blocks_to_swap``
with ``--fused_backward_pass`` (Adafactor, a step per parameter in backward) and ``--blockwise_fused_optimizers`` (a
step per joint block) give the ordinary Adafactor step's weights; ``--save_state`` + ``--resume`` repeats the
uninterrupted run bit for bit."""

from __future__ import annotations

import pytest
import torch
from _train_helpers import write_dataset_toml

import sd3_train
from library.families import get_family
from library.families.sd3.keys import SAI_PREFIX, sai_to_diffusers
from library.families.sd3.options import SD3Options
from library.families.sd3.tiny import build_tiny_sd3, tiny_transformer, write_tiny_files
from library.files.weights import load_state_dict, read_metadata

ADAFACTOR = ["--optimizer_type", "adafactor", "--optimizer_args", "relative_step=False", "scale_parameter=False",
             "warmup_init=False"]  # fmt: skip
NAMES = ("clip_l", "clip_g", "t5xxl")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The SAI file with its encoders (what the docs line names sd3_medium.safetensors), the separate encoder files
    (the input's own weights) and ``config``: a folder with the transformer's diffusers config (what diffusers'
    single-file reader takes for a model other than the released ones)."""
    root = tmp_path_factory.mktemp("sd3_ft_model")
    parts = build_tiny_sd3("sd3", seed=0, blocks=12)
    files = {k: str(v) for k, v in write_tiny_files(parts, root, diffusers=False).items()}
    parts.denoiser.save_config(root / "config" / "transformer")
    return {**files, "config": str(root / "config")}


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "dataset.toml")


def doc_command(model, toml, out, *extra, steps=3) -> list[str]:
    """sd-scripts' docs/fine_tune.md SD3 line (``--mixed_precision bf16`` (accelerate's there) ``--pretrained_model_name_or_path
    --dataset_config --output_dir --output_name sd3_finetuned --train_text_encoder --learning_rate 4e-6
    --blocks_to_swap 10``) with the tiny SAI file: added are a few steps, no workers and a seed."""
    return [
        "--mixed_precision", "bf16", "--pretrained_model_name_or_path", model["model"], "--dataset_config", str(toml),
        "--output_dir", str(out), "--output_name", "sd3_finetuned", "--train_text_encoder", "--learning_rate", "4e-6",
        "--blocks_to_swap", "10", "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0", "--seed", "1",
        *extra,
    ]  # fmt: skip


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


def trained(result, prefix: str = "unet.") -> dict[str, torch.Tensor]:
    """A trained part as the run held it at its end (the state folder's tensors): ``unet.`` the transformer
    (diffusers names), ``text_encoders.N.`` the N-th trained encoder (CLIP-L, CLIP-G, T5 order, frozen ones left
    out)."""
    state = load_state_dict(result.state / "trained.safetensors")[0]
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def encoder_file(result, name: str) -> dict[str, torch.Tensor]:
    return load_state_dict(result.output.with_name(f"sd3_finetuned_{name}.safetensors"))[0]


def test_docs_example_runs_and_the_files_read_back(model, dataset_toml, tmp_path):
    """The docs line trains (10 of 12 blocks swapped) the transformer, CLIP-L and CLIP-G. The SAI file holds the
    input's transformer and VAE keys and shapes (sd-scripts writes no encoders into it) with ModelSpec metadata;
    ``<name>_clip_l`` / ``_clip_g.safetensors`` (none for the frozen T5) hold the trained encoders under the input
    encoder files' keys. diffusers' ``SD3Transformer2DModel.from_single_file`` and our loader (the two encoder
    files + the input T5) read back the trained weights exactly; the transformer and both CLIPs moved."""
    from diffusers import SD3Transformer2DModel

    result = sd3_train.run(doc_command(model, dataset_toml, tmp_path, "--save_state_on_train_end"))
    assert result.steps == 3 and result.output.name == "sd3_finetuned.safetensors" and not result.failed
    out, source = load_state_dict(result.output)[0], load_state_dict(model["model"])[0]
    kept = {k: tuple(v.shape) for k, v in source.items() if not k.startswith("text_encoders.")}
    assert {k: tuple(v.shape) for k, v in out.items()} == kept
    meta = read_metadata(result.output)
    assert meta["modelspec.architecture"] == "stable-diffusion-3-medium" and meta["sdtrain.family"] == "sd3"
    assert sorted(p.name for p in tmp_path.glob("sd3_finetuned*.safetensors")) == [
        "sd3_finetuned.safetensors", "sd3_finetuned_clip_g.safetensors", "sd3_finetuned_clip_l.safetensors"]  # fmt: skip
    state = trained(result)
    theirs = SD3Transformer2DModel.from_single_file(str(result.output), config=model["config"],
                                                    subfolder="transformer", local_files_only=True)  # fmt: skip
    assert worst(state, theirs.state_dict()) == 0.0
    ours = get_family("sd3").load(result.output, options=SD3Options(clip_l=str(result.output.with_name("sd3_finetuned_clip_l.safetensors")), clip_g=str(result.output.with_name("sd3_finetuned_clip_g.safetensors")), t5xxl=model["t5xxl"]))  # fmt: skip
    assert worst(state, ours.denoiser.state_dict()) == 0.0
    for i, name in enumerate(NAMES[:2]):
        te = trained(result, f"text_encoders.{i}.")
        assert worst(te, ours.text_encoders[i].state_dict()) == 0.0
        saved, base = encoder_file(result, name), load_state_dict(model[name])[0]
        assert saved.keys() == base.keys() and 0 < worst(saved, base)
    assert 0 < worst({k: out[k] for k in kept}, {k: source[k] for k in kept})  # the transformer moved


def test_held_out_loss_falls_with_partial_cache_frozen_encoder_and_frozen_blocks(model, dataset_toml, tmp_path):
    """10 steps at lr 1e-3 with --use_t5xxl_cache_only (T5's outputs cached, CLIP-L recomputed at each step),
    --learning_rate_te2 0 and --num_last_block_to_freeze 10: the held-out loss falls; CLIP-L moved; CLIP-G (lr 0) and
    the last block's 10 x_block parameters are the input's bit for bit, every other transformer weight moved."""
    from library.families.sd3.full_training import last_x_block_parameters

    argv = doc_command(model, dataset_toml, tmp_path, "--use_t5xxl_cache_only", "--learning_rate_te2", "0",
                       "--num_last_block_to_freeze", "10", "--validation_split", "0.25", "--validate_every_n_steps",
                       "5", "--save_state_on_train_end", steps=10)  # fmt: skip
    result = sd3_train.run(with_flag(with_flag(argv, "--learning_rate", "1e-3"), "--blocks_to_swap", "0"))
    values = [v for _, v in result.validation]
    assert len(values) == 2 and values[-1] < 0.98 * values[0], values
    file = load_state_dict(model["model"])[0]
    source = sai_to_diffusers({k.removeprefix(SAI_PREFIX): v for k, v in file.items() if k.startswith(SAI_PREFIX)})
    with torch.device("meta"):
        frozen = set(last_x_block_parameters(tiny_transformer("sd3", 12), 10))
    state = trained(result)
    assert len(frozen) == 14 and all(n.startswith("transformer_blocks.11.") for n in frozen)
    assert all(torch.equal(state[k], source[k]) for k in frozen)
    assert all(not torch.equal(state[k], source[k]) for k in state if k not in frozen and "pos_embed.pos_embed" != k)
    assert 0 < worst(encoder_file(result, "clip_l"), load_state_dict(model["clip_l"])[0])
    assert worst(encoder_file(result, "clip_g"), load_state_dict(model["clip_g"])[0]) == 0.0
    assert (
        trained(result, "text_encoders.1.") == {}
        and not result.output.with_name("sd3_finetuned_t5xxl.safetensors").exists()
    )


def test_t5xxl_alone_trains(model, dataset_toml, tmp_path):
    """--train_text_encoder --train_t5xxl with --learning_rate_te1 0 --learning_rate_te2 0: T5 is written next to the
    model file and moved; no CLIP file (sd-scripts writes CLIP-L / CLIP-G only when one of them trains). With
    --save_every_n_steps 1 --save_last_n_steps 1 a step file's T5 file goes when the step file goes."""
    argv = doc_command(model, dataset_toml, tmp_path, "--train_t5xxl", "--learning_rate_te1", "0",
                       "--learning_rate_te2", "0", "--learning_rate_te3", "1e-3", "--save_every_n_steps", "1",
                       "--save_last_n_steps", "1", steps=4)  # fmt: skip
    result = sd3_train.run(with_flag(argv, "--blocks_to_swap", "0"))
    names = sorted(p.name for p in tmp_path.glob("sd3_finetuned*.safetensors"))
    assert names[-2:] == ["sd3_finetuned.safetensors", "sd3_finetuned_t5xxl.safetensors"]
    steps = names[:-2]  # step 1's file and its T5 file are gone; each kept step file has its own
    assert steps and not any("step00000001" in n for n in steps), names
    assert steps == sorted([n for n in steps if "_t5xxl" not in n] + [n.replace(".", "_t5xxl.") for n in steps
                                                                    if "_t5xxl" not in n]), names  # fmt: skip
    saved, base = encoder_file(result, "t5xxl"), load_state_dict(model["t5xxl"])[0]
    assert saved.keys() == base.keys() and 0 < worst(saved, base)


@pytest.fixture(scope="module")
def adafactor_runs(model, dataset_toml, tmp_path_factory):
    """3 Adafactor steps (lr 1e-3, the same draws, CLIP-L / CLIP-G trained too) four ways: "plain" (no swap, the step
    after backward), "swap_fused" (--blocks_to_swap 10 --fused_backward_pass), "blockwise"
    (--blockwise_fused_optimizers), and "resumed" (the swap_fused run stopped after 2 steps with --save_state, then
    --resume to 3). ``chunks``: the sizes of the fused steps of the blockwise run."""
    from library.optim.fused import FusedStep

    root = tmp_path_factory.mktemp("adafactor_runs")
    common = [*ADAFACTOR, "--max_grad_norm", "0", "--save_state_on_train_end"]  # (fused steps clip per parameter)
    argv = doc_command(model, dataset_toml, root / "plain", *common, steps=3)
    argv = with_flag(with_flag(argv, "--learning_rate", "1e-3"), "--mixed_precision", "no")  # (bf16: rounding)
    runs = {"plain": sd3_train.run(with_flag(argv, "--blocks_to_swap", "0"))}
    swap = [*with_flag(argv, "--output_dir", str(root / "swap")), "--fused_backward_pass"]
    runs["swap_fused"] = sd3_train.run(swap)
    half = [*with_flag(with_flag(swap, "--output_dir", str(root / "half")), "--max_train_steps", "2"), "--save_state"]
    sd3_train.run(half)
    runs["resumed"] = sd3_train.run([*with_flag(half, "--max_train_steps", "3"), "--resume",
                                     str(root / "half" / "sd3_finetuned-state")])  # fmt: skip
    chunks: list[int] = []
    original = FusedStep.step_chunk
    FusedStep.step_chunk = lambda self, ps: (chunks.append(len(ps)), original(self, ps))[1]
    try:
        bw = with_flag(with_flag(argv, "--output_dir", str(root / "bw")), "--blocks_to_swap", "0")
        runs["blockwise"] = sd3_train.run([*bw, "--blockwise_fused_optimizers"])
    finally:
        FusedStep.step_chunk = original
    return runs, chunks


def all_trained(result) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_state_dict(result.state / "trained.safetensors")[0].items()}


def test_block_swap_and_fused_backward_give_the_ordinary_step(adafactor_runs):
    """--blocks_to_swap 10 --fused_backward_pass == no swap with Adafactor's step after backward, transformer and
    both CLIPs. Not bit for bit: a swapped weight is a fresh copy at another address, and CPU kernels round by
    alignment (losses within 1e-6 relative); the steps are far larger than the tolerance. The key-projection biases
    (CLIP's ``k_proj``, the transformer's ``add_k_proj``) are left out: softmax ignores them, so their gradient is
    rounding noise, and Adafactor steps by about lr whatever its size."""
    runs, _ = adafactor_runs
    plain, swapped = runs["plain"], runs["swap_fused"]
    torch.testing.assert_close(swapped.losses, plain.losses, rtol=1e-6, atol=0)
    a, b = all_trained(swapped), all_trained(plain)
    noise = [k for k in a if k.endswith("k_proj.bias")]  # key biases: gradient 0 but for rounding (softmax is blind
    assert len(noise) == 16  # to them), which Adafactor's RMS-normalised step scales up to lr: left out
    assert worst({k: a[k] for k in a if k not in noise}, {k: b[k] for k in b if k not in noise}) <= 1e-6
    assert {k.split(".")[0] + k.split(".")[1] for k in all_trained(plain) if k != "steps_done"} == {
        "unettransformer_blocks", "unetpos_embed", "unettime_text_embed", "unetcontext_embedder", "unetnorm_out",
        "unetproj_out", "text_encoders0", "text_encoders1"}  # fmt: skip


def test_blockwise_fused_optimizers_step_each_block_once(adafactor_runs):
    """--blockwise_fused_optimizers: 12 joint blocks + the rest (embedders, final layer, the two CLIPs) = 13 steps per
    optimizer step, covering every trained parameter; the weights equal the ordinary step's."""
    runs, chunks = adafactor_runs
    buffers = ("steps_done", "unet.pos_embed.pos_embed")
    n_params = len([k for k in all_trained(runs["plain"]) if k not in buffers])
    assert len(chunks) == 3 * (12 + 1) and sum(chunks) == 3 * n_params
    assert worst(all_trained(runs["plain"]), all_trained(runs["blockwise"])) <= 1e-7


def test_resume_with_swap_and_fused_steps_repeats_the_uninterrupted_run(adafactor_runs):
    """2 steps + --save_state, then --resume to 3 (swap + fused backward + trained CLIPs): the losses, the trained
    tensors and the written files of the 3 steps at once, bit for bit."""
    runs, _ = adafactor_runs
    assert runs["resumed"].losses == runs["swap_fused"].losses
    assert worst(all_trained(runs["swap_fused"]), all_trained(runs["resumed"])) == 0.0
    for name in ("", "_clip_l", "_clip_g"):
        a = load_state_dict(runs["swap_fused"].output.with_name(f"sd3_finetuned{name}.safetensors"))[0]
        b = load_state_dict(runs["resumed"].output.with_name(f"sd3_finetuned{name}.safetensors"))[0]
        assert worst(a, b) == 0.0


def test_diffusers_folder_output(model, dataset_toml, tmp_path):
    """--save_model_as diffusers_safetensors writes every part as a ``StableDiffusion3Pipeline`` folder: diffusers'
    and transformers' ``from_pretrained`` read the trained transformer and CLIP-L back exactly, and the frozen
    CLIP-G (--learning_rate_te2 0) equal to the input's."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    argv = doc_command(model, dataset_toml, tmp_path, "--learning_rate_te2", "0", "--save_model_as",
                       "diffusers_safetensors", "--save_state_on_train_end", steps=1)  # fmt: skip
    result = sd3_train.run(with_flag(with_flag(argv, "--blocks_to_swap", "0"), "--learning_rate", "1e-3"))
    assert result.output.is_dir() and (result.output / "model_index.json").exists()
    theirs = SD3Transformer2DModel.from_pretrained(result.output, subfolder="transformer")
    assert worst(trained(result), theirs.state_dict()) == 0.0
    clip_l = CLIPTextModelWithProjection.from_pretrained(result.output, subfolder="text_encoder")
    clip_g = CLIPTextModelWithProjection.from_pretrained(result.output, subfolder="text_encoder_2")
    own = {k: v for k, v in clip_l.state_dict().items() if not k.endswith("position_ids")}
    assert worst(trained(result, "text_encoders.0."), own) == 0.0
    base = load_state_dict(model["clip_g"])[0]
    assert worst(base, {k: v for k, v in clip_g.state_dict().items() if k in base}) == 0.0
    assert 0 < worst(trained(result, "text_encoders.0."), load_state_dict(model["clip_l"])[0])
