"""Start-up time: packages whose ``__init__`` imports far more than a training run uses, made lazy.

``diffusers.models.unets``, ``.autoencoders`` and ``.transformers`` import all of their modules when the package is
imported (every video/audio autoencoder, every transformer...), although a training run needs two or three of
them: importing ``diffusers.models.unets.unet_2d_condition`` ran all of that first. :func:`install` adds an import
hook that creates these three packages without running their ``__init__``; a submodule imported by name
(``diffusers.models.unets.unet_2d_condition``, what ``from diffusers import UNet2DConditionModel`` resolves to) loads
alone, and the first lookup of any other name on the package (``from diffusers.models.unets import X``) runs the
real ``__init__`` then, so every name is still there. ``diffusers.hooks`` is treated the same way (its ``__init__``
imports peft; a run needs none of its hooks: ``--fp8_base`` uses library/fp8.py).

``WHOLE_PACKAGES`` (bitsandbytes, scipy.stats) are imported by diffusers at start-up for features a run rarely uses
(8-bit loading, beta sigmas): their ``__init__`` runs at the first name looked up on them or the first import of one
of their submodules, so they are complete before any of their code runs. No third-party file is changed and no
behaviour differs; only what is imported before it is needed (tests/test_deferred_imports.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

EAGER_PACKAGES = (
    "diffusers.models.unets",
    "diffusers.models.autoencoders",
    "diffusers.models.transformers",
    "diffusers.hooks",  # its __init__ imports peft (and bitsandbytes through it), ~1.4 s; training uses no diffusers hook
)
# Packages whose whole ``__init__`` waits for the first name looked up on them or the first of their submodules
# imported: diffusers imports bitsandbytes (~0.7 s: its backends pull torch._inductor) for its 8-bit loaders only, and
# scipy.stats (~0.4 s) for the beta sigmas of samplers a training run does not build.
WHOLE_PACKAGES = ("bitsandbytes", "scipy.stats")


class DeferredPackage(types.ModuleType):
    """A package whose ``__init__`` runs at the first lookup of a name it does not have yet."""

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__
        loader = state.pop("_deferred_loader", None)
        if loader is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        loader.exec_module(self)  # the real __init__; submodules already imported are reused
        try:
            return state[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return DeferredPackage(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__["_deferred_loader"] = self.loader


class _NoLoader:
    @staticmethod
    def exec_module(module: types.ModuleType) -> None:
        pass


class _DeferringFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        whole = next((name for name in WHOLE_PACKAGES if fullname.startswith(name + ".")), None)
        if whole is not None:  # a submodule: its package's __init__ runs first, as always
            package = sys.modules.get(whole)
            if isinstance(package, DeferredPackage):
                package.__dict__.pop("_deferred_loader", _NoLoader).exec_module(package)
            return None
        if fullname not in EAGER_PACKAGES and fullname not in WHOLE_PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not spec.submodule_search_locations:
            return None
        spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Add the hook (once; a package already imported stays as it is)."""
    if not any(isinstance(f, _DeferringFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferringFinder())
