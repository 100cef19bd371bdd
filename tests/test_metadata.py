"""Metadata hashes match the A1111 definition computed on the bytes of the written file."""

import hashlib

import torch

from library.files.metadata import file_legacy_hash, minimal, modelspec, sshs_hashes, with_hashes
from library.files.weights import read_metadata, save_state_dict


def _hash_after_header(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return hashlib.sha256(data[8 + n :]).hexdigest()


def test_sshs_hash_equals_hash_of_saved_file(tmp_path):
    tensors = {"x.lora_down.weight": torch.randn(4, 300_000), "x.alpha": torch.tensor(4.0)}  # > 1 MiB: legacy hash real
    meta = {"ss_network_dim": "4", "ss_output_name": "a"}
    path = tmp_path / "a.safetensors"
    save_state_dict(tensors, path, metadata=with_hashes(tensors, meta))
    stored = read_metadata(path)
    assert stored["sshs_model_hash"] == _hash_after_header(path)
    # Adding non-ss metadata does not change the hash (it is computed on ss_* only).
    assert sshs_hashes(tensors, {**meta, "modelspec.title": "x"}) == sshs_hashes(tensors, meta)
    # The legacy hash is A1111's file hash of an ss-only serialisation.
    plain = tmp_path / "plain.safetensors"
    save_state_dict(tensors, plain, metadata=meta)
    assert stored["sshs_legacy_hash"] == file_legacy_hash(plain)


def test_modelspec_and_minimal():
    spec = modelspec(
        architecture="stable-diffusion-v1/lora",
        implementation="diffusers",
        title="t",
        resolution=(512, 768),
        prediction_type="v_prediction",
        extra={"author": "me", "license": None},
    )
    assert spec["modelspec.resolution"] == "512x768" and spec["modelspec.prediction_type"] == "v"
    assert spec["modelspec.author"] == "me" and "modelspec.license" not in spec
    for prediction, written in (("epsilon", "epsilon"), ("v", "v"), ("flow_matching", None), (None, None)):
        spec = modelspec(architecture="a", implementation="i", title="t", resolution=64, prediction_type=prediction)
        assert spec.get("modelspec.prediction_type") == written
    kept = minimal({**spec, "ss_network_dim": "4", "ss_seed": "1"})
    assert "ss_network_dim" in kept and "ss_seed" not in kept and "modelspec.title" in kept
