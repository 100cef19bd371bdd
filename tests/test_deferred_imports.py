"""library.cli.deferred_imports: importing sdtrain changes nothing in the import system; inside ``enabled()`` (the entry
scripts' ``main()``) diffusers' eager model subpackages load only what is used, every name still resolves, and the
hook is gone afterwards; a diffusers release other than the checked one imports plainly.

Runs in a fresh interpreter (the test session has imported diffusers already, so the hook would not apply here).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from library.cli import deferred_imports

ROOT = Path(__file__).resolve().parent.parent

# Both parts run in one fresh interpreter per way of first using a deferred package (two interpreters, not three):
# the probe's imports inside the hook come before the check that the optional packages still wait.
PROBE = r"""
import json, logging, sys
before = list(sys.meta_path)
import library, train_network, sdxl_train_network, train_textual_inversion, fine_tune, train_db, gen_img
untouched = sys.meta_path == before and logging.getLogger("bitsandbytes").level == logging.NOTSET
from library.cli import deferred_imports
with deferred_imports.enabled() as on:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    loaded_before = sorted(m for m in sys.modules if m.startswith("diffusers.models.unets.")
                           or m.startswith("diffusers.models.autoencoders."))
    import diffusers.loaders.single_file_model  # what the families' single-file loading imports
    import diffusers.models.unets as unets
    from diffusers.models.unets import UNet3DConditionModel  # a name only the real __init__ defines
    from diffusers.models.autoencoders import AutoencoderTiny
    from diffusers import UNet2DConditionModel as again
probe = {
    "untouched": untouched,
    "on": on,
    "removed": not any(isinstance(f, deferred_imports._DeferringFinder) for f in sys.meta_path),
    "before": loaded_before,
    "same_class": again is UNet2DConditionModel is unets.UNet2DConditionModel,
    "after_3d": "diffusers.models.unets.unet_3d_condition" in sys.modules,
    "names": [UNet3DConditionModel.__name__, AutoencoderTiny.__name__, AutoencoderKL.__name__],
}
"""

WHOLE = r"""
from library.cli.deferred_imports import DeferredPackage
waiting = {name: isinstance(sys.modules.get(name), DeferredPackage)
           for name in ("bitsandbytes", "scipy.stats", "scipy.integrate")}
skipped = [name for name in ("diffusers.hooks.layerwise_casting", "diffusers.hooks.faster_cache") if name in sys.modules]
out = {"probe": probe, "waiting": waiting, "skipped": skipped}
if sys.argv[1] == "submodule":  # importing a submodule runs the package's __init__ first, as without the hook
    from bitsandbytes.optim import AdamW8bit
    state = vars(sys.modules["bitsandbytes"])  # read without a lookup that would run the __init__ now
    import torch
    out["ran"] = "_deferred_loader" not in state and "__version__" in state and hasattr(torch.ops, "bitsandbytes")
    out["name"] = AdamW8bit.__name__
else:  # a name looked up on the package runs it
    import scipy.stats, bitsandbytes
    from diffusers import DPMSolverMultistepScheduler
    from diffusers.hooks import apply_layerwise_casting
    s = DPMSolverMultistepScheduler(use_beta_sigmas=True)  # reads scipy.stats.beta
    s.set_timesteps(4)
    import torch
    from diffusers import LMSDiscreteScheduler  # k_lms: its coefficients are scipy.integrate.quad's
    lms = LMSDiscreteScheduler()
    lms.set_timesteps(4)
    x = torch.ones(1, 1, 2, 2)
    for t in lms.timesteps:  # a whole k_lms sampling loop (order 4)
        x = lms.step(-0.1 * lms.scale_model_input(x, t), t, x).prev_sample
    s0, s1, s2 = lms.sigmas[:3].tolist()  # order 2, step 1: the integral of (tau - s0) / (s1 - s0) over [s1, s2]
    exact = ((s2 - s0) ** 2 - (s1 - s0) ** 2) / (2 * (s1 - s0))
    quad = lms.get_lms_coefficient(2, 1, 0)  # scipy.integrate.quad's
    out["ran"] = (scipy.stats.beta.ppf(0.5, 2, 2) == 0.5 and bitsandbytes.optim.AdamW8bit.__name__ == "AdamW8bit"
                  and bool(torch.isfinite(x).all()) and abs(quad - exact) < 1e-6 * abs(exact)
                  and "_deferred_loader" not in vars(sys.modules["scipy.integrate"]))  # fmt: skip
    out["name"] = apply_layerwise_casting.__name__
print(json.dumps(out))
"""
MODES = ("submodule", "name")


@pytest.fixture(scope="module")
def fresh():
    """Per way of first use (a submodule imported, a name looked up): what the fresh interpreter found."""
    runs = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, "-c", PROBE + WHOLE, mode], cwd=ROOT, capture_output=True, text=True,
                             check=True)  # fmt: skip
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return runs


@pytest.mark.parametrize("mode", MODES)
def test_diffusers_model_packages_load_lazily_and_completely(fresh, mode):
    got = fresh[mode]["probe"]
    assert got["untouched"]  # `import library` and the entry modules add no hook and set no logger
    assert got["on"] and got["removed"]
    assert got["before"] == [
        "diffusers.models.autoencoders.autoencoder_kl",
        "diffusers.models.autoencoders.vae",
        "diffusers.models.unets.unet_2d_blocks",
        "diffusers.models.unets.unet_2d_condition",
    ]  # not unet_3d_condition, autoencoder_tiny, ... (the package __init__s import ~60 modules)
    assert got["same_class"] and got["after_3d"]
    assert got["names"] == ["UNet3DConditionModel", "AutoencoderTiny", "AutoencoderKL"]


def test_optional_packages_wait_for_their_first_use(fresh):
    """Both after the hook is removed: the packages it deferred complete themselves without it."""
    for mode, got in fresh.items():
        # importing the UNet and VAE no longer runs the __init__ of bitsandbytes, scipy.stats, scipy.integrate (the
        # LMS scheduler's, which diffusers' single-file loading imports) or diffusers.hooks
        assert got["waiting"] == dict.fromkeys(("bitsandbytes", "scipy.stats", "scipy.integrate"), True), (mode, got)
        assert got["skipped"] == [], (mode, got)
        assert got["ran"] and got["name"] in ("AdamW8bit", "apply_layerwise_casting"), (mode, got)


def test_the_installed_diffusers_is_the_checked_one():
    """The hook leans on diffusers' package layout: a new diffusers release needs the two tests above to pass with it,
    then its version in ``deferred_imports.CHECKED``; until then runs import plainly."""
    assert deferred_imports.mismatch() is None


def test_another_diffusers_release_imports_plainly(monkeypatch):
    monkeypatch.setitem(deferred_imports.CHECKED, "diffusers", "0.1")
    with deferred_imports.enabled() as on:
        assert not on and not any(isinstance(f, deferred_imports._DeferringFinder) for f in sys.meta_path)
    assert "0.1.x" in deferred_imports.mismatch()
