"""networks/merge_lora.py, sdxl_merge_lora.py and svd_merge_lora.py on the tiny models.

Oracles: diffusers' ``load_lora_weights`` + ``fuse_lora`` for LoRA/LoCon into a checkpoint, LyCORIS' forward pass
(``apply_to``) for LoHa / LoKr / DoRA, ΔW by the independent formulas and ``torch.linalg.svdvals`` for LoRA outputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _networks_helpers import outputs, unet_inputs
from _tools_helpers import base_weights, file_deltas, ranks, svdvals, write_adapter
from test_networks_oracles import (
    _lycoris_forward,
    _pipeline,
    lycoris,  # noqa: F401  (the fixture: LyCORIS 4.1.3 patched for diffusers UNets)
    lycoris_kohya,
)

from library.cli.parse import ConfigError
from library.families import get_family
from library.files.weights import load_state_dict
from networks import merge_lora, sdxl_merge_lora, svd_merge_lora


def run(main, *argv):
    return main([str(a) for a in argv])


def _fused_by_diffusers(parts, files_and_ratios):
    """A copy of ``parts`` with each LoRA fused by diffusers (load_lora_weights, fuse_lora, unload), in order."""
    theirs = copy.deepcopy(parts)
    pipe = _pipeline(theirs)
    for i, (path, ratio) in enumerate(files_and_ratios):
        pipe.load_lora_weights(str(path), adapter_name=f"a{i}")
        pipe.fuse_lora(lora_scale=ratio, adapter_names=[f"a{i}"])
        pipe.unload_lora_weights()
    return theirs


def _assert_same_weights(a, b, atol=2e-6):
    for ma, mb in [(a.denoiser, b.denoiser), *zip(a.text_encoders, b.text_encoders)]:
        sa, sb = ma.state_dict(), mb.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k].float(), sb[k].float(), atol=atol, rtol=1e-5, msg=k)


@pytest.mark.parametrize("family,out_name", [("sd1", "merged.safetensors"), ("sdxl", "merged.safetensors"),
                                             ("sd1", "merged_diffusers")])  # fmt: skip
def test_merge_into_checkpoint_equals_diffusers_fuse_lora(tiny_parts, tiny_dir, tmp_path, family, out_name):
    parts = tiny_parts[family]
    a = write_adapter(parts, tmp_path / "a.safetensors", dim=4, alpha=2.0, seed=1)
    b = write_adapter(parts, tmp_path / "b.safetensors", "conv_dim=4", "conv_alpha=1", dim=8, alpha=8.0, seed=2)
    main = sdxl_merge_lora.run if family == "sdxl" else merge_lora.run
    run(main, "--sd_model", tiny_dir / family, "--models", a, b, "--ratios", 0.7, -0.4, "--save_to",
        tmp_path / out_name)  # fmt: skip
    fam = get_family(family)
    ours = fam.load(tmp_path / out_name)
    theirs = _fused_by_diffusers(parts, [(a, 0.7), (b, -0.4)])
    _assert_same_weights(ours, theirs)
    assert (ours.denoiser.state_dict()["conv_in.weight"] == parts.denoiser.state_dict()["conv_in.weight"]).all()
    if out_name.endswith(".safetensors"):
        meta = load_state_dict(tmp_path / out_name)[1]
        assert meta["modelspec.merged_from"] == f"{family}, a, b"
        assert meta["modelspec.architecture"] == fam.modelspec_architecture("", parts.prediction_type)


LYCORIS_CASES = [
    ("sd1", ("algo=loha", "conv_dim=4"), 0.6),
    ("sd1", ("algo=lokr", "conv_dim=4", "factor=4"), 0.6),
    ("sd1", ("algo=lora", "dora_wd=True", "conv_dim=4"), 1.0),
    ("sdxl", ("algo=loha", "use_tucker=True", "conv_dim=4"), 0.6),
]


@pytest.mark.usefixtures("lycoris")
@pytest.mark.parametrize("family,args,ratio", LYCORIS_CASES, ids=["loha", "lokr", "dora", "sdxl-loha-tucker"])
def test_merging_lycoris_algorithms_equals_the_lycoris_forward(tiny_parts, tiny_dir, tmp_path, family, args, ratio):
    parts = tiny_parts[family]
    src = write_adapter(parts, tmp_path / "l.safetensors", *args, dim=4, alpha=2.0, module="lycoris.kohya")
    out = tmp_path / "merged.safetensors"
    run(merge_lora.run, "--sd_model", tiny_dir / family, "--models", src, "--ratios", ratio, "--save_to", out)
    inputs = unet_inputs(parts)
    expected, count = _lycoris_forward(lycoris_kohya, parts, src, ratio, inputs)
    assert count > 50
    got = outputs(get_family(family).load(out), inputs)
    assert float((expected[0] - outputs(parts, inputs)[0]).abs().max()) > 1e-2  # the adapter changes the output
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def test_lora_merge_concatenates_ranks_exactly(tiny_parts, tmp_path):
    parts = tiny_parts["sd1"]
    a = write_adapter(parts, tmp_path / "a.safetensors", "conv_dim=2", "conv_alpha=1", dim=4, alpha=2.0, seed=1)
    b = write_adapter(parts, tmp_path / "b.safetensors", dim=8, alpha=4.0, seed=2)
    out = tmp_path / "ab.safetensors"
    run(merge_lora.run, "--models", a, b, "--ratios", 0.8, -1.5, "--save_to", out, "--concat")
    weights = base_weights(parts)
    da, db, dm = file_deltas(a, weights), file_deltas(b, weights), file_deltas(out, weights)
    assert dm.keys() == da.keys() | db.keys()
    for name, delta in dm.items():
        want = 0.8 * da.get(name, 0) - 1.5 * db.get(name, 0)
        torch.testing.assert_close(delta, want, atol=1e-5, rtol=1e-5)
    r = ranks(out)
    assert r["lora_unet_down_blocks_0_attentions_0_proj_in"] == 12 and r["lora_unet_down_blocks_0_resnets_0_conv1"] == 2
    meta = load_state_dict(out)[1]
    assert meta["ss_network_dim"] == "Dynamic" and meta["modelspec.merged_from"] == "a, b"
    assert meta["ss_base_model_version"] == "sd_v1" and "merged by concatenating ranks" in meta["ss_training_comment"]


def test_svd_merge_is_the_best_rank_r_approximation_of_the_sum(tiny_parts, tiny_dir, tmp_path):
    parts = tiny_parts["sd1"]
    a = write_adapter(parts, tmp_path / "a.safetensors", "conv_dim=4", "conv_alpha=2", dim=4, alpha=2.0, seed=1)
    h = write_adapter(parts, tmp_path / "h.safetensors", "algo=loha", "conv_dim=2", dim=2, alpha=1.0, seed=2,
                      module="lycoris.kohya")  # fmt: skip
    out = tmp_path / "svd.safetensors"
    run(svd_merge_lora.run, "--models", a, h, "--ratios", 1.0, 0.5, "--new_rank", 3, "--new_conv_rank", 2,
        "--save_to", out, "--base_model", tiny_dir / "sd1")  # fmt: skip
    weights = base_weights(parts)
    da, dh, dm = file_deltas(a, weights), file_deltas(h, weights), file_deltas(out, weights)
    assert dm.keys() == da.keys() | dh.keys()
    for name, delta in dm.items():
        total = da.get(name, 0) + 0.5 * dh.get(name, 0)
        r = 2 if delta.dim() == 4 and delta.shape[-1] == 3 else 3
        s_sum, s_out = svdvals(total), svdvals(delta)
        torch.testing.assert_close(s_out[:r], s_sum[:r], rtol=1e-4, atol=1e-6)
        err = float(torch.linalg.vector_norm((total - delta).double()))
        assert err == pytest.approx(float(s_sum[r:].norm()), rel=1e-3, abs=1e-6)
    assert load_state_dict(out)[1]["ss_network_dim"] == "3"


# --------------------------------------------------------------------------------------------------- bad input
def test_bad_command_lines_are_reported_together(tiny_parts, tmp_path):
    a = write_adapter(tiny_parts["sd1"], tmp_path / "a.safetensors", dim=2)
    with pytest.raises(ConfigError) as e:
        run(merge_lora.run, "--models", a, tmp_path / "missing.safetensors", "--ratios", 0.5, "--save_to",
            tmp_path / "o.txt")  # fmt: skip
    text = str(e.value)
    assert "--ratios has 1 value(s) for 2" in text and "missing.safetensors: no such file" in text
    assert "--save_to" in text
    with pytest.raises(ConfigError, match="--lbws is not supported"):
        run(svd_merge_lora.run, "--models", a, "--save_to", tmp_path / "o.safetensors", "--lbws", "[1]")


def test_an_adapter_for_another_family_is_refused(tiny_parts, tiny_dir, tmp_path):
    xl = write_adapter(tiny_parts["sdxl"], tmp_path / "xl.safetensors", dim=2)
    sd = write_adapter(tiny_parts["sd1"], tmp_path / "sd.safetensors", dim=2)
    with pytest.raises(ValueError, match=r"lora_te1.*SDXL"):
        run(merge_lora.run, "--sd_model", tiny_dir / "sd1", "--models", xl, "--save_to", tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="different model families"):
        run(merge_lora.run, "--models", sd, xl, "--save_to", tmp_path / "m.safetensors")
    with pytest.raises(ConfigError, match=r"is an SD1 model; sdxl_merge_lora.py merges into SDXL models only: use "
                       r"networks/merge_lora.py"):  # fmt: skip
        run(sdxl_merge_lora.run, "--sd_model", tiny_dir / "sd1", "--models", sd, "--save_to",
            tmp_path / "m.safetensors")  # fmt: skip
    assert not (tmp_path / "m.safetensors").exists()


def test_mismatched_shapes_are_named(tiny_parts, tiny_dir, tmp_path):
    from safetensors.torch import save_file

    path = write_adapter(tiny_parts["sd1"], tmp_path / "a.safetensors", dim=2)
    state = load_state_dict(path)[0]
    key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight"
    state[key] = torch.zeros(2, 5)
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"attn1_to_q: tensors .*do not fit the model's weight of shape \(16, 16\)"):
        run(merge_lora.run, "--sd_model", tiny_dir / "sd1", "--models", tmp_path / "bad.safetensors", "--save_to",
            tmp_path / "m.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match="different models"):
        run(merge_lora.run, "--models", path, tmp_path / "bad.safetensors", "--save_to", tmp_path / "m.safetensors")


def test_concat_of_non_lora_algorithms_points_to_svd_merge(tiny_parts, tmp_path):
    a = write_adapter(tiny_parts["sd1"], tmp_path / "a.safetensors", dim=2)
    h = write_adapter(tiny_parts["sd1"], tmp_path / "h.safetensors", "algo=loha", dim=2, module="lycoris.kohya")
    with pytest.raises(ValueError, match=r"(?s)module\(s\) hold loha.*svd_merge_lora.py"):
        run(merge_lora.run, "--models", a, h, "--save_to", tmp_path / "m.safetensors")
