"""Start-up time: packages whose ``__init__`` imports far more than a training run uses, made lazy, for the command line
only.

``diffusers.models.unets``, ``.autoencoders`` and ``.transformers`` import all of their modules when the package is
imported (every video/audio autoencoder, every transformer...), although a training run needs two or three of
them: importing ``diffusers.models.unets.unet_2d_condition`` ran all of that first. With :func:`enabled`, an import
hook creates these packages without running their ``__init__``; a submodule imported by name
(``diffusers.models.unets.unet_2d_condition``, what ``from diffusers import UNet2DConditionModel`` resolves to) loads
alone, and the first lookup of any other name on the package (``from diffusers.models.unets import X``) runs the
real ``__init__`` then, so every name is still there. ``diffusers.hooks`` is treated the same way (its ``__init__``
imports peft; a run needs none of its hooks: ``--fp8_base`` uses library/device/fp8.py).

``WHOLE_PACKAGES`` (bitsandbytes, scipy.stats, scipy.integrate) are imported by diffusers at start-up for features a
run rarely uses (8-bit loading, beta sigmas, the k_lms sampler's coefficients): their ``__init__`` runs at the first name looked up on them, ``__path__`` included,
which the import system reads before it imports one of their submodules, so they are complete before any of their
code runs, with or without the hook. No third-party file is changed and no behaviour differs; only what is imported
before it is needed (tests/test_deferred_imports.py).

Nothing here runs at import: the entry scripts' ``main()`` (the command line) opts in with ``with enabled():``, and the
hook is gone when it returns. The hook leans on diffusers' package layout, so it is used only with the diffusers
release it was checked against (``CHECKED``); any other version, or a package laid out otherwise, imports plainly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

EAGER_PACKAGES = (
    "diffusers.models.unets",
    "diffusers.models.autoencoders",
    "diffusers.models.transformers",
    "diffusers.hooks",  # its __init__ imports peft (and bitsandbytes through it), ~1.4 s; training uses no diffusers hook
)
# Packages whose whole ``__init__`` waits for the first name looked up on them or the first of their submodules
# imported: diffusers imports bitsandbytes (~0.7 s: its backends pull torch._inductor) for its 8-bit loaders only,
# scipy.stats (~0.4 s) for the beta sigmas of samplers a training run does not build, and scipy.integrate (33 modules,
# ~3 MB; its scipy.optimize / linalg come with transformers' losses anyway) for LMSDiscreteScheduler's
# ``integrate.quad``, which runs only when a sample is drawn with k_lms.
WHOLE_PACKAGES = ("bitsandbytes", "scipy.stats", "scipy.integrate")
# the diffusers release (major.minor) whose layout the hook was checked against: tests/test_deferred_imports.py
CHECKED = {"diffusers": "0.42"}


class DeferredPackage(types.ModuleType):
    """A package whose ``__init__`` runs at the first lookup of a name it does not have yet."""

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__
        loader = state.pop("_deferred_loader", None)
        if loader is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        if "_deferred_path" in state:  # a whole package: its __path__ was held back until now
            state["__path__"] = state.pop("_deferred_path")
        loader.exec_module(self)  # the real __init__; submodules already imported are reused
        try:
            return state[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, whole: bool) -> None:
        self.loader, self.whole = loader, whole

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return DeferredPackage(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__["_deferred_loader"] = self.loader
        if self.whole:  # importing a submodule reads __path__ first: the package's __init__ runs before it
            module.__dict__["_deferred_path"] = module.__dict__.pop("__path__")


class _DeferringFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in EAGER_PACKAGES and fullname not in WHOLE_PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return None  # not a plain package of .py files: imported as usual
        if not spec.submodule_search_locations:
            return None
        spec.loader = _DeferringLoader(spec.loader, whole=fullname in WHOLE_PACKAGES)
        return spec


def mismatch() -> str | None:
    """Why the hook would not fit the installed packages (a version other than ``CHECKED``), or None."""
    for package, checked in CHECKED.items():
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return f"{package} is not installed"
        if version.split(".")[:2] != checked.split("."):
            return f"{package} {version} (the hook was checked with {checked}.x)"
    return None


@contextmanager
def enabled() -> Iterator[bool]:
    """The hook, for the block (an entry script's ``main()``); yields whether it is on. Off, with plain imports,
    when :func:`mismatch` finds a reason. Packages already imported stay as they are; packages it created keep
    completing themselves on first use after the block."""
    reason = mismatch()
    if reason is not None:
        logger.debug("start-up imports: plain (%s)", reason)
    if reason is not None or any(isinstance(f, _DeferringFinder) for f in sys.meta_path):
        yield reason is None
        return
    finder = _DeferringFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield True
    finally:
        sys.meta_path.remove(finder)
