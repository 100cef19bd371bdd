"""sd-scripts' side of the FLUX ControlNet comparison (benchmarks/flux_controlnet_vs_sdscripts.py); runs in
sd-scripts' own venv.

    PYTHONPATH=<sd-scripts>:<peer helpers/sds_shims> <sdsvenv>/bin/python flux_controlnet_sdscripts_side.py <work>

Reads ``<work>/request.json`` (the tiny model's ``FluxParams``), ``<work>/controlnet.safetensors`` (our file),
``<work>/flux.safetensors`` (the transformer, BFL keys) and ``<work>/inputs.safetensors``; builds sd-scripts'
``ControlNetFlux(params, controlnet_depth=2, controlnet_single_depth=0)`` and ``Flux(params)``, loads both with
``strict=True`` and writes ``<work>/outputs.safetensors``: ``residual.N`` (the ControlNet's block samples) and
``flux`` (the transformer's output with them, as flux_train_control_net.py calls it), again under ``masked.``
with the T5 mask ``mask`` given to both (``--apply_t5_attn_mask``), and ``<work>/layout.json``
(the ControlNet's state-dict keys and shapes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main(work: Path) -> None:
    from library import flux_models

    request = json.loads((work / "request.json").read_text())
    params = flux_models.FluxParams(**request["params"])
    cn = flux_models.ControlNetFlux(params, controlnet_depth=2, controlnet_single_depth=0)
    flux = flux_models.Flux(params)
    cn.load_state_dict(load_file(str(work / "controlnet.safetensors")), strict=True)
    flux.load_state_dict(load_file(str(work / "flux.safetensors")), strict=True)
    cn.eval(), flux.eval()
    x = load_file(str(work / "inputs.safetensors"))
    common = dict(img=x["img"], img_ids=x["img_ids"], txt=x["txt"], txt_ids=x["txt_ids"], y=x["y"],
                  timesteps=x["timesteps"], guidance=x["guidance"])  # fmt: skip
    tensors = {}
    for case, mask in (("", None), ("masked.", x["mask"])):  # without / with --apply_t5_attn_mask
        with torch.no_grad():
            samples, single = cn(controlnet_cond=x["cond"], txt_attention_mask=mask, **common)
            out = flux(block_controlnet_hidden_states=samples, block_controlnet_single_hidden_states=single,
                       txt_attention_mask=mask, **common)  # fmt: skip
        tensors |= {f"{case}residual.{i}": s.contiguous() for i, s in enumerate(samples)}
        tensors[f"{case}flux"] = out.contiguous()
    save_file(tensors, str(work / "outputs.safetensors"))
    layout = {k: list(t.shape) for k, t in cn.state_dict().items()}
    (work / "layout.json").write_text(json.dumps(layout, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
