"""Adapter algorithms as pure tensor functions, one module per algorithm, one shared signature.

Every algorithm is an :class:`Algorithm` record of functions:

* ``init_params(base_shape, rank, **options) -> dict[str, Tensor]``: fresh trainable tensors, stored in the exact
  shapes the kohya / LyCORIS file format uses (so saving is a rename, never a reshape). A fresh adapter has ΔW = 0.
* ``delta_weight(params, scale, shape, *, base=None, alpha=None) -> Tensor``: ΔW with the shape of the base weight
  (``base`` = W for ``needs_base`` algorithms: (IA)³, GLoRA). The forward pass, merge, max-norm and every
  post-training tool (resize, merge, extract) call this one function; ``delta_bias`` (full) adds a bias change.
* ``rank(params) -> int | None``: the ``r`` in ``scale = alpha / r`` (``None``: the format fixes ``scale = 1``).
* ``options(params) -> dict``: the construction options recovered from a file's tensors (tucker, decomposed...).
* ``file_keys``: parameter name -> tensor suffix in files (``lora_down`` -> ``lora_down.weight``).
* ``plus_params``: parameters LoRA+ puts in the faster "plus" group; ``scalar_params``: the tensors ``use_scalar``
  is folded into when a file is written (as LyCORIS does).
* ``needs_base`` / ``delta_bias`` / ``has_alpha`` / ``constants`` / ``norm_exponents``: ΔW that depends on W ((IA)³,
  GLoRA), a bias change (full), formats without ``alpha`` (full, (IA)³), settings stored as tensors ((IA)³'s
  ``on_input``) and max-norm powers for ΔW that is not one product (see ``base.Algorithm``).
* ``project_down`` / ``project_up`` (LoRA only): the factorised forward ``up(down(x))`` without building ΔW.

DoRA (``dora.py``) is one function applied on top of any algorithm's ΔW. DyLoRA (``dylora.py``) and LoRA-FA
(``lora_fa.py``) write plain LoRA files (``file_format = "lora"``); DyLoRA keeps one tensor per rank block in memory
(``block_params``, packed by ``to_file`` / ``from_file``), LoRA-FA keeps ``lora_down`` frozen (``frozen_params``).
Only torch is imported here.
"""

from __future__ import annotations

from torch import Tensor

from . import boft, dylora, full, glora, ia3, loha, lokr, lora, lora_fa, oft
from .base import Algorithm

_ALL = (lora, loha, lokr, dylora, lora_fa, full, ia3, glora)
ALGOS: dict[str, Algorithm] = {m.ALGORITHM.name: m.ALGORITHM for m in _ALL}
ALGOS.update({a.name: a for a in (oft.ALGORITHM, boft.ALGORITHM, oft.KOHYA_ALGORITHM)})  # OFT: diag-oft, boft, oft

# LyCORIS algorithm names that exist in files and on command lines but are not implemented here yet.
NOT_SUPPORTED = ("tlora",)

# A file tensor suffix -> the algorithm that owns it (first match wins; "alpha"/"dora_scale" are shared).
_SIGNATURES: tuple[tuple[str, str], ...] = (
    ("lora_down.weight", "lora"),
    ("lora_up.weight", "lora"),
    ("hada_w1_a", "loha"),
    ("lokr_w1", "lokr"),
    ("lokr_w1_a", "lokr"),
    ("lokr_w2", "lokr"),
    ("lokr_w2_a", "lokr"),
    ("w_norm", "norm"),
    ("diff", "full"),
    ("oft_blocks", "diag-oft"),
    ("oft_diag", "oft-legacy"),
    ("a1.weight", "glora"),
    ("on_input", "ia3"),
    ("lora_A.weight", "peft"),
    ("lora_B.weight", "peft"),
)


def detect_algo(suffixes: set[str]) -> str | None:
    """Name the algorithm of one module's tensors from their file suffixes (``None`` when nothing matches).

    Returns ``"lora" | "loha" | "lokr" | "full" | "ia3" | "glora" | "norm"`` for what this package implements, or
    the LyCORIS / PEFT name of a format it does not (``"diag-oft"``, ``"peft"``...), so the caller can say what the
    file is.
    """
    for suffix, algo in _SIGNATURES:
        if suffix in suffixes:
            return algo
    return None


def oft_variant(name: str, blocks: Tensor) -> str:
    """Which of the three formats that store ``oft_blocks`` a module is: sd-scripts' ``networks.oft`` (module name
    ``oft_unet_…``), LyCORIS ``boft`` ((m, n, b, b), 4 axes) or LyCORIS ``diag-oft`` ((n, b, b))."""
    if name.startswith("oft_"):
        return "oft"
    return "boft" if blocks.dim() == 4 else "diag-oft"
