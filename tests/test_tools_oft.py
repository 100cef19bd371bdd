"""The post-training tools on OFT files (LyCORIS diag-oft / boft, sd-scripts' networks.oft).

Oracles: lycoris-lora 4.1.3's functional ``diff_weight`` (ΔW = R·W − W of its own code) and its forward pass
(``apply_to``), sd-scripts' OFT forward (networks/sd_scripts_oft_reader.py, itself checked in test_networks_oft.py),
``torch.linalg.svdvals`` for the rank-r LoRAs (Eckart-Young).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _networks_helpers import adapter_roots, make_config, outputs, unet_inputs
from _tools_helpers import base_weights, file_deltas, svdvals
from test_networks_oracles import (
    _lycoris_forward,
    lycoris,  # noqa: F401  (the fixture: LyCORIS 4.1.3 patched for diffusers UNets)
    lycoris_kohya,
)

from library.cli.parse import ConfigError
from library.families import get_family
from library.files.weights import load_state_dict
from networks import inject, merge_lora, resize_lora, svd_merge_lora
from networks.files import group_by_module
from networks.sd_scripts_oft_reader import apply_sd_scripts_oft

lycoris_functional = pytest.importorskip("lycoris.functional")


def run(main, *argv):
    return main([str(a) for a in argv])


def _write(parts, path, *args, module="lycoris.kohya", alpha=1e-2, seed=0):
    ours = copy.deepcopy(parts)
    network = inject(
        make_config(*args, module=module, dim=4, alpha=alpha), get_family(parts.family).adapter_roots(ours)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in network.layers():
            for name, p in layer.adapter.params.items():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1 + 0.1 * noise if name == "rescale" else 0.2 * noise)
    network.save(path, metadata={"ss_base_model_version": "sd_v1"})
    return path


def _lycoris_deltas(path, weights) -> dict[str, torch.Tensor]:
    """ΔW of every module of a LyCORIS OFT file by lycoris-lora's own functional code."""
    from lycoris.functional import boft, diag_oft

    out = {}
    for name, t in group_by_module(load_state_dict(path)[0]).items():
        w = weights[name].float()
        blocks, rescale = t["oft_blocks"].float(), t.get("rescale")
        fn = boft.diff_weight if blocks.dim() == 4 else diag_oft.diff_weight
        out[name] = fn(w, blocks, rescale, constraint=float(t["alpha"]) * w.shape[0])
    return out


@pytest.fixture(scope="module")
def doft(tiny_parts, tmp_path_factory):
    path = tmp_path_factory.mktemp("oft") / "doft.safetensors"
    args = ("algo=diag-oft", "rescaled=True", "constraint=1e-2", "conv_dim=4", "preset=unet-convblock-only")
    return _write(tiny_parts["sd1"], path, *args)  # 3x3 and 1x1 convs, Linear time-embedding projections


@pytest.mark.usefixtures("lycoris")
def test_merge_into_checkpoint_at_a_ratio_is_lycoris_forward(tiny_parts, tiny_dir, tmp_path, doft):
    """W ← rescale ⊙ (I + 0.7·(R − I))·W: the merged model's output is lycoris-lora's forward at multiplier 0.7."""
    parts = tiny_parts["sd1"]
    out = tmp_path / "merged.safetensors"
    run(merge_lora.run, "--sd_model", tiny_dir / "sd1", "--models", doft, "--ratios", 0.7, "--save_to", out)
    inputs = unet_inputs(parts, batch=1)
    want, count = _lycoris_forward(lycoris_kohya, parts, doft, 0.7, inputs)
    assert count > 40 and (want[0] - outputs(parts, inputs)[0]).abs().max() > 1e-2
    for x, y in zip(outputs(get_family("sd1").load(out), inputs), want, strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


@pytest.mark.usefixtures("lycoris")
def test_merge_into_checkpoint_in_order_is_lycoris_merge_then_sd_scripts_oft(tiny_parts, tiny_dir, tmp_path, doft):
    """diag-oft at 1.0 then sd-scripts' OFT at 0.5 on the rotated weights: lycoris' merge_to, then sd-scripts' OFT
    forward on top."""
    parts = tiny_parts["sd1"]
    koft = _write(parts, tmp_path / "koft.safetensors", module="networks.oft", seed=1)
    out = tmp_path / "merged.safetensors"
    run(merge_lora.run, "--sd_model", tiny_dir / "sd1", "--models", doft, koft, "--ratios", 1.0, 0.5,
        "--save_to", out)  # fmt: skip
    theirs = copy.deepcopy(parts)
    net, _ = lycoris_kohya.create_network_from_weights(1.0, str(doft), None, _te(theirs), theirs.denoiser)
    net.merge_to(_te(theirs), theirs.denoiser, load_state_dict(doft)[0], torch.float32, "cpu")
    assert apply_sd_scripts_oft(koft, adapter_roots(theirs), multiplier=0.5) > 100
    inputs = unet_inputs(parts, batch=1)
    for x, y in zip(outputs(get_family("sd1").load(out), inputs), outputs(theirs, inputs), strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def _te(parts):
    from torch import nn

    te = nn.Module()
    te.text_model = parts.text_encoders[0]
    return te


def test_resize_through_r_w_minus_w_with_the_base_model(tiny_parts, tiny_dir, tmp_path, doft):
    weights = base_weights(tiny_parts["sd1"])
    want = _lycoris_deltas(doft, weights)
    full = tmp_path / "full.safetensors"
    run(resize_lora.run, "--model", doft, "--save_to", full, "--new_rank", 512, "--base_model", tiny_dir / "sd1")
    got = file_deltas(full, weights)
    assert got.keys() == want.keys() and len(got) > 40
    for name, delta in want.items():
        torch.testing.assert_close(got[name], delta.reshape(got[name].shape), atol=1e-5, rtol=1e-4, msg=name)
    low = tmp_path / "r2.safetensors"
    run(resize_lora.run, "--model", doft, "--save_to", low, "--new_rank", 2, "--new_conv_rank", 2,
        "--base_model", tiny_dir / "sd1")  # fmt: skip
    for name, delta in file_deltas(low, weights).items():  # a rank-2 approximation: the best one (Eckart-Young)
        s = svdvals(want[name])
        err = float(torch.linalg.vector_norm((want[name].reshape(delta.shape) - delta).double()))
        assert err == pytest.approx(float(s[2:].norm()), rel=1e-3, abs=1e-5), name


def test_svd_merge_of_oft_files_with_the_base_model(tiny_parts, tiny_dir, tmp_path, doft):
    parts = tiny_parts["sd1"]
    boft = _write(parts, tmp_path / "boft.safetensors", "algo=boft", "preset=attn-only", seed=2)
    out = tmp_path / "svd.safetensors"
    run(svd_merge_lora.run, "--models", doft, boft, "--ratios", 1.0, 1.0, "--new_rank", 512, "--new_conv_rank", 512,
        "--save_to", out, "--base_model", tiny_dir / "sd1")  # fmt: skip
    weights = base_weights(parts)
    a, b, got = _lycoris_deltas(doft, weights), _lycoris_deltas(boft, weights), file_deltas(out, weights)
    assert got.keys() == a.keys() | b.keys()
    for name, delta in got.items():
        want = a.get(name, 0) + b.get(name, 0)
        torch.testing.assert_close(delta, want.reshape(delta.shape), atol=1e-5, rtol=1e-4, msg=name)


def test_tools_refuse_oft_without_the_base_model(tiny_parts, tmp_path, doft):
    with pytest.raises(
        ValueError, match=r"diag-oft module\(s\) \(e.g. lora_.*depends on the base weights.*--base_model"
    ):
        run(resize_lora.run, "--model", doft, "--save_to", tmp_path / "r.safetensors")
    with pytest.raises(ValueError, match=r"diag-oft module\(s\).*--base_model"):
        run(svd_merge_lora.run, "--models", doft, "--save_to", tmp_path / "s.safetensors")
    with pytest.raises(ConfigError, match=r"(?s)hold diag-oft \(not a plain LoRA\).*use svd_merge_lora.py"):
        run(merge_lora.run, "--models", doft, doft, "--save_to", tmp_path / "m.safetensors", "--concat")


def test_check_reads_oft_blocks_and_constraints(tiny_parts, tmp_path, doft):
    from networks.check_lora_weights import check_file

    free = _write(tiny_parts["sd1"], tmp_path / "free.safetensors", "algo=boft", "preset=attn-only")  # constraint 0
    for path, summary in ((doft, "4x4 blocks/0.01"), (free, "3x4x4 blocks/0 ")):
        check = check_file(path)
        assert not check.problems, check.problems  # LyCORIS OFT: alpha 0 means "no constraint", not a bad alpha
        assert summary in "\n".join(check.summary)
    frozen = _write(tiny_parts["sd1"], tmp_path / "frozen.safetensors", module="networks.oft", alpha=1e-3)
    state, meta = load_state_dict(frozen)
    state = {k: torch.zeros(()) if k.endswith(".alpha") else v for k, v in state.items()}
    from library.files.weights import save_state_dict

    save_state_dict(state, tmp_path / "zero.safetensors", metadata=meta, wrap_ckpt=False)
    assert any("alpha <= 0" in p for p in check_file(tmp_path / "zero.safetensors").problems)  # sd-scripts: frozen
