"""Module and tensor counts on the released SD1 / SD2 / SDXL architectures (meta device) equal sd-scripts'.

The expected numbers are sd-scripts' own, obtained by running ``networks/lora.py`` ``create_network`` on its UNets
and HF CLIP models (sd-scripts networks/lora.py: LoRANetwork.create_modules).
"""

from __future__ import annotations

import pytest
from _networks_helpers import (
    adapter_roots,
    make_config,
    real_parts,
    single_thread,  # noqa: F401  (autouse fixture: one CPU thread)
)
from torch import nn

from networks import inject


def _counts(network) -> tuple[int, int, dict[str, int], int]:
    te = sum(not n.startswith("lora_unet_") for n in network.names)
    kinds = {"linear": 0, "1x1": 0, "3x3": 0}
    for name in network.names:
        if name.startswith("lora_unet_"):
            base = network.layer(name).base_layer
            kind = "linear" if isinstance(base, nn.Linear) else ("1x1" if base.kernel_size == (1, 1) else "3x3")
            kinds[kind] += 1
    tensors = sum(len(layer.adapter.file_tensors()) for layer in network.layers())
    return te, len(network) - te, kinds, tensors


@pytest.mark.parametrize(
    "family,args,te,unet,kinds,tensors",
    [
        ("sd1", (), 72, 192, {"linear": 160, "1x1": 32, "3x3": 0}, 792),
        ("sd1", ("conv_dim=8",), 72, 278, {"linear": 182, "1x1": 46, "3x3": 50}, 1050),
        ("sd2", (), 138, 192, {"linear": 192, "1x1": 0, "3x3": 0}, 990),
        ("sdxl", (), 264, 722, {"linear": 722, "1x1": 0, "3x3": 0}, 2958),
        ("sdxl", ("conv_dim=8",), 264, 788, {"linear": 739, "1x1": 11, "3x3": 38}, 3156),
    ],
)
def test_counts_match_sd_scripts(family, args, te, unet, kinds, tensors):
    network = inject(make_config(*args, dim=8), adapter_roots(real_parts(family)))
    assert _counts(network) == (te, unet, kinds, tensors)


def test_dora_and_loha_tensor_counts_on_sdxl():
    parts = real_parts("sdxl")
    dora = inject(make_config("algo=dora", dim=8), adapter_roots(parts))
    assert _counts(dora)[3] == 986 * 4  # down, up, alpha, dora_scale
    dora.eject()
    loha = inject(make_config("algo=loha", dim=8), adapter_roots(parts))
    assert _counts(loha)[3] == 986 * 5  # 4 hada factors + alpha
