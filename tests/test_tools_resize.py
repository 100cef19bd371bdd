"""networks/resize_lora.py on tiny-model adapter files. Oracles: ΔW from the file tensors by the independent formulas
(_networks_helpers), ``torch.linalg.svdvals`` of the full ΔW, the dynamic-rank and recipe definitions typed here."""

from __future__ import annotations

import pytest
import torch
from _tools_helpers import base_weights, file_deltas, ranks, svdvals, write_adapter
from test_tools_lowrank import cumulative_rank, fro_rank, ratio_rank

from library.cli.parse import ConfigError
from library.files import metadata as md
from library.files.weights import load_state_dict
from networks import resize_lora


def resize(*argv):
    return resize_lora.run([str(a) for a in argv])


@pytest.fixture(scope="module")
def sd1_lora(tiny_parts, tmp_path_factory):
    path = tmp_path_factory.mktemp("resize") / "locon.safetensors"
    return write_adapter(tiny_parts["sd1"], path, "conv_dim=4", "conv_alpha=2", dim=8, alpha=4.0)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_full_rank_resize_is_lossless(tiny_parts, tmp_path, family):
    parts = tiny_parts[family]
    src = write_adapter(parts, tmp_path / "a.safetensors", "conv_dim=4", "conv_alpha=2", dim=8, alpha=4.0)
    resize("--model", src, "--save_to", tmp_path / "b.safetensors", "--new_rank", 8, "--new_conv_rank", 4)
    weights = base_weights(parts)
    before, after = file_deltas(src, weights), file_deltas(tmp_path / "b.safetensors", weights)
    assert before.keys() == after.keys() and len(before) > 100
    for name, delta in before.items():
        torch.testing.assert_close(after[name], delta, atol=1e-5, rtol=1e-5)
    meta = load_state_dict(tmp_path / "b.safetensors")[1]
    assert meta["ss_network_alpha"] == "4.0" and meta["ss_network_dim"] == "8"  # the scale alpha / r is kept


def test_resize_to_rank_r_is_the_best_rank_r_approximation(tiny_parts, sd1_lora, tmp_path):
    resize("--model", sd1_lora, "--save_to", tmp_path / "r3.safetensors", "--new_rank", 3, "--new_conv_rank", 2)
    weights = base_weights(tiny_parts["sd1"])
    before, after = file_deltas(sd1_lora, weights), file_deltas(tmp_path / "r3.safetensors", weights)
    for name, delta in before.items():
        r = 2 if delta.dim() == 4 and delta.shape[-1] == 3 else 3
        s_in, s_out = svdvals(delta), svdvals(after[name])
        torch.testing.assert_close(s_out[:r], s_in[:r], rtol=1e-4, atol=1e-6)
        assert float(s_out[r:].abs().max()) < 1e-5 * float(s_in[0])  # rank r exactly
        err = float(torch.linalg.vector_norm((delta - after[name]).double()))
        assert err == pytest.approx(float(s_in[r:].norm()), rel=1e-3, abs=1e-6)  # Eckart-Young
    assert set(ranks(tmp_path / "r3.safetensors").values()) == {2, 3}


@pytest.mark.parametrize(
    "method,param,rule",
    [("sv_ratio", 2.0, ratio_rank), ("sv_cumulative", 0.7, cumulative_rank), ("sv_fro", 0.9, fro_rank)],  # fmt: skip
)
def test_dynamic_methods_keep_the_ranks_their_definitions_imply(tiny_parts, sd1_lora, tmp_path, method, param, rule):
    out = tmp_path / "dyn.safetensors"
    resize("--model", sd1_lora, "--save_to", out, "--new_rank", 6, "--dynamic_method", method, "--dynamic_param", param)
    weights = base_weights(tiny_parts["sd1"])
    kept = ranks(out)
    before = file_deltas(sd1_lora, weights)
    rank_in = ranks(sd1_lora)
    for name, delta in before.items():
        S = [float(s) for s in svdvals(delta)[: rank_in[name]]]
        assert kept[name] == min(rule(S, param), 6), name
    assert len(set(kept.values())) > 1  # the test means something: ranks differ between modules
    meta = load_state_dict(out)[1]
    assert meta["ss_network_dim"] == "Dynamic" or len({r for r in kept.values()}) == 1
    assert meta["ss_training_comment"].startswith(f"Dynamic resize with {method}: {param} from 8")


def test_metadata_is_updated_and_hashes_recomputed(sd1_lora, tmp_path):
    out = tmp_path / "m.safetensors"
    resize("--model", sd1_lora, "--save_to", out, "--new_rank", 3, "--save_precision", "fp16")
    tensors, meta = load_state_dict(out)
    assert all(t.dtype == torch.float16 for t in tensors.values())
    assert meta["ss_network_dim"] == "3" and meta["ss_network_alpha"] == str(4.0 / 8 * 3)
    assert meta["ss_training_comment"] == "dimension is resized from 8 to 3 (conv: None)" or meta[
        "ss_training_comment"
    ].startswith("dimension is resized from 8 to 3")
    assert meta["ss_output_name"] == "t"  # the rest of the input's metadata is kept
    model_hash, legacy = md.sshs_hashes(tensors, meta)
    assert (meta["sshs_model_hash"], meta["sshs_legacy_hash"]) == (model_hash, legacy)
    assert model_hash != load_state_dict(sd1_lora)[1].get("sshs_model_hash")


@pytest.mark.parametrize(
    "args",
    [
        ("algo=loha", "conv_dim=4"),
        ("algo=lokr", "factor=4", "conv_dim=4"),
        ("algo=lora", "dora_wd=True"),
        ("algo=loha", "use_tucker=True", "conv_dim=4"),
    ],  # fmt: skip
    ids=["loha", "lokr", "dora", "loha-tucker"],
)
def test_lycoris_algorithms_resize_into_an_equal_lora(tiny_parts, tiny_dir, tmp_path, args):
    parts = tiny_parts["sd1"]
    src = write_adapter(parts, tmp_path / "a.safetensors", *args, dim=4, alpha=2.0, module="lycoris.kohya")
    out = tmp_path / "b.safetensors"
    resize("--model", src, "--save_to", out, "--new_rank", 512, "--base_model", tiny_dir / "sd1")
    weights = base_weights(parts)
    before, after = file_deltas(src, weights), file_deltas(out, weights)
    assert before.keys() == after.keys()
    for name, delta in before.items():
        torch.testing.assert_close(after[name], delta, atol=2e-5, rtol=1e-4)
    tensors, meta = load_state_dict(out)
    assert {k.rsplit(".", 2)[-2] if k.endswith(".weight") else k.rsplit(".", 1)[-1] for k in tensors} == {
        "lora_down", "lora_up", "alpha"}  # fmt: skip
    assert meta["ss_network_module"] == "networks.lora"


def test_dora_and_unknown_shapes_need_the_base_model(tiny_parts, tmp_path):
    dora = write_adapter(tiny_parts["sd1"], tmp_path / "d.safetensors", "dora_wd=True", dim=4, module="lycoris.kohya")
    with pytest.raises(ValueError, match="DoRA module.*depends on the base weights.*--base_model"):
        resize("--model", dora, "--save_to", tmp_path / "x.safetensors")
    loha = write_adapter(tiny_parts["sd1"], tmp_path / "h.safetensors", "algo=loha", dim=4, module="lycoris.kohya")
    with pytest.raises(ValueError, match="cannot be read from the file.*--base_model"):
        resize("--model", loha, "--save_to", tmp_path / "x.safetensors")


def test_loha_of_the_released_architecture_needs_no_base_model(tmp_path):
    """LoHa stores a 3x3 conv kernel flattened; the released SD1 architecture (meta device) gives its shape."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    modules = {"lora_unet_down_blocks_0_resnets_0_conv1": (320, 320 * 9), "lora_te_text_model_encoder_layers_0_mlp_fc1":
               (3072, 768)}  # fmt: skip
    state = {}
    for name, (out_dim, flat_in) in modules.items():
        for half in ("1", "2"):
            state[f"{name}.hada_w{half}_a"] = torch.randn(out_dim, 2, generator=g) * 0.1
            state[f"{name}.hada_w{half}_b"] = torch.randn(2, flat_in, generator=g)
        state[f"{name}.alpha"] = torch.tensor(1.0)
    save_file(state, str(tmp_path / "h.safetensors"))
    resize("--model", tmp_path / "h.safetensors", "--save_to", tmp_path / "o.safetensors", "--new_rank", 4)
    out = load_state_dict(tmp_path / "o.safetensors")[0]
    assert out["lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight"].shape == (4, 320, 3, 3)
    assert out["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"].shape == (3072, 4)
    for name in modules:  # LoHa of rank 2 has rank <= 4: the resize is exact
        w = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(name)}
        want = (w["hada_w1_a"] @ w["hada_w1_b"]) * (w["hada_w2_a"] @ w["hada_w2_b"]) * 0.5
        got = out[f"{name}.lora_up.weight"].flatten(1) @ out[f"{name}.lora_down.weight"].flatten(1)
        torch.testing.assert_close(got * float(out[f"{name}.alpha"]) / 4, want, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------- elias-gaeros recipes
def _log_scores(sd1_lora, weights, ref):
    """{module: log10(σᵢ / ref(W))} by the recipe's definition."""
    out = {}
    for name, delta in file_deltas(sd1_lora, weights).items():
        w = weights[name].double().reshape(weights[name].shape[0], -1)
        r = ranks(sd1_lora)[name]
        out[name] = torch.log10(svdvals(delta)[:r] / ref(w))
    return out


@pytest.mark.parametrize("key", ["fro_ckpt", "spn_ckpt"])
def test_recipe_threshold_keeps_what_the_definition_implies(tiny_parts, tiny_dir, sd1_lora, tmp_path, key):
    weights = base_weights(tiny_parts["sd1"])
    ref = (lambda w: torch.linalg.matrix_norm(w)) if key == "fro_ckpt" else (lambda w: torch.linalg.matrix_norm(w, 2))
    scores = _log_scores(sd1_lora, weights, ref)
    thr = float(torch.cat(list(scores.values())).median()) + 1e-4  # keeps about half: a real test
    out = tmp_path / "r.safetensors"
    resize("--model", sd1_lora, "--save_to", out, "-r", f"{key}=1,thr={thr}", "--base_model", tiny_dir / "sd1")
    kept = ranks(out)
    for name, s in scores.items():
        expected = int((s > thr).sum())
        assert kept.get(name, 0) == expected, name
    assert 0 < len(kept) < len(scores) or any(kept[n] < ranks(sd1_lora)[n] for n in kept)
    assert load_state_dict(out)[1]["ss_network_dim"] == "Dynamic"


def test_recipe_size_keeps_the_best_scores_within_the_size(tiny_parts, tiny_dir, sd1_lora, tmp_path):
    weights = base_weights(tiny_parts["sd1"])
    scores = _log_scores(sd1_lora, weights, lambda w: torch.linalg.matrix_norm(w))
    cost = {n: 2 * (weights[n].shape[0] + weights[n].shape[1:].numel()) for n in scores}  # fp16 bytes per rank
    size_mib = 0.4 * sum(cost[n] * len(s) for n, s in scores.items()) / 2**20
    out = tmp_path / "s.safetensors"
    resize("--model", sd1_lora, "--save_to", out, "-r", f"fro_ckpt=1,size={size_mib}", "--base_model",
           tiny_dir / "sd1", "--save_precision", "fp16")  # fmt: skip
    kept = ranks(out)
    used = sum(cost[n] * r for n, r in kept.items())
    assert used <= size_mib * 2**20
    worst_kept = min(float(scores[n][r - 1]) for n, r in kept.items())
    best_dropped = max(float(s[kept.get(n, 0)]) for n, s in scores.items() if kept.get(n, 0) < len(s))
    assert worst_kept > best_dropped  # greedy: every kept value scores above every dropped one
    cheapest = min(cost.values())
    assert used + cheapest > size_mib * 2**20 * 0.9  # and the budget is used


def test_spn_lora_recipe_equals_sv_ratio(sd1_lora, tmp_path):
    """elias-gaeros' README: spn_lora=1,thr=-0.7 is sd-scripts' sv_ratio with param 10^0.7."""
    resize("--model", sd1_lora, "--save_to", tmp_path / "a.safetensors", "-r", "spn_lora=1,thr=-0.3")
    resize("--model", sd1_lora, "--save_to", tmp_path / "b.safetensors", "--new_rank", 64,
           "--dynamic_method", "sv_ratio", "--dynamic_param", 10**0.3)  # fmt: skip
    assert ranks(tmp_path / "a.safetensors") == ranks(tmp_path / "b.safetensors")


def test_elias_command_line_writes_one_file_per_recipe(tiny_dir, sd1_lora, tmp_path):
    written = resize("-o", tmp_path, "-r", "fro_ckpt=1,thr=-3.55:spn_lora=1,thr=-0.7", tiny_dir / "sd1", sd1_lora)
    assert [p.name for p in written] == ["locon_frockpt1_th-3.55.safetensors", "locon_spnlora1_th-0.7.safetensors"]
    tensors = load_state_dict(written[0])[0]
    assert all(t.dtype == torch.float16 for t in tensors.values())  # elias-gaeros' default output: 16 bit


def test_bad_command_lines_are_reported_together(sd1_lora, tmp_path):
    with pytest.raises(ConfigError) as e:
        resize("--model", sd1_lora, "--save_to", tmp_path / "x.bin", "--dynamic_method", "sv_fro", "-r", "fro_ckt=1")
    text = str(e.value)
    assert "--save_to" in text and "--dynamic_param" in text and "unknown key 'fro_ckt'" in text
    with pytest.raises(ConfigError, match="judged against the base model: pass --base_model"):
        resize("--model", sd1_lora, "--save_to", tmp_path / "x.safetensors", "-r", "fro_ckpt=1,thr=-2")
    with pytest.raises(ConfigError, match="either thr"):
        resize("--model", sd1_lora, "--save_to", tmp_path / "x.safetensors", "-r", "spn_lora,thr=-1,size=3")
    assert not list(tmp_path.glob("x.*"))


class _RunsCode:
    def __reduce__(self):
        return (print, ("this would run when unpickled",))


def test_a_pickle_with_code_is_refused_and_incomplete_modules_named(tmp_path):
    torch.save({"lora_unet_x.lora_down.weight": torch.zeros(2, 2), "evil": _RunsCode()}, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match="could run arbitrary code"):
        resize("--model", tmp_path / "bad.ckpt", "--save_to", tmp_path / "out.safetensors")
    torch.save({"lora_unet_x.lora_down.weight": torch.zeros(2, 2)}, tmp_path / "half.pt")
    with pytest.raises(ValueError, match="lora_unet_x lacks lora_up.weight"):
        resize("--model", tmp_path / "half.pt", "--save_to", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_elias_sum_of_loras_is_resized_exactly(tiny_parts, tiny_dir, tmp_path):
    """``a.safetensors,b.safetensors:0.5`` (elias-gaeros' syntax) is the exact sum; thr=-9 keeps every rank."""
    parts = tiny_parts["sd1"]
    a = write_adapter(parts, tmp_path / "a.safetensors", dim=4, alpha=2.0, seed=1)
    b = write_adapter(parts, tmp_path / "b.safetensors", dim=2, alpha=2.0, seed=2)
    (out,) = resize("-o", tmp_path, "-t", 32, "-r", "spn_lora=1,thr=-9", tiny_dir / "sd1", f"{a},{b}:0.5")
    assert out.name == "a+b(0.50)_spnlora1_th-9.safetensors"
    weights = base_weights(parts)
    da, db, got = file_deltas(a, weights), file_deltas(b, weights), file_deltas(out, weights)
    for name, delta in got.items():
        torch.testing.assert_close(delta, da[name] + 0.5 * db[name], atol=1e-5, rtol=1e-4)


def test_an_adapter_for_another_family_than_the_base_model_is_refused(tiny_parts, tiny_dir, tmp_path):
    xl = write_adapter(tiny_parts["sdxl"], tmp_path / "xl.safetensors", dim=2)
    with pytest.raises(ValueError, match=r"lora_te1.*this model does not have.*SDXL"):
        resize("--model", xl, "--save_to", tmp_path / "o.safetensors", "-r", "fro_ckpt=1,thr=-2", "--base_model",
               tiny_dir / "sd1")  # fmt: skip


def test_pickle_outputs_are_a_plain_dict_of_tensors(sd1_lora, tmp_path):
    """sd-scripts, diffusers, A1111 and ComfyUI read adapter .ckpt / .pt files as a plain dict of tensors."""
    resize("--model", sd1_lora, "--save_to", tmp_path / "r.ckpt", "--new_rank", 2)
    obj = torch.load(tmp_path / "r.ckpt", weights_only=True)
    assert "state_dict" not in obj and all(isinstance(v, torch.Tensor) for v in obj.values())
    assert obj.keys() == load_state_dict(tmp_path / "r.ckpt")[0].keys() and len(obj) > 100
