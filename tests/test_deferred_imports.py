"""library.deferred_imports: diffusers' eager model subpackages load only what is used, and every name still resolves.

Runs in a fresh interpreter (the test session has imported diffusers already, so the hook would not apply here).
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, sys
import library  # installs the hook
from diffusers import AutoencoderKL, UNet2DConditionModel
loaded_before = sorted(m for m in sys.modules if m.startswith("diffusers.models.unets.")
                       or m.startswith("diffusers.models.autoencoders."))
import diffusers.models.unets as unets
from diffusers.models.unets import UNet3DConditionModel  # a name only the real __init__ defines
from diffusers.models.autoencoders import AutoencoderTiny
from diffusers import UNet2DConditionModel as again
print(json.dumps({
    "before": loaded_before,
    "same_class": again is UNet2DConditionModel is unets.UNet2DConditionModel,
    "after_3d": "diffusers.models.unets.unet_3d_condition" in sys.modules,
    "names": [UNet3DConditionModel.__name__, AutoencoderTiny.__name__, AutoencoderKL.__name__],
}))
"""


def test_diffusers_model_packages_load_lazily_and_completely():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == [
        "diffusers.models.autoencoders.autoencoder_kl",
        "diffusers.models.autoencoders.vae",
        "diffusers.models.unets.unet_2d_blocks",
        "diffusers.models.unets.unet_2d_condition",
    ]  # not unet_3d_condition, autoencoder_tiny, ... (the package __init__s import ~60 modules)
    assert got["same_class"] and got["after_3d"]
    assert got["names"] == ["UNet3DConditionModel", "AutoencoderTiny", "AutoencoderKL"]
