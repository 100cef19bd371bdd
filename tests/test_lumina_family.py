"""The Lumina Image 2.0 family (library/families/lumina/) on tiny models with the real module names.

Oracles: diffusers' own single-file converter ``convert_lumina2_to_diffusers`` for the key map (at the released
widths, on the meta device), the tiny parts themselves for every file layout users have (Alpha-VLLM file with and
without ``model.diffusion_model.``, ComfyUI's all-in-one file, a diffusers folder: the same weights back), the
tokenizer called directly for the prompt rule, diffusers' transformer called directly for ``predict``, and the flow
math for the objective. sd-scripts' own functions are compared by benchmarks/lumina_vs_sdscripts.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _lumina_helpers import write_layouts

from library.families import FAMILIES, detect_family
from library.families.lumina import LUMINA2
from library.families.lumina import keys as K
from library.families.lumina.model import released, transformer_factory
from library.families.lumina.objective import LuminaFlowConfig, LuminaFlowObjective, lumina_mu, sample_sigmas
from library.families.lumina.options import LuminaOptions
from library.families.lumina.tiny import build_tiny_lumina
from library.families.protocol import missing_members
from library.objectives.losses import LossConfig


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_lumina(seed=0)


@pytest.fixture(scope="module")
def layouts(tiny, tmp_path_factory):
    return write_layouts(tiny, tmp_path_factory.mktemp("lumina"))


def test_the_family_satisfies_the_contract(tiny):
    from tests.test_family_contract import signature_problems

    assert FAMILIES["lumina2"] is LUMINA2 and missing_members(LUMINA2) == [] and signature_problems(LUMINA2) == []
    assert LUMINA2.objective(tiny) == tiny.prediction_type == "flow_matching"
    assert [r.prefix for r in LUMINA2.adapter_roots(tiny)] == list(LUMINA2.adapter_prefixes) == ["lora_unet", "lora_te"]
    assert LUMINA2.modelspec_architecture("lora") == "lumina-2/lora" and LUMINA2.base_model_version() == "lumina2"
    reference = LUMINA2.reference_parts()
    assert {p.device.type for p in reference.denoiser.parameters()} == {"meta"}
    assert reference.denoiser.config.hidden_size == reference.text_encoders[0].config.hidden_size == 2304
    assert len(LUMINA2.swap_blocks(reference.denoiser)[0].blocks) == 26


def test_key_map_equals_diffusers_single_file_converter_at_the_released_widths():
    """Our Alpha-VLLM names of the released 2B transformer, run through diffusers' ``convert_lumina2_to_diffusers``,
    give back every key of ``Lumina2Transformer2DModel`` with its shape (q / k / v split 2304 / 768 / 768), as our own
    reader does; and every diffusers module path renames to the Alpha-VLLM module of those keys."""
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    with init_empty_weights():
        model = transformer_factory(released()["transformer"])()
    state = {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}
    alpha = K.diffusers_to_alpha(state)  # (diffusers' converter reads no prefixed keys: it lists them before renaming)
    assert "layers.25.attention.qkv.weight" in alpha and K.is_alpha(alpha)
    theirs = convert_lumina2_to_diffusers(dict(alpha))
    ours = K.alpha_to_diffusers({"model.diffusion_model." + k: v for k, v in alpha.items()}, 24, 8)
    expected = {k: tuple(v.shape) for k, v in state.items()}
    assert {k: tuple(v.shape) for k, v in theirs.items()} == expected == {k: tuple(v.shape) for k, v in ours.items()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(K.QKV):
            assert f"{K.rename(name)}.weight" in alpha, name


@pytest.mark.parametrize("layout", ["model", "prefixed", "allinone", "folder"])
def test_every_layout_loads_the_same_weights(tiny, layouts, layout):
    """The Alpha-VLLM file (with --gemma2 --ae), the same under model.diffusion_model., ComfyUI's all-in-one file (no
    flags) and the diffusers folder all load the tiny parts' weights exactly; files are detected as Lumina 2."""
    given = {} if layout in ("allinone", "folder") else {"gemma2": layouts["gemma2"], "ae": layouts["ae"]}
    parts = LUMINA2.load(layouts[layout], options=LuminaOptions(**given))
    for ours, theirs in ((parts.denoiser, tiny.denoiser), (parts.vae, tiny.vae),
                         (parts.text_encoders[0], tiny.text_encoders[0])):  # fmt: skip
        a, b = ours.state_dict(), theirs.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert detect_family(layouts[layout]).name == "lumina2"
    assert parts.tokenizers[0]("a b").input_ids == tiny.tokenizers[0]("a b").input_ids


def test_a_missing_part_or_tokenizer_is_named(layouts, tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="--gemma2.*required"):
        LUMINA2.load(layouts["model"], options=LuminaOptions(ae=layouts["ae"]))
    lonely = tmp_path / "gemma" / "gemma-2-2b.safetensors"
    lonely.parent.mkdir()
    save_file(load_file(layouts["gemma2"]), lonely)
    model = tmp_path / "model" / "lumina.safetensors"
    model.parent.mkdir()
    save_file(load_file(layouts["model"]), model)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*--tokenizer_cache_dir"):
        LUMINA2.load(model, options=LuminaOptions(gemma2=str(lonely), ae=layouts["ae"]))
    cache = tmp_path / "cache" / "google_gemma-2-2b"
    from library.families.lumina.tiny import write_tokenizer

    write_tokenizer(cache)
    parts = LUMINA2.load(model, options=LuminaOptions(gemma2=str(lonely), ae=layouts["ae"]),
                         tokenizer_cache_dir=str(cache.parent))  # fmt: skip
    assert parts.tokenizers[0].padding_side == "right"
    hub = tmp_path / "hub"  # sd-scripts' --tokenizer_cache_dir as the hub fills it
    write_tokenizer(hub / "models--google--gemma-2-2b" / "snapshots" / "abc123")
    from library.families.lumina.model import load_gemma_tokenizer

    assert load_gemma_tokenizer([], str(hub))("a").input_ids == parts.tokenizers[0]("a").input_ids


def test_prompts_follow_sd_scripts_rule(tiny):
    """system prompt + " <Prompt Start> " + caption, BOS, truncated and right-padded to --gemma2_max_token_length (a
    multiple of 8: a length that is not one is refused, as the tokenizer does); negative prompts without the system
    prompt; the condition is Gemma's hidden_states[-2]."""
    import argparse

    from library.cli.problems import ConfigError

    with pytest.raises(ConfigError, match="--gemma2_max_token_length 13.*multiple of 8"):
        LuminaOptions.from_args(argparse.Namespace(gemma2_max_token_length=13), training=False)
    parts = copy.copy(tiny)
    parts.options = LuminaOptions(system_prompt="Hi", gemma2_max_token_length=32)
    ids, mask = LUMINA2.tokenize(parts, ["a red cube", "x"])
    tok = tiny.tokenizers[0]
    direct = tok("Hi <Prompt Start> a red cube").input_ids
    assert ids.shape == (2, 32) and ids[0, : len(direct)].tolist() == direct and ids[0, 0] == 2
    n = len(tok("Hi <Prompt Start> x").input_ids)
    assert mask[1].tolist() == [1] * n + [0] * (32 - n) and ids[1, n:].eq(0).all()
    neg, _ = LUMINA2.tokenize(parts, ["x"], negative=True)
    assert neg[0, :3].tolist() == tok("x").input_ids + [0]
    cond = LUMINA2.encode_tokens(parts, [ids, mask])
    hidden = tiny.text_encoders[0](input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
    assert torch.equal(cond.hidden_states, hidden) and cond.pooled is None and torch.equal(cond.mask, mask)


def test_predict_runs_the_transformer_on_one_minus_sigma_and_negates(tiny):
    g = torch.Generator().manual_seed(0)
    x, hidden = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 8, 32, generator=g)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    from library.families.base import Cond

    with torch.no_grad():
        out = LUMINA2.predict(tiny.denoiser, x, torch.tensor([250.0, 900.0]), Cond(hidden, None, mask))
        direct = tiny.denoiser(x, 1 - torch.tensor([250.0, 900.0]) / 1000, hidden, mask, return_dict=False)[0]
    assert torch.equal(out, -direct)


@pytest.mark.parametrize("kind", ["raw", "sigma_scaled"])
def test_the_objective_targets_x0_minus_noise(tiny, kind):
    """Given timesteps: x_σ = (1 − σ) x0 + σ ε, target x0 − ε; a network that outputs x0 − ε exactly (``predict``
    negates it) has loss 0 with raw; sigma_scaled compares x_σ − σ o."""
    objective = LuminaFlowObjective(LuminaFlowConfig(model_prediction_type=kind), LossConfig())
    x0 = torch.randn(2, 16, 8, 8)
    ex = objective.example(x0, torch.Generator().manual_seed(1), timesteps=torch.tensor([200.0, 700.0]))
    s = torch.tensor([0.2, 0.7]).view(-1, 1, 1, 1)
    assert torch.allclose(ex.noisy, (1 - s) * x0 + s * ex.noise) and torch.equal(ex.target, x0 - ex.noise)
    pred = objective.prediction(-(x0 - ex.noise), ex)
    loss = objective.loss_per_sample(pred, ex)
    if kind == "raw":
        assert torch.equal(loss, torch.zeros(2))
    else:
        expected = ((ex.noisy - s * (x0 - ex.noise) - ex.target) ** 2).mean((1, 2, 3))
        assert torch.allclose(loss, expected)


def test_nextdit_shift_is_uniform_then_the_resolution_time_shift():
    cfg = LuminaFlowConfig(timestep_sampling="nextdit_shift")
    sigmas, timesteps = sample_sigmas(cfg, 4, (128, 128), torch.Generator().manual_seed(3))
    u = torch.rand(4, generator=torch.Generator().manual_seed(3))
    mu = 0.5 + (1.15 - 0.5) * (64 * 64 - 256) / (4096 - 256)
    assert lumina_mu(128, 128) == pytest.approx(mu) and math.isclose(lumina_mu(32, 32), 0.5)
    assert torch.allclose(sigmas, math.exp(mu) / (math.exp(mu) + 1 / u - 1)) and torch.equal(timesteps, sigmas * 1000)
    assert LuminaFlowConfig().discrete_flow_shift == 6.0 and LuminaFlowConfig().timestep_sampling == "shift"
