"""The network flags (sd-scripts names, types and defaults) and their one reader, :class:`NetworkConfig`.

``--network_args`` is a list of ``key=value`` strings. Both ``networks.lora`` (sd-scripts) and ``lycoris.kohya``
(LyCORIS) spellings are accepted; every key is typed and validated here, and all problems are reported in one
``ValueError``. Keys the chosen module would silently ignore (sd-scripts' block arguments under LyCORIS, LyCORIS
options with no effect on the chosen algorithm) are accepted with a warning, so existing command lines run unchanged;
any other unknown key is an error with a "did you mean".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from library.cli.problems import ConfigError, did_you_mean

from . import algo_options, lora_flux, lora_sd3
from .algo_options import OFT_ALGOS
from .algos import NOT_SUPPORTED
from .targets import PRESETS

logger = logging.getLogger(__name__)

MODULES = (
    "networks.lora",
    "lycoris.kohya",
    "networks.dylora",
    "networks.lora_fa",
    "networks.oft",
    "networks.lora_flux",
    "networks.lora_sd3",
)
# sd-scripts' per-family LoRA modules whose rules live in their own networks module (the same functions each:
# ARGS, NOT_READ, HINT, validate, preset, select, block_counts, block_masks, rank_for, split_rows, ...)
RULE_MODULES = {lora_flux.MODULE: lora_flux, lora_sd3.MODULE: lora_sd3}
# sd-scripts modules that are one algorithm each: the algorithm they train (their files are plain LoRA files)
MODULE_ALGOS = {"networks.dylora": "dylora", "networks.lora_fa": "lora_fa"}
LATER_MODULES = (
    "networks.lora_diffusers",
    "networks.lora_lumina", "networks.lora_hunyuan_image", "networks.lora_anima",
)  # fmt: skip
ALGO_NAMES = ("lora", "locon", "loha", "lokr", "dora", "dylora", "diag-oft", "boft", "full", "diff", "ia3", "glora")
LR_WEIGHT_PRESETS = ("cosine", "sine", "linear", "reverse_linear", "zeros")


def _bool(v: str) -> bool:
    s = v.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", "none", ""):
        return False
    raise ValueError(f"expected true/false, got {v!r}")


def _ints(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in v.split(","))
    except ValueError:
        raise ValueError("expected comma-separated integers") from None


def _floats(v: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in v.split(","))
    except ValueError:
        raise ValueError("expected comma-separated numbers") from None


def _lr_weight(v: str) -> str | tuple[float, ...]:
    """A list of floats (empty entries mean 0, as in sd-scripts) or a preset name with an optional ``+base``."""
    if "," in v or v.replace(".", "", 1).strip().isdigit():
        return tuple(float(x) if x.strip() else 0.0 for x in v.split(","))
    name, _, base = v.partition("+")
    if name not in LR_WEIGHT_PRESETS:
        raise ValueError(f"expected a comma-separated list or one of {', '.join(LR_WEIGHT_PRESETS)} (+base)")
    if base:
        float(base)
    return v


# key -> (parser, NetworkConfig field or None). Keys accepted by both modules.
_COMMON: dict[str, tuple[Any, str | None]] = {
    "algo": (str.lower, "algo"),
    "conv_dim": (int, "conv_dim"),
    "conv_alpha": (float, "conv_alpha"),
    "dropout": (float, "dropout"),
    "rank_dropout": (float, "rank_dropout"),
    "module_dropout": (float, "module_dropout"),
    "rank_dropout_scale": (_bool, "rank_dropout_scale"),
    "loraplus_lr_ratio": (float, "loraplus_lr_ratio"),
    "loraplus_unet_lr_ratio": (float, "loraplus_unet_lr_ratio"),
    "loraplus_text_encoder_lr_ratio": (float, "loraplus_text_encoder_lr_ratio"),
    "dora_wd": (_bool, "dora"),
    "wd_on_output": (_bool, "wd_on_output"),
    "use_tucker": (_bool, "use_tucker"),
    "use_cp": (_bool, "use_tucker"),
    "use_conv_cp": (_bool, "use_tucker"),
    "disable_conv_cp": (lambda v: not _bool(v), "use_tucker"),
    "use_scalar": (_bool, "use_scalar"),
    "rs_lora": (_bool, "rs_lora"),
    "train_norm": (_bool, "train_norm"),
    "factor": (int, "factor"),
    "decompose_both": (_bool, "decompose_both"),
    "full_matrix": (_bool, "full_matrix"),
    "unbalanced_factorization": (_bool, "unbalanced_factorization"),
    "preset": (str, "preset"),
    "train_on_input": (_bool, "train_on_input"),
    "block_size": (int, "block_size"),
    "constraint": (float, "constraint"),
    "rescaled": (_bool, "rescaled"),
}
# sd-scripts networks.oft reads only these two (every other key is ignored there, with a warning).
_OFT: dict[str, tuple[Any, str | None]] = {
    "enable_all_linear": (_bool, "enable_all_linear"),
    "enable_conv": (_bool, "enable_conv"),
}
# sd-scripts networks.lora only (LyCORIS ignores them).
_KOHYA: dict[str, tuple[Any, str | None]] = {
    "block_dims": (_ints, "block_dims"),
    "block_alphas": (_floats, "block_alphas"),
    "conv_block_dims": (_ints, "conv_block_dims"),
    "conv_block_alphas": (_floats, "conv_block_alphas"),
    "down_lr_weight": (_lr_weight, "down_lr_weight"),
    "mid_lr_weight": (_floats, "mid_lr_weight"),
    "up_lr_weight": (_lr_weight, "up_lr_weight"),
    "block_lr_zero_threshold": (float, "block_lr_zero_threshold"),
}
# sd-scripts networks.dylora only.
_DYLORA: dict[str, tuple[Any, str | None]] = {"unit": (int, "unit")}
# Accepted, no effect here (LyCORIS execution switches, other model families, other algorithms; a known no-op).
_NO_EFFECT = {
    "bypass_mode": "LoRA already runs as up(down(x)); other algorithms build ΔW",
    "train_t5xxl": "only networks.lora_flux / networks.lora_sd3 read it (LyCORIS 4.1.3 stores it but adapts no T5 module)",
    "train_llm_adapter": "not an SD1/SD2/SDXL option",
    "use_reentrant": "neither sd-scripts nor LyCORIS reads it",
}


@dataclass(frozen=True)
class NetworkConfig:
    """Everything that shapes the adapter network, read once from the flags (see :func:`add_network_args`)."""

    module: str = "networks.lora"
    algo: str = "lora"  # lora | loha | lokr ("locon" is lora; "dora" is lora + dora)
    dora: bool = False
    wd_on_output: bool = True  # DoRA magnitude per output row (LyCORIS >= 3.2, PEFT); False: per input column
    dim: int = 4
    alpha: float = 1.0
    dropout: float | None = None
    conv_dim: int | None = None
    conv_alpha: float | None = None
    block_dims: tuple[int, ...] | None = None
    block_alphas: tuple[float, ...] | None = None
    conv_block_dims: tuple[int, ...] | None = None
    conv_block_alphas: tuple[float, ...] | None = None
    down_lr_weight: str | tuple[float, ...] | None = None
    mid_lr_weight: tuple[float, ...] | None = None
    up_lr_weight: str | tuple[float, ...] | None = None
    block_lr_zero_threshold: float = 0.0
    rank_dropout: float | None = None
    module_dropout: float | None = None
    rank_dropout_scale: bool = False
    loraplus_lr_ratio: float | None = None
    loraplus_unet_lr_ratio: float | None = None
    loraplus_text_encoder_lr_ratio: float | None = None
    train_norm: bool = False
    use_tucker: bool = False
    use_scalar: bool = False
    rs_lora: bool = False
    factor: int = -1
    decompose_both: bool = False
    full_matrix: bool = False
    unbalanced_factorization: bool = False
    train_on_input: bool = False  # (IA)³: scale the input channels instead of the output channels
    preset: str | None = None
    unit: int = 1  # networks.dylora: rank block trained per step (sd-scripts)
    block_size: int = 4  # lycoris.kohya algo=dylora: rank block trained per step (LyCORIS)
    constraint: float = 0.0  # LyCORIS OFT / BOFT: the norm cap of Q per output row, stored as alpha (0: none)
    rescaled: bool = False  # LyCORIS OFT / BOFT: a trained per-row rescale
    enable_all_linear: bool = False  # networks.oft: every Linear of the transformer blocks, not only attention
    enable_conv: bool = False  # networks.oft: also the ResNet / down / up-sampler blocks, 3x3 convs included
    # networks.lora_flux (sd-scripts' FLUX LoRA; see networks/lora_flux.py)
    train_blocks: str | None = None  # all | single | double
    img_attn_dim: int | None = None
    txt_attn_dim: int | None = None
    img_mlp_dim: int | None = None
    txt_mlp_dim: int | None = None
    img_mod_dim: int | None = None
    txt_mod_dim: int | None = None
    single_dim: int | None = None
    single_mod_dim: int | None = None
    in_dims: tuple[int, ...] | None = None  # img, time, vector, guidance, txt
    train_double_block_indices: str | None = None
    train_single_block_indices: str | None = None
    split_qkv: bool = False
    train_t5xxl: bool = False
    verbose: bool = False
    reg_dims: tuple[tuple[str, int], ...] = ()  # (regex, rank) in order
    reg_lrs: tuple[tuple[str, float], ...] = ()  # (regex, lr) in order
    # the arguments of a RULE_MODULES module with no field here, as (key, parsed value) pairs (networks.lora_sd3)
    module_args: tuple[tuple[str, Any], ...] = ()
    network_weights: str | None = None
    dim_from_weights: bool = False
    base_weights: tuple[str, ...] = ()
    base_weights_multiplier: tuple[float, ...] = ()
    scale_weight_norms: float | None = None
    train_unet_only: bool = False
    train_text_encoder_only: bool = False
    network_args: dict[str, str] = field(default_factory=dict)  # as given, for ss_network_args

    @property
    def trains_text_encoder(self) -> bool:
        """sd-scripts: text-encoder adapters train unless --network_train_unet_only (a 0 lr drops them later)."""
        return not self.train_unet_only

    @property
    def is_lycoris(self) -> bool:
        return self.module == "lycoris.kohya"

    @property
    def dylora_style(self) -> str:
        """``"kohya"`` (sd-scripts networks.dylora) or ``"lycoris"`` (lycoris.kohya algo=dylora)."""
        return "lycoris" if self.is_lycoris else "kohya"

    @property
    def dylora_block(self) -> int:
        """The DyLoRA rank block: ``unit`` (networks.dylora) or ``block_size`` (lycoris.kohya)."""
        return self.block_size if self.is_lycoris else self.unit

    @property
    def is_oft(self) -> bool:
        """An orthogonal algorithm (diag-oft, boft, sd-scripts' oft): alpha is a constraint, ΔW depends on W."""
        return self.algo in OFT_ALGOS

    def oft_alpha(self) -> float:
        """The constraint stored as each module's alpha: ``--network_alpha`` for networks.oft, ``constraint=`` for
        LyCORIS' diag-oft / boft."""
        return self.alpha if self.module == "networks.oft" else self.constraint

    @property
    def uses_loraplus(self) -> bool:
        """A LoRA+ ratio given (for the whole network, the U-Net or the text encoders)."""
        return bool(self.loraplus_lr_ratio or self.loraplus_unet_lr_ratio or self.loraplus_text_encoder_lr_ratio)

    @property
    def uses_blocks(self) -> bool:
        """sd-scripts' per-block mode: block dims or block lr weights given."""
        return any(v is not None for v in (self.block_dims, self.down_lr_weight, self.mid_lr_weight, self.up_lr_weight))

    def resolved_conv(self) -> tuple[int, float]:
        """(rank, alpha) for k > 1 convolutions; rank 0 means no conv adapters.

        networks.lora: only with ``conv_dim`` (alpha default 1.0). lycoris.kohya: ``conv_dim`` defaults to
        ``--network_dim`` and ``conv_alpha`` to ``--network_alpha`` (LyCORIS' defaults).
        """
        if self.is_lycoris:
            dim = self.dim if self.conv_dim is None else self.conv_dim
            alpha = self.alpha if not self.conv_alpha else self.conv_alpha
        elif self.module == "networks.dylora":  # sd-scripts: conv_dim == network_dim, network_alpha everywhere
            dim, alpha = (self.dim if self.conv_dim else 0), self.alpha
        else:
            dim = self.conv_dim or 0
            alpha = 1.0 if self.conv_alpha is None else self.conv_alpha
        return dim, (alpha or float(dim))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NetworkConfig:
        """Read and validate the network flags; raise one ``ValueError`` listing every problem."""
        errors: list[str] = []
        module = _check_module(getattr(args, "network_module", None), errors)
        values: dict[str, Any] = {"module": module}
        raw = _split_network_args(getattr(args, "network_args", None) or [], errors)
        values["network_args"] = raw
        _read_network_args(raw, module, values, errors)
        _read_flags(args, values, errors)
        if module in MODULE_ALGOS:
            if "algo" in values:
                errors.append(f"--network_args algo={values['algo']}: {module} trains {MODULE_ALGOS[module]} only; "
                              "drop algo= (or use --network_module lycoris.kohya / networks.lora for other "
                              "algorithms)")  # fmt: skip
            values["algo"] = MODULE_ALGOS[module]
        if module == "networks.oft":
            algo_options.read_oft_flags(args, values, errors)
        algo = values.get("algo", "lora")
        if algo in ("locon", "dora"):
            values["dora"] = values.get("dora", False) or algo == "dora"
            values["algo"] = "lora"
        if algo == "diff":  # the name of the file format (diff / diff_b): LyCORIS' algo=full
            values["algo"] = "full"
        algo_options.switch_off_ignored(values)
        cfg = cls(**values)  # holds every value that parsed, so the checks below still report their problems
        _validate(cfg, errors)
        # cached outputs with text-encoder adapters: library/run/setup.py read_config asks the family
        # (FLUX.1 recomputes CLIP-L's pooled output over the T5 cache, as sd-scripts); T5 adapters never can
        if getattr(args, "cache_text_encoder_outputs", False) and cfg.train_t5xxl and not cfg.train_unet_only:
            errors.append("--cache_text_encoder_outputs cannot be used with train_t5xxl=True (T5's outputs change as "
                          "its adapters train; sd-scripts refuses it too): drop one of the two")  # fmt: skip
        if errors:
            raise ConfigError(errors, "network options")
        return cfg

    def metadata(self) -> dict[str, str]:
        """The ``ss_network_*`` keys sd-scripts writes (the trainer adds the rest)."""
        return {
            "ss_network_module": self.module,
            "ss_network_dim": str(self.dim),
            "ss_network_alpha": str(self.alpha),
            "ss_network_dropout": str(self.dropout),
            "ss_network_args": json.dumps(self.network_args) if self.network_args else "null",
        }


def _check_module(module: str | None, errors: list[str]) -> str:
    if module in MODULES:
        return module
    if module is None:
        errors.append("--network_module is required: use networks.lora (LoRA/LoCon/LoHa/LoKr/DoRA) or lycoris.kohya")
    elif module in LATER_MODULES:
        errors.append(f"--network_module {module} is not supported yet; supported: {', '.join(MODULES)}")
    else:
        errors.append(f"--network_module {module!r} is unknown{did_you_mean(module, MODULES)} (supported: "
                      f"{', '.join(MODULES)})")  # fmt: skip
    return "networks.lora"


def _split_network_args(items: list[str], errors: list[str]) -> dict[str, str]:
    raw: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            errors.append(f"--network_args {item!r}: expected key=value (e.g. conv_dim=8)")
            continue
        raw[key.strip()] = value.strip()
    return raw


_FIELDS = frozenset(f.name for f in fields(NetworkConfig))


def rules_for(module: str):
    """The networks module holding the rules of a per-family LoRA module (networks.lora_flux...), else None."""
    return RULE_MODULES.get(module)


def _read_rules_arg(rules, key: str, value: str, values: dict, errors: list[str]) -> None:
    """One key of a per-family LoRA module (networks.lora_flux / lora_sd3): its own arguments, plus the common keys
    it reads. Arguments with no NetworkConfig field go to ``module_args``."""
    if key in rules.NOT_READ or key in _KOHYA or key in _DYLORA or key in _OFT:
        errors.append(f"--network_args {key}: {rules.MODULE} ({rules.DESCRIPTION}) does not read it; {rules.HINT}")
        return
    spec = rules.ARGS.get(key) or _COMMON.get(key)
    if spec is None:
        known = [*rules.ARGS, *(k for k in _COMMON if k not in rules.NOT_READ)]
        errors.append(f"--network_args {key}: unknown argument of {rules.MODULE}{did_you_mean(key, known)}")
        return
    parse, name = spec
    try:
        parsed = (parse or _bool)(value)
    except ValueError as e:
        reason = {int: "expected an integer", float: "expected a number"}.get(parse, str(e))
        errors.append(f"--network_args {key}={value}: {reason}")
        return
    if name is None:
        return
    if name in _FIELDS:
        values[name] = parsed
    else:
        values["module_args"] = (*values.get("module_args", ()), (name, parsed))


def _read_network_args(raw: dict[str, str], module: str, values: dict, errors: list[str]) -> None:
    known = [*_COMMON, *_KOHYA, *_DYLORA, *_NO_EFFECT, *_OFT]
    for key, value in raw.items():
        rules = rules_for(module)
        if rules is not None:
            _read_rules_arg(rules, key, value, values, errors)
            continue
        readers = [r for r in RULE_MODULES.values() if key in r.ARGS]
        if readers and key not in _NO_EFFECT:
            names = " / ".join(r.MODULE for r in readers)
            errors.append(f"--network_args {key}: only --network_module {names} "
                          f"{'reads' if len(readers) == 1 else 'read'} it ({' / '.join(r.DESCRIPTION for r in readers)})")  # fmt: skip
            continue
        if module == "networks.oft" and key not in _OFT:
            logger.warning("--network_args %s=%s is ignored by networks.oft (sd-scripts' OFT reads only "
                           "enable_all_linear and enable_conv)", key, value)  # fmt: skip
            continue
        if key in _OFT and module != "networks.oft":
            errors.append(f"--network_args {key}: only --network_module networks.oft reads it (sd-scripts' OFT); "
                          f"with {module} use preset= / conv_dim=")  # fmt: skip
            continue
        if key in _NO_EFFECT:
            logger.warning("--network_args %s=%s has no effect (%s); ignored", key, value, _NO_EFFECT[key])
            continue
        if key in _KOHYA and module == "lycoris.kohya":
            logger.warning("--network_args %s is ignored by lycoris.kohya (LyCORIS does not read it, so neither do "
                           "we); use --network_module networks.lora for per-block ranks and lr weights", key)  # fmt: skip
            continue
        if key in _DYLORA and module != "networks.dylora":
            errors.append(f"--network_args {key}: only networks.dylora reads it (lycoris.kohya algo=dylora: "
                          "block_size)")  # fmt: skip
            continue
        spec = _COMMON.get(key) or _KOHYA.get(key) or _DYLORA.get(key) or _OFT.get(key)
        if spec is None:
            errors.append(f"--network_args {key}: unknown argument{did_you_mean(key, known)}")
            continue
        parse, name = spec
        try:
            parsed = parse(value)
        except ValueError as e:
            reason = {int: "expected an integer", float: "expected a number"}.get(parse, str(e))
            errors.append(f"--network_args {key}={value}: {reason}")
            continue
        if name == "use_tucker":
            parsed = parsed or values.get("use_tucker", False)
        values[name] = parsed


def _read_flags(args: argparse.Namespace, values: dict, errors: list[str]) -> None:
    dim = getattr(args, "network_dim", None)
    values["dim"] = 4 if dim is None else dim
    alpha = getattr(args, "network_alpha", 1.0)
    values["alpha"] = float(values["dim"]) if not alpha else float(alpha)  # 0 / None -> alpha = dim
    flag_dropout = getattr(args, "network_dropout", None)
    if flag_dropout is not None:
        values["dropout"] = flag_dropout
    values["network_weights"] = getattr(args, "network_weights", None)
    values["dim_from_weights"] = bool(getattr(args, "dim_from_weights", False))
    values["base_weights"] = tuple(getattr(args, "base_weights", None) or ())
    values["base_weights_multiplier"] = tuple(getattr(args, "base_weights_multiplier", None) or ())
    values["scale_weight_norms"] = getattr(args, "scale_weight_norms", None)
    values["train_unet_only"] = bool(getattr(args, "network_train_unet_only", False))
    values["train_text_encoder_only"] = bool(getattr(args, "network_train_text_encoder_only", False))


def _validate(cfg: NetworkConfig, errors: list[str]) -> None:
    algo_options.validate_oft(cfg, errors)
    if cfg.algo == "oft" and cfg.module != "networks.oft":
        errors.append("--network_args algo=oft: LyCORIS has no algorithm 'oft'; use algo=diag-oft or algo=boft, or "
                      "--network_module networks.oft for sd-scripts' OFT")  # fmt: skip
    elif cfg.algo not in ALGO_NAMES and cfg.algo not in MODULE_ALGOS.values() and cfg.module != "networks.oft":
        if cfg.algo in NOT_SUPPORTED:
            errors.append(f"--network_args algo={cfg.algo} is not supported yet; supported: {', '.join(ALGO_NAMES)}")
        else:
            errors.append(f"--network_args algo={cfg.algo}: unknown algorithm{did_you_mean(cfg.algo, ALGO_NAMES)}")
    if cfg.dim < 1:
        errors.append(f"--network_dim {cfg.dim}: the rank must be at least 1")
    if cfg.alpha < 0:
        errors.append(f"--network_alpha {cfg.alpha}: must not be negative")
    for name in ("conv_dim", "factor"):
        value = getattr(cfg, name)
        if value is not None and value < 0 and not (name == "factor" and value == -1):
            errors.append(f"--network_args {name}={value}: must not be negative" + (" (or -1)" * (name == "factor")))
    for name in ("dropout", "rank_dropout", "module_dropout"):
        p = getattr(cfg, name)
        if p is not None and not 0.0 <= p < 1.0:
            flag = "--network_dropout" if name == "dropout" else f"--network_args {name}"
            errors.append(f"{flag} {p}: a probability in [0, 1) is needed")
    for name in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
        r = getattr(cfg, name)
        if r is not None and r <= 0:
            errors.append(f"--network_args {name}={r}: must be > 0")
    if cfg.uses_loraplus and cfg.algo in ("loha", "lokr", "full", "ia3", "glora", *OFT_ALGOS):
        logger.warning("loraplus_*lr_ratio applies to LoRA's lora_up only; with algo=%s it has no effect (as in "
                       "LyCORIS)", cfg.algo)  # fmt: skip
    _validate_blocks(cfg, errors)
    _validate_files(cfg, errors)
    rules = rules_for(cfg.module)
    if rules is not None:
        rules.validate(cfg, errors)
    algo_options.validate_dylora(cfg, errors)
    algo_options.validate_lora_fa(cfg, errors)


def _validate_blocks(cfg: NetworkConfig, errors: list[str]) -> None:
    for name in ("block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas"):
        values = getattr(cfg, name)
        if values is not None and len(values) not in (25, 23):
            errors.append(
                f"--network_args {name}: {len(values)} values given; SD1/SD2 need 25 (IN00-IN11, MID, OUT00-OUT11) "
                "and SDXL needs 23"
            )
        if values is not None and any(v < 0 for v in values):
            errors.append(f"--network_args {name}: values must not be negative")
    if cfg.preset is not None and cfg.preset not in PRESETS and not cfg.preset.endswith(".toml"):
        errors.append(f"--network_args preset={cfg.preset}: unknown preset{did_you_mean(cfg.preset, list(PRESETS))} "
                      f"(built-in: {', '.join(PRESETS)}, or a LyCORIS preset .toml file)")  # fmt: skip
    elif cfg.preset is not None and cfg.preset.endswith(".toml") and not os.path.isfile(cfg.preset):
        errors.append(f"--network_args preset={cfg.preset}: no such file")
    if cfg.train_unet_only and cfg.train_text_encoder_only:
        errors.append("--network_train_unet_only and --network_train_text_encoder_only exclude each other")


def _validate_files(cfg: NetworkConfig, errors: list[str]) -> None:
    if cfg.dim_from_weights and not cfg.network_weights:
        errors.append("--dim_from_weights needs --network_weights (the file to read the ranks from)")
    for flag, paths in (("--network_weights", [cfg.network_weights] if cfg.network_weights else []),
                        ("--base_weights", list(cfg.base_weights))):  # fmt: skip
        for path in paths:
            if not os.path.isfile(path):
                errors.append(f"{flag} {path}: no such file")
    if len(cfg.base_weights_multiplier) > len(cfg.base_weights):
        errors.append(
            f"--base_weights_multiplier has {len(cfg.base_weights_multiplier)} values for "
            f"{len(cfg.base_weights)} --base_weights files"
        )
    if cfg.scale_weight_norms is not None and cfg.scale_weight_norms <= 0:
        errors.append(f"--scale_weight_norms {cfg.scale_weight_norms}: must be > 0")


def add_network_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The network flags of sd-scripts' train_network.py, with its types and defaults, as one argument group."""
    g = parser.add_argument_group("network", "adapter network (LoRA, LoCon, LoHa, LoKr, DoRA)")
    g.add_argument(
        "--network_module",
        type=str,
        default=None,
        help="networks.lora (LoRA/LoCon/LoHa/LoKr/DoRA via algo=), lycoris.kohya (also algo=dylora/diag-oft/boft), "
        "networks.dylora, networks.lora_fa or networks.oft (sd-scripts' DyLoRA, LoRA-FA and OFT)",
    )
    g.add_argument("--network_dim", type=int, default=None, help="rank (default 4)")
    g.add_argument(
        "--network_alpha",
        type=float,
        default=1,
        help="alpha for scaling: scale = alpha / rank (default 1; 0 means alpha = rank)",
    )
    g.add_argument(
        "--network_dropout",
        type=float,
        default=None,
        help="dropout on the adapter's rank-r activation (0 or None: none)",
    )
    g.add_argument(
        "--network_args",
        type=str,
        default=None,
        nargs="*",
        help="key=value options: algo, conv_dim, conv_alpha, block_dims, preset, dora_wd, ...",
    )
    g.add_argument("--network_weights", type=str, default=None, help="adapter file to start from")
    g.add_argument(
        "--dim_from_weights",
        action="store_true",
        help="build the network (algorithm, ranks, modules) from --network_weights",
    )
    g.add_argument("--network_train_unet_only", action="store_true", help="adapters on the U-Net only")
    g.add_argument(
        "--network_train_text_encoder_only", action="store_true", help="adapters on the text encoder(s) only"
    )
    g.add_argument(
        "--scale_weight_norms",
        type=float,
        default=None,
        help="after each step, scale down each module whose ||ΔW|| exceeds this (1 is a good start)",
    )
    g.add_argument(
        "--base_weights",
        type=str,
        default=None,
        nargs="*",
        help="adapter files merged into the base model before training",
    )
    g.add_argument("--base_weights_multiplier", type=float, default=None, nargs="*",
                   help="multiplier for each --base_weights file (default 1.0)")  # fmt: skip
    return g
