"""networks/extract_lora_from_models.py on the tiny models: a known ΔW added to the targets training adapts is
recovered; extract then merge gives the tuned model back within the SVD tail (Eckart-Young, svdvals oracle)."""

from __future__ import annotations

import copy

import pytest
import torch
from _networks_helpers import make_config
from _tools_helpers import base_weights, file_deltas, svdvals

from library.cli.parse import ConfigError
from library.families import get_family
from library.files.weights import load_state_dict
from networks import extract_lora_from_models, inject, merge_lora
from networks.files import module_index


def run(main, *argv):
    return main([str(a) for a in argv])


def tuned_model(parts, path, make_delta, unet_only=False):
    """``parts`` with ``make_delta(name, shape)`` added to every module networks.lora (with conv_dim) adapts;
    saved to ``path``. Returns {name: ΔW}."""
    family = get_family(parts.family)
    tuned = copy.deepcopy(parts)
    roots = family.adapter_roots(tuned)
    network = inject(make_config("conv_dim=2", dim=2), roots)
    names = [n for n in network.names if n.startswith("lora_unet") or not unet_only]
    network.eject()
    index = module_index(roots)
    added = {}
    with torch.no_grad():
        for i, name in enumerate(names):
            weight = index[name].module.weight
            added[name] = make_delta(i, tuple(weight.shape))
            weight += added[name]
    family.save(tuned, path)
    return added


def low_rank(i, shape, rank=2):
    g = torch.Generator().manual_seed(i)
    u = torch.randn(shape[0], rank, generator=g) * 0.1
    v = torch.randn(rank, int(torch.tensor(shape[1:]).prod()), generator=g) * 0.1
    return (u @ v).reshape(shape)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_extract_recovers_a_known_low_rank_delta(tiny_parts, tiny_dir, tmp_path, family):
    parts = tiny_parts[family]
    added = tuned_model(parts, tmp_path / "tuned.safetensors", low_rank)
    out = tmp_path / "x.safetensors"
    run(extract_lora_from_models.run, "--model_org", tiny_dir / family, "--model_tuned", tmp_path / "tuned.safetensors",
        "--save_to", out, "--dim", 2, "--conv_dim", 2, "--clamp_quantile", 1.0)  # fmt: skip
    got = file_deltas(out, base_weights(parts))
    assert got.keys() == added.keys()
    for name, delta in added.items():
        torch.testing.assert_close(got[name], delta, atol=1e-5, rtol=1e-4)
    meta = load_state_dict(out)[1]
    fam = get_family(family)
    assert meta["ss_network_dim"] == "2" and meta["ss_network_alpha"] == "2.0"
    assert meta["ss_base_model_version"] == fam.base_model_version(parts.prediction_type)
    assert meta["modelspec.architecture"] == fam.modelspec_architecture("lora", parts.prediction_type)


def test_extract_then_merge_gives_the_tuned_model_within_the_svd_error(tiny_parts, tiny_dir, tmp_path):
    parts = tiny_parts["sd1"]

    def noise(i, shape):
        return torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 0.02

    added = tuned_model(parts, tmp_path / "tuned.safetensors", noise)
    run(extract_lora_from_models.run, "--model_org", tiny_dir / "sd1", "--model_tuned", tmp_path / "tuned.safetensors",
        "--save_to", tmp_path / "x.safetensors", "--dim", 3, "--conv_dim", 2, "--clamp_quantile", 1.0)  # fmt: skip
    run(merge_lora.run, "--sd_model", tiny_dir / "sd1", "--models", tmp_path / "x.safetensors", "--save_to",
        tmp_path / "merged.safetensors")  # fmt: skip
    family = get_family("sd1")
    merged = base_weights(family.load(tmp_path / "merged.safetensors"))
    tuned = base_weights(family.load(tmp_path / "tuned.safetensors"))
    base = base_weights(parts)
    for name, weight in merged.items():
        if name not in added:
            torch.testing.assert_close(weight, base[name])
            continue
        r = 2 if weight.dim() == 4 and weight.shape[-1] == 3 else 3
        tail = float(svdvals(added[name])[r:].norm())
        err = float(torch.linalg.vector_norm((weight - tuned[name]).double()))
        assert err == pytest.approx(tail, rel=1e-3, abs=1e-6), name
        assert err < float(torch.linalg.vector_norm(added[name].double()))


def test_text_encoders_are_left_out_when_unchanged(tiny_parts, tiny_dir, tmp_path):
    tuned_model(tiny_parts["sd1"], tmp_path / "tuned.safetensors", low_rank, unet_only=True)
    out = tmp_path / "x.safetensors"
    run(extract_lora_from_models.run, "--model_org", tiny_dir / "sd1", "--model_tuned", tmp_path / "tuned.safetensors",
        "--save_to", out, "--dim", 2, "--save_precision", "fp16")  # fmt: skip
    tensors, meta = load_state_dict(out)
    assert tensors and not [k for k in tensors if k.startswith("lora_te")]
    assert not [k for k in tensors if "resnets" in k]  # no --conv_dim: ResNet blocks are not extracted
    assert all(t.dtype == torch.float16 for t in tensors.values()) and "U-Net only" in meta["ss_training_comment"]


def test_models_of_different_families_are_refused(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="--model_org is sd1 but --model_tuned is sdxl"):
        run(extract_lora_from_models.run, "--model_org", tiny_dir / "sd1", "--model_tuned", tiny_dir / "sdxl",
            "--save_to", tmp_path / "x.safetensors")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        run(extract_lora_from_models.run, "--model_org", tmp_path / "nope", "--save_to", tmp_path / "x.txt",
            "--clamp_quantile", 2)  # fmt: skip
    assert all(s in str(e.value) for s in ("--model_org", "--model_tuned is required", "--save_to", "--clamp_quantile"))
