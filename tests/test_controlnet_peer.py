"""The ControlNet files' names are sd-scripts' (run in sd-scripts' venv when the peer kit is set up, ~/sdtrain-peer;
skipped otherwise)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from library.families.registry import FAMILIES
from networks.controlnet import ControlNet, controlnet_from_unet

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(os.environ.get("PEER_WORK", "~/sdtrain-peer")).expanduser()
SDS_PYTHON = PEER / "sdsvenv" / "bin" / "python"
SDS_SRC = PEER / "sd-scripts"


@pytest.mark.skipif(not (SDS_PYTHON.exists() and SDS_SRC.is_dir()), reason="sd-scripts' peer venv not set up")
def test_file_names_are_sd_scripts(tiny_parts, tmp_path):
    """sd-scripts' own converter gives our SD file's names and tensors (and reads them back to diffusers'), and its
    full-size SDXL ControlNet saves diffusers' names and shapes, as ours on the released SDXL layout."""
    unet = copy.deepcopy(tiny_parts["sd1"].denoiser)
    net = ControlNet(unet, controlnet_from_unet(unet), "ldm")
    with torch.no_grad():
        for p in net.controlnet.parameters():
            p.normal_()
    state = {k: t.contiguous() for k, t in net.controlnet.state_dict().items()}
    save_file(state, str(tmp_path / "diffusers.safetensors"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SDS_SRC}:{ROOT / 'benchmarks/peer/sds_shims'}"}
    script = ROOT / "benchmarks" / "peer" / "controlnet_sdscripts_side.py"
    run = subprocess.run([str(SDS_PYTHON), str(script), str(tmp_path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads((tmp_path / "sdscripts.json").read_text())
    ours = net.file_tensors()
    assert {k: float(t.double().sum()) for k, t in ours.items()} == theirs["sd_names"]
    assert theirs["back"] == sorted(state)
    with torch.device("meta"):
        ref = FAMILIES["sdxl"].reference_parts()
        layout = {k: list(t.shape) for k, t in controlnet_from_unet(ref.denoiser).state_dict().items()}
    assert len(layout) == 844 and layout == theirs["sdxl_layout"]
