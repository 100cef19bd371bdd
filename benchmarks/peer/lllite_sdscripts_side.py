"""sd-scripts' side of the ControlNet-LLLite comparison (tests/test_lllite.py); runs in sd-scripts' own venv.

    PYTHONPATH=<sd-scripts>:<peer helpers/sds_shims> <sdsvenv>/bin/python lllite_sdscripts_side.py <work folder>

Reads ``<work>/request.json`` and writes ``<work>/sdscripts.json`` and ``<work>/outputs.safetensors``:

* ``layout``: sd-scripts' ``ControlNetLLLite`` built on its full-size SDXL UNet (on the meta device, no memory): every
  module's name, depth-giving shapes, and the state-dict keys and shapes its ``load_state_dict`` reads;
* ``forward``: for each case of the request, sd-scripts' ``LLLiteModule`` on a Linear of the given size, loaded with
  our module's tensors (``<work>/weights.safetensors``, keys ``<case>.<key>``; strict), run on the given input and
  conditioning image (``set_cond_image`` then the patched Linear's forward); the outputs under ``<case>``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import accelerate
import torch
from safetensors.torch import load_file, save_file


def layout(cond_emb_dim: int, mlp_dim: int) -> dict:
    from library import sdxl_original_unet
    from networks.control_net_lllite import ControlNetLLLite

    with accelerate.init_empty_weights():
        unet = sdxl_original_unet.SdxlUNet2DConditionModel()
        net = ControlNetLLLite(unet, cond_emb_dim, mlp_dim)
    return {m.lllite_name: {k: list(t.shape) for k, t in m.state_dict().items()} for m in net.unet_modules}


def forward(cases: list[dict], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from networks.control_net_lllite import LLLiteModule

    out = {}
    for case in cases:
        name = case["name"]
        torch.manual_seed(0)
        base = torch.nn.Linear(case["in_dim"], case["out_dim"])
        base.load_state_dict({"weight": weights[f"{name}.base.weight"], "bias": weights[f"{name}.base.bias"]})
        module = LLLiteModule(case["depth"], case["cond_emb_dim"], name, base, case["mlp_dim"])
        own = {k.removeprefix(name + "."): t for k, t in weights.items() if k.startswith(name + ".")}
        own = {k: t for k, t in own.items() if not k.startswith("base.") and k not in ("x", "image")}
        module.load_state_dict(own, strict=True)
        module.multiplier = case["multiplier"]
        module.apply_to()
        module.eval()
        with torch.no_grad():
            module.set_cond_image(weights[f"{name}.image"])
            out[name] = base(weights[f"{name}.x"]).contiguous()
    return out


def main(work: Path) -> None:
    request = json.loads((work / "request.json").read_text())
    result = {"layout": layout(request["cond_emb_dim"], request["mlp_dim"])}
    (work / "sdscripts.json").write_text(json.dumps(result))
    save_file(
        forward(request["cases"], load_file(str(work / "weights.safetensors"))), str(work / "outputs.safetensors")
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
