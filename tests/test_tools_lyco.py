"""The post-training tools on LyCORIS full / "diff", (IA)³ and GLoRA files (tiny SD1 model): one exact path per tool
and algorithm, and the refusals. Oracles: lycoris-lora's own ΔW functions on the same tensors and base weights
(``_glora_weight``, ``_ia3_weight``; full: the stored diff) and its forward pass for merges into a model.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _networks_helpers import outputs, single_thread, unet_inputs  # noqa: F401  (autouse fixture)
from _tools_helpers import base_weights, ranks, write_adapter
from _tools_helpers import file_deltas as lora_deltas
from test_networks_oracles import (
    _lycoris_forward,
    lycoris,  # noqa: F401  (the fixture: LyCORIS 4.1.3 patched for diffusers UNets)
    lycoris_kohya,
)

from library.cli.parse import ConfigError
from library.families import get_family
from library.files.weights import load_state_dict
from networks import check_lora_weights, merge_lora, resize_lora, svd_merge_lora
from networks.files import group_by_module
from networks.lycoris_reader import _ia3_reads_on_input

glora_mod = pytest.importorskip("lycoris.modules.glora")
ia3_mod = pytest.importorskip("lycoris.modules.ia3")

ARGS = {"full": ("algo=full",), "ia3": ("algo=ia3", "train_on_input=True"), "glora": ("algo=glora", "conv_dim=2")}


def run(main, *argv):
    return main([str(a) for a in argv])


def lycoris_deltas(path, weights: dict) -> dict[str, torch.Tensor]:
    """{module: ΔW} of a full / (IA)³ / GLoRA file by lycoris-lora's own functions."""
    state, _ = load_state_dict(path)
    out = {}
    for name, t in group_by_module(state).items():
        w = weights[name].float()
        if "diff" in t:
            out[name] = t["diff"].float().reshape(w.shape)
        elif "on_input" in t:
            out[name] = ia3_mod._ia3_weight(w, t["weight"].float(), bool(t["on_input"]), 1.0, True)
        else:
            r = t["a2.weight"].shape[0]
            gamma = float(t["alpha"]) / r
            out[name] = glora_mod._glora_weight(w, *(t[f"{k}.weight"].float() for k in ("a1", "a2", "b1", "b2")),
                                                None, gamma)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def adapters(tiny_parts, tmp_path_factory):
    parts, folder = tiny_parts["sd1"], tmp_path_factory.mktemp("adapters")
    return {a: write_adapter(parts, folder / f"{a}.safetensors", *args, dim=4, alpha=2.0, module="lycoris.kohya",
                             seed=i) for i, (a, args) in enumerate(ARGS.items())}  # fmt: skip


@pytest.mark.usefixtures("lycoris")
@pytest.mark.parametrize("algo", list(ARGS))
def test_merge_into_a_model_equals_the_lycoris_forward(tiny_parts, tiny_dir, adapters, tmp_path, algo):
    """merge_lora.py --sd_model: W ← W + ratio·ΔW (full: and b ← b + ratio·diff_b), exactly LyCORIS' output."""
    parts, src, out = tiny_parts["sd1"], adapters[algo], tmp_path / "merged.safetensors"
    run(merge_lora.run, "--sd_model", tiny_dir / "sd1", "--models", src, "--ratios", 0.6, "--save_to", out)
    inputs = unet_inputs(parts)
    with _ia3_reads_on_input():
        expected, count = _lycoris_forward(lycoris_kohya, parts, src, 0.6, inputs)
    assert count > 30
    assert float((expected[0] - outputs(parts, inputs)[0]).abs().max()) > 1e-2  # the adapter changes the output
    for got, want in zip(outputs(get_family("sd1").load(out), inputs), expected):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("algo", list(ARGS))
def test_resize_to_full_rank_is_the_same_delta(tiny_parts, tiny_dir, adapters, tmp_path, caplog, algo):
    """resize_lora.py at a rank above every layer's: a LoRA with the same ΔW (full's diff_b: dropped, with a warning;
    (IA)³ and GLoRA: ΔW through --base_model)."""
    out = tmp_path / "r.safetensors"
    with caplog.at_level(logging.WARNING):
        run(resize_lora.run, "--model", adapters[algo], "--save_to", out, "--new_rank", 512, "--base_model",
            tiny_dir / "sd1")  # fmt: skip
    weights = base_weights(tiny_parts["sd1"])
    before, after = lycoris_deltas(adapters[algo], weights), lora_deltas(out, weights)
    assert before.keys() == after.keys()
    for name, delta in before.items():
        torch.testing.assert_close(after[name], delta, atol=2e-5, rtol=1e-4)
    assert ("bias changes (diff_b)" in caplog.text and "are dropped" in caplog.text) == (algo == "full")


def test_tools_without_the_base_model_refuse_ia3_and_glora_and_read_full(adapters, tmp_path):
    for algo in ("ia3", "glora"):
        with pytest.raises(ValueError, match=f"{algo} module.*depends on the base weights.*--base_model"):
            run(resize_lora.run, "--model", adapters[algo], "--save_to", tmp_path / "x.safetensors")
    run(resize_lora.run, "--model", adapters["full"], "--save_to", tmp_path / "f.safetensors", "--new_rank", 2)
    assert set(ranks(tmp_path / "f.safetensors").values()) == {2}


def test_svd_merge_of_full_and_glora_is_the_exact_sum_at_full_rank(tiny_parts, tiny_dir, adapters, tmp_path):
    out = tmp_path / "svd.safetensors"
    run(svd_merge_lora.run, "--models", adapters["full"], adapters["glora"], "--ratios", 1.0, -0.5, "--new_rank", 512,
        "--save_to", out, "--base_model", tiny_dir / "sd1")  # fmt: skip
    weights = base_weights(tiny_parts["sd1"])
    full, glora = (lycoris_deltas(adapters[a], weights) for a in ("full", "glora"))
    merged = lora_deltas(out, weights)
    assert merged.keys() == full.keys() | glora.keys()
    for name, delta in merged.items():
        torch.testing.assert_close(delta, full.get(name, 0) - 0.5 * glora.get(name, 0), atol=2e-5, rtol=1e-4)


def test_concatenation_refuses_them_and_points_to_the_exact_tools(adapters, tmp_path):
    with pytest.raises(ConfigError, match="(?s)full \\(not a plain LoRA\\).*svd_merge_lora.py.*--sd_model"):
        run(merge_lora.run, "--models", adapters["full"], adapters["ia3"], "--save_to", tmp_path / "m.safetensors")


def test_check_lora_weights_lists_every_tensor_and_finds_untrained_modules(adapters, tmp_path, tiny_parts):
    for algo, path in adapters.items():
        result = check_lora_weights.check_file(path)
        assert not result.problems, result.problems  # trained: no module reads as ΔW = 0 (on_input = 1 is a setting)
        assert len(result.tensor_lines) == len(load_state_dict(path)[0])  # every key: diff, weight, a1.weight...
        assert f"{algo} {result.modules}" in result.summary[0]
    state, meta = load_state_dict(adapters["glora"])
    name = next(k for k in state if k.endswith("a2.weight")).removesuffix(".a2.weight")
    state[f"{name}.b2.weight"].zero_()  # the B term is 0, W·a1·a2 is not: ΔW ≠ 0
    from library.files.weights import save_state_dict

    save_state_dict(state, tmp_path / "half.safetensors")
    assert not check_lora_weights.check_file(tmp_path / "half.safetensors").problems
    state[f"{name}.a1.weight"].zero_()  # now both terms are
    save_state_dict(state, tmp_path / "zero.safetensors")
    assert f"1 module(s) have ΔW = 0 (never trained?), e.g. {name}" in check_lora_weights.check_file(
        tmp_path / "zero.safetensors").problems[0]  # fmt: skip
