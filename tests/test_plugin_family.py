"""A model family added as a folder: ToyDiT (tests/plugins/toydit, a tiny flow-matching DiT with its own byte-level
text encoder, reversed-target objective and load flags) is registered through the ``sdtrain.families`` entry point
(tests/plugins/sdtrain_toydit-0.1.dist-info) and goes through every entry point with nothing outside its folder and
its scripts (tests/plugins/toydit_*.py) knowing it: LoRA training with sampling, full fine-tuning, gen_img, its
minimal inference script, and the LoRA tools (resize, merge, check, extract).

Oracles: the step's loss is the objective's formula on the step's draws; one SGD step of full fine-tuning moves every
weight by -lr times the formula's gradient; the training sample, gen_img's image and the minimal inference script's
image of one prompt and seed are the same image; merged == injected; resizing keeps the best rank-r approximation;
extraction recovers the fine-tuned difference; files reload into the family.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_family_contract import signature_problems

import gen_img
import library.run.train_step as T
from library.cli.problems import ConfigError
from library.families import FAMILIES, OBJECTIVES, ModelFamily, detect_family, register_family, unregister_family
from library.families.base import FamilyOptions
from library.families.full_training import FullTraining
from library.families.protocol import TinyModel, missing_members
from library.families.registry import _family_modules
from library.files.weights import load_state_dict, read_metadata
from library.objectives.base import Objective
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig
from library.run import loop
from networks import check_lora_weights, extract_lora_from_models, merge_lora, resize_lora
from networks.inject import network_from_file
from networks.targets import builtin_preset, find_targets

REPO = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"
LENGTH = 24  # --toy_max_length of the runs (the default is 32)
SHIFT = 2.5  # --toy_shift of the LoRA run
SAMPLE = "a red circle --w 64 --h 64 --d 3 --s 3"  # the sample prompt; gen_img / minimal inference repeat it


def test_the_entry_point_registers_the_family_in_its_order():
    """With tests/plugins on the path, the registry finds ToyDiT through its entry point (tests/plugins/
    sdtrain_toydit-0.1.dist-info) and places it by its ORDER among the library's family folders."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGINS), str(REPO)]))
    code = "import json, library.families as f, toydit; print(json.dumps([list(f.FAMILIES), toydit.ORDER]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found, order = json.loads(out.stdout.strip().splitlines()[-1])
    folders = [(o, name, [f.name for f in module.FAMILIES]) for o, name, module in _family_modules()
               if module.__name__.startswith("library.families.")]  # the folders, found in this process  # fmt: skip
    assert found == [n for _, _, names in sorted([*folders, (order, "toydit", ["toydit"])]) for n in names]
    assert 0 < found.index("toydit") < len(found) - 1  # ORDER 15 puts it between two folders, not last


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def toydit():
    """The plug-in's family registered in this process (the registry has found the library's folders first, without
    the plug-in on the path), unregistered afterwards."""
    list(FAMILIES)
    sys.path.insert(0, str(PLUGINS))
    try:
        import toydit as plugin

        for family in plugin.FAMILIES:
            register_family(family)
        try:
            yield plugin.TOYDIT
        finally:
            for family in plugin.FAMILIES:
                unregister_family(family.name)
    finally:
        sys.path.remove(str(PLUGINS))


@pytest.fixture(scope="module")
def model_files(toydit, tmp_path_factory):
    """The tiny ToyDiT as a model file with every part (``full``), and as the transformer + VAE file (``dit``) with the
    text encoder beside it (``text_encoder``)."""
    out = tmp_path_factory.mktemp("toydit")
    parts = toydit.tiny.build(seed=0)
    files = toydit.tiny.write_files(parts, out, "toydit")
    return {"full": toydit.save(parts, out / "toydit.safetensors"), **files}


def _copied(generator: torch.Generator) -> torch.Generator:
    g = torch.Generator(generator.device)
    g.set_state(generator.get_state())
    return g


def hand_loss(m, batch, generator, shift: float) -> torch.Tensor:
    """The step's per-sample loss by hand on a copy of its generator: σ = shift(sigmoid(N(0, 1))) (``--toy_sigma_law
    logit_normal --toy_shift``), x_σ = (1 - σ) x0 + σ ε, the network on τ = 1 - σ, compared with x0 - ε."""
    g = _copied(generator)
    with torch.no_grad():
        latents = T.batch_latents(m, batch, g)
        cond = T.batch_cond(m, batch, g)
        assert cond.hidden_states.shape[1] == LENGTH  # --toy_max_length in use
        noise = torch.randn(latents.shape, generator=g)
        u = torch.sigmoid(torch.randn((latents.shape[0],), generator=g))
        sigma = shift * u / (1 + (shift - 1) * u)
        s = sigma.view(-1, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        raw = m.denoiser(noisy, 1 - sigma, cond.hidden_states, cond.pooled, cond.mask)
        per_sample = ((raw - (latents - noise)) ** 2).mean(dim=(1, 2, 3))
    return per_sample * batch.loss_weights


@pytest.fixture(scope="module")
def lora_run(toydit, model_files, dataset, tmp_path_factory):
    """A LoRA trained by toydit_train_network.py on the model file without its text encoder (``--toy_text_encoder``),
    sampling every 2 steps; the first step's loss and its hand formula."""
    import toydit_train_network

    out = tmp_path_factory.mktemp("lora")
    prompts = out / "prompts.txt"
    prompts.write_text(SAMPLE + "\n")
    checked, real_loss = [], loop.batch_loss

    def checked_loss(m, batch, generator, **kwargs):
        if not checked:
            assert isinstance(m.objective, Objective)
            expected = hand_loss(m, batch, generator, SHIFT)
            checked.append((real_loss(m, batch, generator, **kwargs), expected))
            return checked[0][0]
        return real_loss(m, batch, generator, **kwargs)

    argv = [
        "--pretrained_model_name_or_path", str(model_files["dit"]), "--toy_text_encoder",
        str(model_files["text_encoder"]), "--toy_max_length", str(LENGTH), "--toy_sigma_law", "logit_normal",
        "--toy_shift", str(SHIFT), "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--output_dir",
        str(out), "--output_name", "lora", "--network_module", "networks.lora", "--network_dim", "4",
        "--network_alpha", "2", "--train_batch_size", "2", "--max_train_steps", "4", "--max_data_loader_n_workers",
        "0", "--seed", "1", "--optimizer_type", "AdamW", "--learning_rate", "1e-2", "--sample_prompts",
        str(prompts), "--sample_every_n_steps", "2",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "batch_loss", checked_loss)
        result = toydit_train_network.run(argv)
    return result, checked, out


def _sgd_expectation(m, batch, generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The first step's mean loss by hand (``--toy_sigma_law uniform --toy_shift 1``) and its gradient with respect
    to every transformer and text-encoder weight (keys as in the model file), on copies of the models."""
    g = _copied(generator)
    dit, encoder = copy.deepcopy(m.parts.denoiser), copy.deepcopy(m.parts.text_encoders[0])
    for module in (dit, encoder):
        module.requires_grad_(True)
    with torch.no_grad():
        latents = T.batch_latents(m, batch, g)
    ids, mask = m.parts.tokenizers[0](list(batch.captions), LENGTH)
    hidden, pooled = encoder(ids, mask)
    noise = torch.randn(latents.shape, generator=g)
    sigma = torch.rand((latents.shape[0],), generator=g)
    s = sigma.view(-1, 1, 1, 1)
    raw = dit((1 - s) * latents + s * noise, 1 - sigma, hidden, pooled, mask)
    loss = (((raw - (latents - noise)) ** 2).mean(dim=(1, 2, 3)) * batch.loss_weights).mean()
    loss.backward()
    grads = {f"dit.{k}": p.grad for k, p in dit.named_parameters()}
    grads.update({f"text_encoder.{k}": p.grad for k, p in encoder.named_parameters()})
    return loss.detach(), grads


@pytest.fixture(scope="module")
def fine_tuned(toydit, model_files, dataset, tmp_path_factory):
    """One plain SGD step of toydit_train.py (transformer and text encoder at lr 0.1, no clipping; gradient
    checkpointing, which must not change the gradient) and the step's loss and gradient by hand."""
    import toydit_train

    out = tmp_path_factory.mktemp("fine_tune")
    captured, real_loss = [], loop.batch_loss

    def checked_loss(m, batch, generator, **kwargs):
        if not captured:
            assert m.parts.denoiser._checkpoint is not None and m.parts.text_encoders[0]._checkpoint is not None
            captured.append(_sgd_expectation(m, batch, generator))
            loss = real_loss(m, batch, generator, **kwargs)
            captured.append(loss.detach().mean())
            return loss
        return real_loss(m, batch, generator, **kwargs)

    argv = [
        "--pretrained_model_name_or_path", str(model_files["full"]), "--toy_max_length", str(LENGTH),
        "--toy_sigma_law", "uniform", "--train_data_dir", str(dataset), "--caption_extension", ".txt",
        "--output_dir", str(out), "--output_name", "tuned", "--train_text_encoder", "--train_batch_size", "2",
        "--max_train_steps", "1", "--max_data_loader_n_workers", "0", "--seed", "2", "--optimizer_type",
        "torch.optim.SGD", "--learning_rate", "0.1", "--max_grad_norm", "0", "--gradient_checkpointing",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "batch_loss", checked_loss)
        result = toydit_train.run(argv)
    return result, captured


# ------------------------------------------------------------------------------------------------ the contract
def test_the_plugin_family_satisfies_the_contract(toydit, tmp_path):
    from toydit.objective import ToyFlowConfig

    assert FAMILIES["toydit"] is toydit and isinstance(toydit, ModelFamily) and missing_members(toydit) == []
    assert signature_problems(toydit) == []
    assert isinstance(toydit.tiny, TinyModel) and isinstance(toydit.full_training, FullTraining)
    assert isinstance(toydit.options(), FamilyOptions)
    parts = toydit.tiny.build()
    parts.options = toydit.options(flow=ToyFlowConfig())
    assert tuple(root.prefix for root in toydit.adapter_roots(parts)) == toydit.adapter_prefixes
    assert toydit.ti_embedding_keys == tuple(te.ti_key for te in toydit.spec.text_encoders)
    assert len(toydit.ti_embedding_keys) == toydit.num_text_encoders == len(parts.text_encoders)
    assert toydit.objective(parts) in OBJECTIVES and toydit.objective(parts) == parts.prediction_type
    objective = toydit.training_objective(parts, NoiseConfig(), LossConfig())
    assert isinstance(objective, Objective) and objective.name == toydit.objective(parts)
    assert toydit.objective_problems(NoiseConfig(), LossConfig(), toydit.options()) == []
    (problem,) = toydit.objective_problems(NoiseConfig(timestep_sampling="sigma"), LossConfig(), toydit.options())
    assert "--timestep_sampling" in problem
    with pytest.raises(ConfigError, match="--toy_shift"):
        toydit.options.from_args(Namespace(toy_sigma_law="uniform", toy_shift=0.0), training=True)
    full = builtin_preset("full", toydit.target_classes)
    unet = [t.name for t in find_targets(toydit.adapter_roots(parts), full, conv=True, train_norm=False) if t.is_unet]
    assert any(toydit.blocks.names_match(n) for n in unet)
    assert all(0 <= toydit.blocks.index(n) < toydit.blocks.num_blocks for n in unet if toydit.blocks.names_match(n))
    reference = toydit.reference_parts()
    assert reference.family == "toydit" and reference.vae is None
    assert {p.device.type for p in reference.denoiser.parameters()} == {"meta"}
    assert [r.prefix for r in toydit.adapter_roots(reference)] == list(toydit.adapter_prefixes)
    (swapped,) = toydit.swap_blocks(parts.denoiser)
    assert swapped.blocks is parts.denoiser.layers

    # tools/make_tiny_model.py asks the registry: the folder and the single file reload to the same weights
    from tools import make_tiny_model

    folder, single = make_tiny_model.run(["--out", str(tmp_path), "--family", "toydit", "--toydit_blocks", "3"])
    assert detect_family(folder) is toydit and detect_family(single) is toydit
    a, b = toydit.load(folder), toydit.load(single)
    assert len(a.denoiser.layers) == 3
    for x, y in zip((a.denoiser, a.vae, *a.text_encoders), (b.denoiser, b.vae, *b.text_encoders)):
        sx, sy = x.state_dict(), y.state_dict()
        assert sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sx)


def test_a_model_file_without_its_text_encoder_needs_the_load_flag(toydit, model_files):
    """``--toy_text_encoder`` supplies the part the transformer file lacks (the shared part resolver), the same
    weights as the file with every part."""
    with pytest.raises(ValueError, match="--toy_text_encoder"):
        toydit.load(model_files["dit"])
    both = toydit.load(model_files["dit"], options=toydit.options(toy_text_encoder=str(model_files["text_encoder"])))
    full = toydit.load(model_files["full"])
    for a, b in zip((both.denoiser, both.vae, *both.text_encoders), (full.denoiser, full.vae, *full.text_encoders)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_file_without_our_metadata_is_recognised_by_its_keys(toydit, model_files, tmp_path):
    """``spec.detect``: a ToyDiT file without ``sdtrain.family`` / ``sdtrain.configs`` (as another tool writes it) is
    still detected and loads with the family's own configs; its text-encoder file alone is no model."""
    from safetensors.torch import save_file

    state, meta = load_state_dict(model_files["full"])
    assert meta["sdtrain.family"] == "toydit"
    save_file(state, str(tmp_path / "bare.safetensors"))
    assert read_metadata(tmp_path / "bare.safetensors") == {}
    assert detect_family(tmp_path / "bare.safetensors") is toydit
    bare = toydit.load(tmp_path / "bare.safetensors")
    assert all(torch.equal(v, state[f"dit.{k}"]) for k, v in bare.denoiser.state_dict().items())
    with pytest.raises(ValueError, match="ToyDiT"):  # the registry's titles, ToyDiT's among them
        detect_family(model_files["text_encoder"])


# ------------------------------------------------------------------------------------------------ LoRA training
def _with_text_encoder(toydit, model_files):
    """The load flags of the LoRA run (the model file without its text encoder)."""
    return toydit.options(toy_text_encoder=str(model_files["text_encoder"]), toy_max_length=LENGTH)


def test_lora_training_trains_the_family_objective_with_its_flags(toydit, model_files, lora_run):
    result, checked, out = lora_run
    assert result.steps == 4 and result.failed is None
    loss, expected = checked[0]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)  # the step's loss is the objective's formula
    meta = read_metadata(result.output)
    assert meta["ss_base_model_version"] == "toydit_v1" and meta["modelspec.architecture"] == "toydit-v1/lora"
    assert (meta["ss_toy_sigma_law"], meta["ss_toy_shift"], meta["ss_toy_max_length"]) == ("logit_normal", "2.5", "24")
    assert meta["ss_resolution"] == "(64, 64)"  # the family's native resolution
    saved, _ = load_state_dict(result.output)
    assert {k.split("_", 2)[1] for k in saved} == {"unet", "te1"}
    parts = toydit.load(model_files["dit"], options=_with_text_encoder(toydit, model_files))
    again = network_from_file(result.output, toydit.adapter_roots(parts)).state_dict_for_file()
    assert set(again) == set(saved) and all(torch.equal(again[k].to(v.dtype), v) for k, v in saved.items())
    for step in (2, 4):  # sampled during training, every 2 steps
        assert len(list((out / "sample").glob(f"lora_{step:06d}_00_*.png"))) == 1


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_gen_img_and_the_minimal_script_draw_the_training_sample(toydit, model_files, lora_run, tmp_path):
    """The last training sample (the LoRA after step 4), gen_img with the saved LoRA on the saved model (its family
    read from the file) and the minimal inference script draw the same image for the same prompt and seed."""
    import toydit_minimal_inference

    result, _, out = lora_run
    (sample,) = (out / "sample").glob("lora_000004_00_*.png")
    load_flags = ["--toy_text_encoder", str(model_files["text_encoder"]), "--toy_max_length", str(LENGTH)]
    (generated,) = gen_img.run([
        "--ckpt", str(model_files["dit"]), *load_flags, "--prompt", SAMPLE, "--outdir", str(tmp_path / "gen"),
        "--network_module", "networks.lora", "--network_weights", str(result.output),
    ])  # fmt: skip
    (minimal,) = toydit_minimal_inference.run([
        "--ckpt_path", str(model_files["dit"]), *load_flags, "--prompt", "a red circle", "--seed", "3", "--steps",
        "3", "--lora_weights", f"{result.output};1.0", "--output_dir", str(tmp_path / "minimal"),
    ])  # fmt: skip
    reference = _pixels(sample)
    assert reference.shape == (64, 64, 3) and reference.std() > 0
    for image in (generated, minimal):
        assert np.abs(_pixels(image) - reference).max() <= 1, image
    (base,) = toydit_minimal_inference.run([
        "--ckpt_path", str(model_files["full"]), "--toy_max_length", str(LENGTH), "--prompt", "a red circle",
        "--seed", "3", "--steps", "3", "--output_dir", str(tmp_path / "base"),
    ])  # fmt: skip
    assert np.abs(_pixels(base) - reference).max() > 1  # the LoRA changes the image


# ------------------------------------------------------------------------------------------------ LoRA tools
def _deltas(path: Path) -> dict[str, torch.Tensor]:
    """ΔW = up · down · alpha / rank of every module of a LoRA file."""
    state, _ = load_state_dict(path)
    names = {k.split(".")[0] for k in state}
    out = {}
    for n in names:
        up, down = state[f"{n}.lora_up.weight"].float(), state[f"{n}.lora_down.weight"].float()
        out[n] = up @ down * float(state[f"{n}.alpha"]) / down.shape[0]
    return out


def test_resize_keeps_the_best_low_rank_approximation(lora_run, tmp_path):
    result, _, _ = lora_run
    argv = ["--model", str(result.output), "--save_to", str(tmp_path / "r2.safetensors"), "--new_rank", "2"]
    (resized,) = resize_lora.run(argv)
    original, small = _deltas(result.output), _deltas(resized)
    assert small.keys() == original.keys()
    for name, delta in original.items():
        u, s, vh = torch.linalg.svd(delta)
        best = u[:, :2] @ torch.diag(s[:2]) @ vh[:2]
        torch.testing.assert_close(small[name], best, rtol=1e-4, atol=1e-6, msg=name)


def test_check_lora_weights_passes_the_trained_file_and_flags_a_broken_one(lora_run, tmp_path, capsys):
    from safetensors.torch import save_file

    result, _, _ = lora_run
    assert check_lora_weights.run([str(result.output)]) is True
    assert "26 modules: lora 26" in capsys.readouterr().out  # 18 transformer + 8 text-encoder modules
    state, meta = load_state_dict(result.output)
    key = next(k for k in state if k.endswith("lora_down.weight"))
    state[key] = state[key].clone()
    state[key][0, 0] = float("nan")
    save_file(state, str(tmp_path / "broken.safetensors"), meta)
    assert check_lora_weights.run([str(tmp_path / "broken.safetensors")]) is False
    assert f"{key}: contains NaN" in capsys.readouterr().out


def test_merged_model_equals_the_model_with_the_lora_injected(toydit, model_files, lora_run, tmp_path):
    result, _, _ = lora_run
    merged_path = merge_lora.run(["--sd_model", str(model_files["full"]), "--models", str(result.output),
                                  "--ratios", "0.7", "--save_to", str(tmp_path / "merged.safetensors")])  # fmt: skip
    assert detect_family(merged_path) is toydit
    options = toydit.options(toy_max_length=LENGTH)
    merged = toydit.load(merged_path, options=options)
    injected = toydit.load(model_files["full"], options=options)
    network = network_from_file(result.output, toydit.adapter_roots(injected))
    network.set_multiplier(0.7)
    torch.manual_seed(0)
    noisy, t, prompts = torch.randn(2, 4, 8, 8), torch.tensor([300.0, 800.0]), ["a red circle", "a blue square"]

    def outputs(parts):
        with torch.no_grad():
            cond = toydit.encode_prompt(parts, prompts)
            return cond.hidden_states, toydit.predict(parts.denoiser, noisy, t, cond)

    for a, b in zip(outputs(merged), outputs(injected)):  # text encoder and transformer
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    network.set_multiplier(0.0)
    assert (outputs(injected)[1] - outputs(merged)[1]).abs().max() > 1e-3  # the LoRA does something


# ------------------------------------------------------------------------------------------------ full fine-tuning
def test_full_fine_tuning_is_an_sgd_step_on_the_objective(toydit, model_files, fine_tuned):
    """The saved model (its family read from the file) is the base minus lr times the gradient of the objective's
    formula on the step's draws, for every transformer and text-encoder weight; the VAE is unchanged."""
    result, ((hand, grads), loss) = fine_tuned
    assert result.steps == 1 and result.failed is None
    torch.testing.assert_close(loss, hand, rtol=1e-5, atol=1e-7)
    assert detect_family(result.output) is toydit
    tuned = toydit.load(result.output)
    assert read_metadata(result.output)["ss_toy_sigma_law"] == "uniform"
    tuned_state, _ = load_state_dict(result.output)
    base_state, _ = load_state_dict(model_files["full"])
    assert tuned_state.keys() == base_state.keys()
    for key, value in base_state.items():
        if key.startswith("vae."):
            assert torch.equal(tuned_state[key], value), key
        else:
            torch.testing.assert_close(tuned_state[key], value - 0.1 * grads[key], rtol=1e-4, atol=1e-6, msg=key)
    reloaded = {f"dit.{k}": v for k, v in tuned.denoiser.state_dict().items()}
    reloaded.update({f"text_encoder.{k}": v for k, v in tuned.text_encoders[0].state_dict().items()})
    assert all(torch.equal(v, tuned_state[k]) for k, v in reloaded.items())
    for prefix in ("dit.", "text_encoder."):  # both trained
        assert max((tuned_state[k] - v).abs().max() for k, v in base_state.items() if k.startswith(prefix)) > 1e-4


def test_extract_recovers_the_fine_tuned_difference(toydit, model_files, fine_tuned, tmp_path):
    result, _ = fine_tuned
    extracted = extract_lora_from_models.run([
        "--model_org", str(model_files["full"]), "--model_tuned", str(result.output), "--save_to",
        str(tmp_path / "extracted.safetensors"), "--dim", "32", "--clamp_quantile", "1", "--min_diff", "0",
    ])  # fmt: skip
    assert read_metadata(extracted)["ss_base_model_version"] == "toydit_v1"
    deltas = _deltas(extracted)
    base, _ = load_state_dict(model_files["full"])
    tuned, _ = load_state_dict(result.output)
    kohya = {"dit.": "lora_unet_", "text_encoder.": "lora_te1_"}  # the family's adapter roots, module paths as they are
    weights = {kohya[prefix] + key[len(prefix) : -len(".weight")].replace(".", "_"): key for key in base
               for prefix in kohya if key.startswith(prefix) and key.endswith(".weight") and base[key].ndim == 2}  # fmt: skip
    assert len(deltas) == 26 and set(deltas) <= set(weights)  # 18 transformer + 8 text-encoder modules
    for name, delta in deltas.items():
        key = weights[name]
        torch.testing.assert_close(delta, tuned[key] - base[key], rtol=1e-3, atol=1e-6, msg=name)
