"""A family's adapter rules: sd-scripts' per-family LoRA modules (``--network_module networks.lora_<family>``) as
the family states them (``ModelFamily.adapter_rules``), and the pieces several families' rules share.

A rules object (a module of the family's folder, e.g. ``library/families/flux/lora.py``) answers for one sd-scripts
network module: which ``--network_args`` it reads (``ARGS``, parsed into its own frozen dataclass ``Args``), which of
the common keys it does not read (``NOT_READ``), and which modules get an adapter at which rank (``preset``,
``select``, ``block_masks``, ``rank_for``, ``split_rows``). ``networks/`` builds and trains the adapters from these
answers (``networks.config`` reads the flags, ``networks.inject`` picks the targets); it never names a family.

Shared here: :class:`Preset` and :class:`Target` (what the rules select, re-exported by ``networks.targets``) and the
parsers of the list / block-selection / regex arguments. ``library.families.registry.rules_by_module`` gives the
registered families' modules.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import nn

from .base import Fused

if TYPE_CHECKING:
    from .base import TargetClasses
    from .lora_formats import LoraConversion

ArgSpec = tuple[Callable[[str], object] | None, str | None]
"""How one ``--network_args`` key is read: (parser, None for the shared true/false parser; the field it sets, None
for none): a field of the rules' ``Args`` or, for the common keys, of ``networks.config.NetworkConfig``."""

# sd-scripts' TEXT_ENCODER_TARGET_REPLACE_MODULE for T5-XXL (``lora_te3``, with train_t5xxl)
T5_TARGET_CLASSES = ("T5Attention", "T5DenseGatedActDense")
# the common keys of networks.lora / lycoris.kohya that sd-scripts' per-family modules (a plain LoRA) do not read
PLAIN_LORA_NOT_READ = ("algo", "dora_wd", "wd_on_output", "use_tucker", "use_cp", "use_conv_cp", "disable_conv_cp",
                       "use_scalar", "rs_lora", "train_norm", "factor", "decompose_both", "full_matrix",
                       "unbalanced_factorization", "preset", "train_on_input", "block_size", "constraint", "rescaled",
                       "rank_dropout_scale", "dropout")  # fmt: skip


@dataclass(frozen=True)
class LoraModuleArgs:
    """The ``--network_args`` of a per-family module that the adapter machinery itself reads; each family's rules
    subclass it with their own keys (``NetworkConfig.module_args`` holds one).

    ``split_qkv``: fused q|k|v(|mlp) targets get one LoRA per part (``AdapterRules.split_rows``); ``verbose``: list
    every module with its rank and alpha; ``reg_lrs``: ``network_reg_lrs`` (regex, lr) pairs in order, each regex's
    modules in their own optimizer group (empty where the module has no such key)."""

    split_qkv: bool = False
    verbose: bool = False
    reg_lrs: tuple[tuple[str, float], ...] = ()


class NetworkSettings(Protocol):
    """The members of ``networks.config.NetworkConfig`` a family's rules read."""

    dim: int
    alpha: float
    conv_dim: int | None
    conv_alpha: float | None
    train_unet_only: bool
    module_args: LoraModuleArgs | None


@dataclass(frozen=True)
class Preset:
    """Target classes and names for the UNet and the text encoders (LyCORIS preset semantics), resolved to class
    names (see ``networks.targets.builtin_preset``; a LyCORIS preset TOML names classes itself).

    ``enable_conv``: whether k > 1 convolutions inside the targets get adapters. Names are matched against the
    module path in the model and its renamed (kohya) path: equal, or ``re.match`` (a prefix regex, as LyCORIS
    does), or ``fnmatch`` with ``use_fnmatch``. ``unet_name_kind``: only modules of this kind ("linear" / "conv")
    are taken by a name match (None: any). ``te_by_prefix``: text-encoder classes per kohya prefix (``"*"``: any
    other), which replace ``te_classes`` when given (a family's ``TargetClasses.text_encoder``).
    """

    unet_classes: tuple[str, ...] = ()
    unet_names: tuple[str, ...] = ()
    te_classes: tuple[str, ...] = ()
    te_names: tuple[str, ...] = ()
    enable_conv: bool = False
    exclude_names: tuple[str, ...] = ()
    use_fnmatch: bool = False
    unet_name_kind: str | None = None
    te_by_prefix: Mapping[str, tuple[str, ...]] | None = None

    def te_classes_of(self, prefix: str) -> tuple[str, ...]:
        """The classes selected in the text encoder with this kohya prefix."""
        if self.te_by_prefix is None:
            return self.te_classes
        return self.te_by_prefix.get(prefix, self.te_by_prefix.get("*", ()))


@dataclass(frozen=True)
class Target:
    """One module to adapt: its kohya ``name``, the module, where it sits, and its kind.

    A fused target's ``module`` is a ``networks.fused.FusedBase`` (its ``weight`` the stacked rows of the leaves,
    ``segments`` (leaf, start, stop, offset) per part), ``path`` the fused module's name in the file's layout and
    ``fused`` its :class:`~library.families.base.Fused` entry.
    """

    name: str
    module: nn.Module
    root: int  # index into the roots
    path: str  # module path inside its root (a fused target: the fused module's name)
    kind: str  # "linear" | "conv" | "norm"
    fused: Fused | None = None

    @property
    def is_unet(self) -> bool:
        return self.name.startswith("lora_unet_")


class AdapterRules(Protocol):
    """One sd-scripts per-family network module (``networks.lora_flux``...) as its family's rules state it; a
    module of the family's folder satisfies it (``ModelFamily.adapter_rules`` maps the module name to it)."""

    MODULE: str
    """The ``--network_module`` name users type (``ss_network_module`` of its files)."""
    DESCRIPTION: str
    """What it is, for messages ("sd-scripts' FLUX LoRA")."""
    HINT: str
    """What to use instead of a common key it does not read."""
    ARGS: Mapping[str, ArgSpec]
    """Its own ``--network_args`` keys and the common ones it reads differently."""
    NOT_READ: tuple[str, ...]
    """The common keys it does not read (an error naming ``HINT``)."""
    IGNORED_ELSEWHERE: Mapping[str, str]
    """Keys of ``ARGS`` other modules accept with no effect (a warning), -> why they have none there."""
    Args: type[LoraModuleArgs]
    """Its arguments' frozen dataclass (``NetworkConfig.module_args``)."""
    CONVERSION: LoraConversion | None
    """The converter of its files between kohya and PEFT names, if there is one."""

    def validate(self, cfg: NetworkSettings, errors: list[str]) -> None:
        """The checks that need the whole config (problems appended to ``errors``)."""
        ...

    def text_cache_problems(self, cfg: NetworkSettings) -> list[str]:
        """Why ``--cache_text_encoder_outputs`` cannot run with these arguments (empty: it can)."""
        ...

    def wants_conv(self, cfg: NetworkSettings) -> bool:
        """Whether k > 1 convolutions are targets."""
        ...

    def preset(self, cfg: NetworkSettings, classes: TargetClasses) -> Preset:
        """The classes and names whose modules are targets, through the family's ``target_classes``."""
        ...

    def select(self, cfg: NetworkSettings, targets: Sequence[Target]) -> list[Target]:
        """The targets kept (e.g. one kind of block)."""
        ...

    def block_counts(self, targets: Sequence[Target], denoiser: nn.Module | None = None) -> dict[str, int]:
        """How many blocks of each kind the model has."""
        ...

    def block_masks(self, cfg: NetworkSettings, counts: dict[str, int]) -> dict[str, tuple[bool, ...] | None]:
        """The selected blocks of each kind (None: all); ``ValueError`` for an index outside the model."""
        ...

    def rank_for(self, cfg: NetworkSettings, name: str, masks: dict) -> tuple[int, float, str]:
        """(rank, alpha, the argument that set them) of one module; rank 0: no adapter."""
        ...

    def split_rows(self, cfg: NetworkSettings, target: Target) -> tuple[int, ...] | None:
        """The rows of each part that ``split_qkv`` gives its own LoRA, or None (one LoRA over the target)."""
        ...


def split_spec(rank: int, alpha: float, parts: int) -> tuple[int, float]:
    """The (rank, alpha) of the block-diagonal LoRA of ``parts`` rank-``rank`` LoRAs (``split_qkv``): (k·r, k·α),
    the same scale α/r."""
    return rank * parts, alpha * parts


def first_match(pairs: Sequence[tuple[str, object]], name: str) -> int | None:
    """The index of the first (regex, value) pair whose regex ``re.search``-es ``name``, else None (sd-scripts'
    ``network_reg_dims`` / ``network_reg_lrs`` rule)."""
    for i, (regex, _) in enumerate(pairs):
        if re.search(regex, name):
            return i
    return None


def t5_cache_problems(train_t5xxl: bool, cfg: NetworkSettings) -> list[str]:
    """``--cache_text_encoder_outputs`` with T5 adapters (``train_t5xxl=True`` while the text encoders train): T5's
    outputs change as its adapters train, so they cannot be cached."""
    if not train_t5xxl or cfg.train_unet_only:
        return []
    return ["--cache_text_encoder_outputs cannot be used with train_t5xxl=True (T5's outputs change as its adapters "
            "train; sd-scripts refuses it too): drop one of the two"]  # fmt: skip


# ---------------------------------------------------------------------------------------------------- parsing
def parse_rank_list(value: str, names: Sequence[str], negative: str = "ranks must not be negative") -> tuple[int, ...]:
    """``"[4,0,4]"`` (brackets optional) -> one rank per name; ``negative`` is the message for a rank below 0."""
    listed = ",".join(names)
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"expected {len(names)} comma-separated integers [{listed}]") from None
    if len(dims) != len(names):
        raise ValueError(f"{len(dims)} values given; {len(names)} are needed [{listed}]")
    if any(d < 0 for d in dims):
        raise ValueError(negative)
    return dims


def parse_dim(value: str) -> int:
    """One module type's rank (``img_attn_dim=4``, ``context_attn_dim=4``): an integer >= 0, 0 skips the modules."""
    try:
        dim = int(value)
    except ValueError:
        raise ValueError("expected an integer rank (0 skips these modules)") from None
    if dim < 0:
        raise ValueError("must not be negative (0 skips these modules)")
    return dim


def check_block_selection(value: str) -> str:
    """Check the syntax of ``"all"``, ``"none"``, ``""`` or ``"0-5,10"`` (the range is checked against the model)."""
    text = value.strip()
    if text in ("all", "none", ""):
        return text
    for part in text.split(","):
        ends = [p.strip() for p in part.split("-")] if "-" in part else [part.strip()]
        if len(ends) > 2 or not all(e.isdigit() for e in ends):
            raise ValueError(f"{part!r}: expected all, none, or indices and ranges like 0-5,10")
        if len(ends) == 2 and int(ends[0]) > int(ends[1]):
            raise ValueError(f"invalid range {part.strip()}: start > end")
    return text


def parse_block_selection(value: str, total: int, key: str) -> tuple[bool, ...]:
    """sd-scripts' ``parse_block_selection``: one bool per block (``total`` blocks in this model). ``ValueError``
    naming ``key`` for an index outside ``0..total-1``."""
    text = check_block_selection(value)
    if text == "all":
        return (True,) * total
    selected = [False] * total
    if text in ("none", ""):
        return tuple(selected)
    for part in text.split(","):
        a, _, b = part.partition("-")
        start, end = int(a), int(b or a)
        if not (0 <= start < total and 0 <= end < total):
            raise ValueError(f"--network_args {key}={value}: index {end if 0 <= start < total else start} is outside "
                             f"this model's {total} blocks (0-{total - 1})")  # fmt: skip
        for i in range(start, end + 1):
            selected[i] = True
    return tuple(selected)


def parse_reg_pairs(value: str, number: Callable[[str], int | float]) -> tuple[tuple[str, int | float], ...]:
    """``"regex=value,regex2=value2"`` -> pairs in order (sd-scripts' ``parse_kv_pairs``; the regex is compiled, and
    an entry that is not ``regex=number`` is an error here where sd-scripts only warns)."""
    pairs = []
    for pair in value.split(","):
        pair = pair.strip()
        if not pair:
            continue
        key, sep, num = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{pair!r}: expected regex=value")
        try:
            re.compile(key.strip())
        except re.error as e:
            raise ValueError(f"{key.strip()!r} is not a regular expression ({e})") from None
        try:
            pairs.append((key.strip(), number(num.strip())))
        except ValueError:
            raise ValueError(
                f"{pair!r}: {num.strip()!r} is not {'an integer' if number is int else 'a number'}"
            ) from None
    return tuple(pairs)


def parse_regex_list(value: str) -> tuple[str, ...]:
    """``exclude_patterns`` / ``include_patterns``: a Python literal, one regex or a list of them (the reference
    modules' ``ast.literal_eval``), each compiled."""
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ValueError("expected a Python list of regular expressions, e.g. ['.*mlp.*']") from None
    parsed = parsed if isinstance(parsed, list) else [parsed]
    for p in parsed:
        if not isinstance(p, str):
            raise ValueError(f"{p!r} is not a string")
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"{p!r} is not a regular expression ({e})") from None
    return tuple(parsed)


def parse_reg_dims(value: str) -> tuple[tuple[str, int], ...]:
    """``network_reg_dims``: (regex, rank) pairs in order."""
    return parse_reg_pairs(value, int)


def parse_reg_lrs(value: str) -> tuple[tuple[str, float], ...]:
    """``network_reg_lrs``: (regex, learning rate) pairs in order."""
    return parse_reg_pairs(value, float)
