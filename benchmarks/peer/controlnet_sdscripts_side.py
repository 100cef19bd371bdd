"""sd-scripts' side of the ControlNet file comparison (tests/test_controlnet_train.py); runs in sd-scripts' own venv.

    PYTHONPATH=<sd-scripts>:<peer helpers/sds_shims> <sdsvenv>/bin/python controlnet_sdscripts_side.py <work folder>

Reads ``<work>/diffusers.safetensors`` (a ControlNet in diffusers' names) and writes ``<work>/sdscripts.json``:

* ``sd_names``: sd-scripts' ``model_util.convert_controlnet_state_dict_to_sd`` of those tensors (the names
  ``train_control_net.py`` saves), each key with its tensor's sum, and ``back``: its
  ``convert_controlnet_state_dict_to_diffusers`` of them (what ``--controlnet_model_name_or_path`` reads);
* ``sdxl_layout``: sd-scripts' ``SdxlControlNet`` (full size, meta device) ``state_dict()`` keys and shapes: what
  ``sdxl_train_control_net.py`` saves and its ``load_state_dict`` reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import accelerate
from safetensors.torch import load_file


def main(work: Path) -> None:
    from library import model_util
    from library.sdxl_original_control_net import SdxlControlNet

    tensors = load_file(str(work / "diffusers.safetensors"))
    sd = model_util.convert_controlnet_state_dict_to_sd(tensors)
    back = model_util.convert_controlnet_state_dict_to_diffusers(sd)
    with accelerate.init_empty_weights():
        net = SdxlControlNet()
    layout = {k: list(t.shape) for k, t in net.state_dict().items()}
    out = {"sd_names": {k: float(t.double().sum()) for k, t in sd.items()}, "back": sorted(back), "sdxl_layout": layout}
    (work / "sdscripts.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
