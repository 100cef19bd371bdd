"""Our files in the consumers' own loaders: diffusers (LoRA/LoCon) and LyCORIS (LoHa, LoKr, DoRA), plus LyCORIS'
own network builder as the oracle for what ``--network_module lycoris.kohya`` must produce.

LyCORIS 4.1.3 harness workarounds (FORMATS.md §2.5): "TimestepEmbedding" removed from its target lists (it would
assert on a diffusers UNet), the flat transformers-5 CLIPTextModel wrapped in a module with a ``text_model``
attribute, and its forward path (``apply_to``) used, not its merge path (which applies alpha/r twice for LoHa/LoKr).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _networks_helpers import (
    adapter_roots,
    assert_outputs_close,
    make_config,
    outputs,
    perturb,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
    unet_inputs,
)
from torch import nn

from networks import inject
from networks.lycoris_reader import renamed_view

lycoris_kohya = pytest.importorskip("lycoris.kohya")


# -------------------------------------------------------------------------------------------------------- diffusers
def _pipeline(parts):
    from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    common = dict(vae=parts.vae, unet=parts.denoiser, scheduler=DDIMScheduler())
    if len(parts.text_encoders) == 2:
        return StableDiffusionXLPipeline(
            text_encoder=parts.text_encoders[0],
            text_encoder_2=parts.text_encoders[1],
            tokenizer=parts.tokenizers[0],
            tokenizer_2=parts.tokenizers[1],
            **common,
        )
    return StableDiffusionPipeline(
        text_encoder=parts.text_encoders[0],
        tokenizer=parts.tokenizers[0],
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        **common,
    )


def _peft_layers(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if hasattr(m, "lora_A") and "ours" in getattr(m, "lora_A", {}))


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
@pytest.mark.parametrize("args", [(), ("conv_dim=4", "conv_alpha=2")], ids=["lora", "locon"])
def test_diffusers_load_lora_weights_reproduces_our_forward(tiny_parts, family, args, tmp_path):
    parts = tiny_parts[family]
    inputs = unet_inputs(parts)
    ours = copy.deepcopy(parts)
    network = inject(make_config(*args), adapter_roots(ours))
    perturb(network)
    network.set_multiplier(0.7)
    expected = outputs(ours, inputs)
    assert (expected[0] - outputs(parts, inputs)[0]).abs().max() > 1e-2
    network.save(tmp_path / "a.safetensors")

    theirs = copy.deepcopy(parts)
    pipe = _pipeline(theirs)
    pipe.load_lora_weights(str(tmp_path / "a.safetensors"), adapter_name="ours")
    pipe.set_adapters(["ours"], adapter_weights=[0.7])
    loaded = _peft_layers(theirs.denoiser) + sum(_peft_layers(te) for te in theirs.text_encoders)
    assert loaded == len(network)  # every module arrived (diffusers drops some TE layouts silently)
    assert_outputs_close(outputs(theirs, inputs), expected, atol=1e-5)


# --------------------------------------------------------------------------------------------------------- LyCORIS
@pytest.fixture
def lycoris(monkeypatch):
    """lycoris.kohya with its Anima "TimestepEmbedding" target removed (class list and every preset)."""
    cls = lycoris_kohya.LycorisNetworkKohya
    monkeypatch.setattr(cls, "UNET_TARGET_REPLACE_MODULE", [c for c in cls.UNET_TARGET_REPLACE_MODULE
                                                            if c != "TimestepEmbedding"])  # fmt: skip
    for name, preset in lycoris_kohya.PRESET.items():
        if "TimestepEmbedding" in preset.get("unet_target_module", []):
            fixed = dict(
                preset, unet_target_module=[c for c in preset["unet_target_module"] if c != "TimestepEmbedding"]
            )
            monkeypatch.setitem(lycoris_kohya.PRESET, name, fixed)
    for attr in ("UNET_TARGET_REPLACE_NAME", "TEXT_ENCODER_TARGET_REPLACE_MODULE", "ENABLE_CONV"):
        monkeypatch.setattr(cls, attr, getattr(cls, attr))  # apply_preset mutates class attributes: restore them
    return lycoris_kohya


class _TextModel(nn.Module):
    """Gives a flat transformers-5 CLIPTextModel back its ``text_model.`` level for LyCORIS' name matching."""

    def __init__(self, te: nn.Module) -> None:
        super().__init__()
        self.text_model = te


def _lycoris_te(te: nn.Module) -> nn.Module:
    return te if hasattr(te, "text_model") else _TextModel(te)


def _lycoris_forward(lycoris, parts, path, multiplier: float, inputs) -> list[torch.Tensor]:
    theirs = copy.deepcopy(parts)
    tes = [_lycoris_te(te) for te in theirs.text_encoders]
    unet = theirs.denoiser
    if len(tes) == 2:
        unet = renamed_view(unet, adapter_roots(theirs)[0][2])  # SDXL's sgm names
    te_arg = tes if len(tes) == 2 else tes[0]
    network, _ = lycoris.create_network_from_weights(multiplier, str(path), None, te_arg, unet)
    network.apply_to(te_arg, unet, apply_text_encoder=True, apply_unet=True)
    count = len(network.unet_loras) + len(network.text_encoder_loras)
    return outputs(theirs, inputs), count


LYCORIS_CASES = [
    ("sd1", ("algo=loha", "conv_dim=4"), 0.6),
    ("sd1", ("algo=loha", "conv_dim=4", "use_tucker=True"), 0.6),
    ("sd1", ("algo=lokr", "conv_dim=4", "factor=4"), 0.6),
    ("sd1", ("conv_dim=4", "use_tucker=True"), 0.6),
    ("sd1", ("algo=dora", "conv_dim=4"), 1.0),
    ("sd1", ("algo=loha", "dora_wd=True"), 1.0),
    ("sd1", ("algo=lokr", "dora_wd=True", "factor=4"), 1.0),
    ("sdxl", ("algo=lokr", "conv_dim=4", "factor=4"), 0.6),
    ("sdxl", ("algo=loha", "dora_wd=True", "conv_dim=4"), 1.0),
]


@pytest.mark.parametrize("family,args,multiplier", LYCORIS_CASES)
def test_lycoris_loader_reproduces_our_forward(lycoris, tiny_parts, family, args, multiplier, tmp_path):
    parts = tiny_parts[family]
    inputs = unet_inputs(parts)
    ours = copy.deepcopy(parts)
    network = inject(make_config(*args), adapter_roots(ours))
    perturb(network)
    network.set_multiplier(multiplier)
    expected = outputs(ours, inputs)
    assert (expected[0] - outputs(parts, inputs)[0]).abs().max() > 1e-2
    network.save(tmp_path / "a.safetensors")
    got, count = _lycoris_forward(lycoris, parts, tmp_path / "a.safetensors", multiplier, inputs)
    assert count == len(network)
    assert_outputs_close(got, expected, atol=1e-5)


@pytest.mark.parametrize(
    "args",
    [(), ("algo=loha",), ("algo=lokr",), ("preset=attn-mlp", "algo=loha"), ("preset=unet-only", "conv_dim=2")],
)
def test_lycoris_kohya_writes_lycoris_modules_keys_and_shapes(lycoris, tiny_parts, args):
    """``--network_module lycoris.kohya``: the same modules, tensor keys and shapes as LyCORIS' create_network."""
    parts = copy.deepcopy(tiny_parts["sd1"])
    kwargs = dict(a.split("=", 1) for a in args)
    theirs = lycoris.create_network(1.0, 4, 2.0, None, _lycoris_te(parts.text_encoders[0]), parts.denoiser, **kwargs)
    their_keys = {
        f"{lora.lora_name}.{k}": tuple(v.shape)
        for lora in theirs.unet_loras + theirs.text_encoder_loras
        for k, v in lora.state_dict().items()
    }
    network = inject(make_config(*args, module="lycoris.kohya", dim=4, alpha=2.0), adapter_roots(parts))
    ours = {k: tuple(v.shape) for k, v in network.state_dict_for_file().items()}
    assert set(ours) == set(their_keys)
    assert ours == their_keys
    if not args:  # the default "full" preset reaches conv_in, conv_out and the time embedding too
        assert {"lora_unet_conv_in", "lora_unet_conv_out", "lora_unet_time_embedding_linear_1"} <= set(network.names)
