"""``--network_module`` and ``--network_args``: which modules exist and how each ``key=value`` is read.

The generic modules (``networks.lora``, ``lycoris.kohya``, sd-scripts' ``networks.dylora`` / ``lora_fa`` / ``oft``)
are named here; sd-scripts' per-family modules (``networks.lora_<family>``) come from the registered families'
``adapter_rules`` (``library.families.adapters``), whose ``ARGS`` say how their own keys are read. Every key is
typed here into the values :class:`networks.config.NetworkConfig` is built from; problems are appended to the
reader's one list, so a command line gets all of them at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import fields

from library.cli.problems import did_you_mean
from library.families.adapters import AdapterRules
from library.families.registry import rules_by_module

logger = logging.getLogger("networks.config")  # the network flags' messages come from one logger

GENERIC_MODULES = ("networks.lora", "lycoris.kohya", "networks.dylora", "networks.lora_fa", "networks.oft")
# sd-scripts modules that are one algorithm each: the algorithm they train (their files are plain LoRA files)
MODULE_ALGOS = {"networks.dylora": "dylora", "networks.lora_fa": "lora_fa"}
ALGO_NAMES = ("lora", "locon", "loha", "lokr", "dora", "dylora", "diag-oft", "boft", "full", "diff", "ia3", "glora")
LR_WEIGHT_PRESETS = ("cosine", "sine", "linear", "reverse_linear", "zeros")


def modules() -> tuple[str, ...]:
    """Every ``--network_module`` accepted: the generic ones, then the registered families' own."""
    return (*GENERIC_MODULES, *rules_by_module())


def rules_for(module: str) -> AdapterRules | None:
    """The rules of a per-family LoRA module (``networks.lora_<family>``, from the registry), else None."""
    return rules_by_module().get(module)


def parse_bool(v: str) -> bool:
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


Spec = tuple[Callable[[str], object], str | None]
# key -> (parser, NetworkConfig field or None). Keys accepted by both modules.
_COMMON: dict[str, Spec] = {
    "algo": (str.lower, "algo"),
    "conv_dim": (int, "conv_dim"),
    "conv_alpha": (float, "conv_alpha"),
    "dropout": (float, "dropout"),
    "rank_dropout": (float, "rank_dropout"),
    "module_dropout": (float, "module_dropout"),
    "rank_dropout_scale": (parse_bool, "rank_dropout_scale"),
    "loraplus_lr_ratio": (float, "loraplus_lr_ratio"),
    "loraplus_unet_lr_ratio": (float, "loraplus_unet_lr_ratio"),
    "loraplus_text_encoder_lr_ratio": (float, "loraplus_text_encoder_lr_ratio"),
    "dora_wd": (parse_bool, "dora"),
    "wd_on_output": (parse_bool, "wd_on_output"),
    "use_tucker": (parse_bool, "use_tucker"),
    "use_cp": (parse_bool, "use_tucker"),
    "use_conv_cp": (parse_bool, "use_tucker"),
    "disable_conv_cp": (lambda v: not parse_bool(v), "use_tucker"),
    "use_scalar": (parse_bool, "use_scalar"),
    "rs_lora": (parse_bool, "rs_lora"),
    "train_norm": (parse_bool, "train_norm"),
    "factor": (int, "factor"),
    "decompose_both": (parse_bool, "decompose_both"),
    "full_matrix": (parse_bool, "full_matrix"),
    "unbalanced_factorization": (parse_bool, "unbalanced_factorization"),
    "preset": (str, "preset"),
    "train_on_input": (parse_bool, "train_on_input"),
    "block_size": (int, "block_size"),
    "constraint": (float, "constraint"),
    "rescaled": (parse_bool, "rescaled"),
}
# sd-scripts networks.oft reads only these two (every other key is ignored there, with a warning).
_OFT: dict[str, Spec] = {
    "enable_all_linear": (parse_bool, "enable_all_linear"),
    "enable_conv": (parse_bool, "enable_conv"),
}
# sd-scripts networks.lora only (LyCORIS ignores them).
_KOHYA: dict[str, Spec] = {
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
_DYLORA: dict[str, Spec] = {"unit": (int, "unit")}
# Accepted, no effect here (LyCORIS execution switches, other algorithms, a known no-op; the per-family modules' keys
# other modules accept come from their rules: no_effect()).
_NO_EFFECT = {
    "bypass_mode": "LoRA already runs as up(down(x)); other algorithms build ΔW",
    "train_llm_adapter": "none of the registered model families has an LLM adapter",
    "use_reentrant": "neither sd-scripts nor LyCORIS reads it",
}


def no_effect() -> dict[str, str]:
    """Keys every module accepts with a warning -> why they have no effect: the generic ones, and the per-family
    modules' keys that other modules (LyCORIS) accept (``AdapterRules.IGNORED_ELSEWHERE``)."""
    out = dict(_NO_EFFECT)
    rules = rules_by_module()
    for key in dict.fromkeys(k for r in rules.values() for k in r.IGNORED_ELSEWHERE):
        readers = [r for r in rules.values() if key in r.ARGS]
        why = next(r.IGNORED_ELSEWHERE[key] for r in rules.values() if key in r.IGNORED_ELSEWHERE)
        out.setdefault(key, f"only {' / '.join(r.MODULE for r in readers)} {_read(readers)} it ({why})")
    return out


def _read(readers: list) -> str:
    return "reads" if len(readers) == 1 else "read"


def check_module(module: str | None, errors: list[str]) -> str:
    """``--network_module`` (``networks.lora`` when it is missing or unknown, with the problem appended)."""
    known = modules()
    if module in known:
        return module
    if module is None:
        errors.append("--network_module is required: use networks.lora (LoRA/LoCon/LoHa/LoKr/DoRA) or lycoris.kohya")
    else:
        errors.append(f"--network_module {module!r} is unknown{did_you_mean(module, known)} (supported: "
                      f"{', '.join(known)})")  # fmt: skip
    return "networks.lora"


def split_network_args(items: list[str], errors: list[str]) -> dict[str, str]:
    """``["key=value", ...]`` -> {key: value} as given (for ``ss_network_args``)."""
    raw: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            errors.append(f"--network_args {item!r}: expected key=value (e.g. conv_dim=8)")
            continue
        raw[key.strip()] = value.strip()
    return raw


def read_network_args(raw: Mapping[str, str], module: str, values: dict, errors: list[str]) -> None:
    """Type every key of ``raw`` for ``module`` into ``values`` (NetworkConfig fields; a per-family module's own
    arguments as one ``module_args`` of its rules' ``Args``)."""
    rules = rules_for(module)
    if rules is not None:
        own: dict[str, object] = {}
        for key, value in raw.items():
            _read_rules_arg(rules, key, value, values, own, errors)
        values["module_args"] = rules.Args(**own)
        return
    silent = no_effect()
    known = [*_COMMON, *_KOHYA, *_DYLORA, *silent, *_OFT]
    family_rules = rules_by_module().values()
    for key, value in raw.items():
        readers = [r for r in family_rules if key in r.ARGS]
        if readers and key not in silent:
            names = " / ".join(r.MODULE for r in readers)
            errors.append(f"--network_args {key}: only --network_module {names} "
                          f"{_read(readers)} it ({' / '.join(r.DESCRIPTION for r in readers)})")  # fmt: skip
            continue
        if module == "networks.oft" and key not in _OFT:
            logger.warning("--network_args %s=%s is ignored by networks.oft (sd-scripts' OFT reads only "
                           "enable_all_linear and enable_conv)", key, value)  # fmt: skip
            continue
        if key in _OFT and module != "networks.oft":
            errors.append(f"--network_args {key}: only --network_module networks.oft reads it (sd-scripts' OFT); "
                          f"with {module} use preset= / conv_dim=")  # fmt: skip
            continue
        if key in silent:
            logger.warning("--network_args %s=%s has no effect (%s); ignored", key, value, silent[key])
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


def _read_rules_arg(rules: AdapterRules, key: str, value: str, values: dict, own: dict, errors: list[str]) -> None:
    """One key of a per-family LoRA module: its own arguments (into ``own``, its ``Args`` fields), plus the common
    keys it reads (into ``values``)."""
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
        parsed = (parse or parse_bool)(value)
    except ValueError as e:
        reason = {int: "expected an integer", float: "expected a number"}.get(parse, str(e))
        errors.append(f"--network_args {key}={value}: {reason}")
        return
    if name is None:
        return
    if name in _fields(rules.Args):
        own[name] = parsed
    else:
        values[name] = parsed


def _fields(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))
