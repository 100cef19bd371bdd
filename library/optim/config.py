"""The optimizer / LR-scheduler flags (sd-scripts' names, types and defaults) and :class:`OptimConfig`, their reader.

``add_optim_args(parser)`` adds the 16 flags of sd-scripts' ``add_optimizer_arguments``. ``OptimConfig.from_args``
is their only reader: it parses ``key=value`` lists, resolves the legacy aliases, forces the ``adafactor`` scheduler
where sd-scripts does, and checks everything that can be checked before training (names with "did you mean",
optimizer arguments against the class's signature, scheduler arguments, warmup rules), reporting all problems at
once in one ``ValueError``.
"""

from __future__ import annotations

import argparse
import ast
import logging
import math
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from library.cli.problems import ConfigError
from library.optim.optimizers import (
    ADAFACTOR,
    SCHEDULE_FREE,
    OptimizerSpec,
    optimizer_arg_problems,
    resolve_optimizer,
    resolve_optimizer_kwargs,
)
from library.optim.schedulers import scheduler_problems

logger = logging.getLogger(__name__)

_STEPS_HELP = (
    "int = steps, float below 1 = ratio of the training steps, or a percentage like 5%% (1.0 / 2.5 are rejected)"
)


def parse_step_count(value: str) -> int | float:
    """sd-scripts' ``int_or_float``: ``"100"`` -> 100 steps, ``"0.05"`` -> ratio 0.05, ``"5%"`` -> 0.05.

    A number >= 1 must be a whole step count without a decimal point (``"1.0"`` and ``"2.5"`` are rejected, as in
    sd-scripts); negative values are rejected. Raises ``argparse.ArgumentTypeError`` with the accepted forms.
    """
    text = str(value).strip()
    forms = "a whole number of steps (100), a ratio below 1 (0.05) or a percentage (5%)"
    if re.fullmatch(r"\d+", text):
        return int(text)
    try:
        ratio = float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not {forms}") from None
    if not 0.0 <= ratio <= 1.0 or (ratio == 1.0 and not text.endswith("%")):
        raise argparse.ArgumentTypeError(f"'{value}' is not {forms}")
    return ratio


@dataclass(frozen=True)
class _Flag:
    name: str
    default: Any
    help: str
    type: Callable[[str], Any] | None = str
    nargs: str | None = None


_FLAGS = (
    _Flag(
        "optimizer_type",
        "",
        "optimizer: AdamW (default), AdamW8bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit, Lion8bit, "
        "PagedLion8bit, Lion, SGDNesterov, SGDNesterov8bit, DAdaptation(DAdaptAdamPreprint), DAdaptAdaGrad, "
        "DAdaptAdam, DAdaptAdan, DAdaptAdanIP, DAdaptLion, DAdaptSGD, Prodigy, AdaFactor, CAME, AdamWScheduleFree, "
        "RAdamScheduleFree, SGDScheduleFree, any torch.optim class, or any class as module.Class "
        "(e.g. bitsandbytes.optim.AdEMAMix8bit)",
    ),
    _Flag(
        "use_8bit_adam", False, "use 8bit AdamW optimizer (requires bitsandbytes); same as --optimizer_type AdamW8bit"
    ),
    _Flag("use_lion_optimizer", False, "use Lion optimizer (requires lion-pytorch); same as --optimizer_type Lion"),
    _Flag("learning_rate", 2e-6, "learning rate", float),
    _Flag("max_grad_norm", 1.0, "Max gradient norm, 0 for no clipping", float),
    _Flag(
        "optimizer_args",
        None,
        'additional arguments for optimizer (like "weight_decay=0.01 betas=0.9,0.999 ..."); values are Python '
        "literals, checked against the optimizer's arguments",
        nargs="*",
    ),
    _Flag("lr_scheduler_type", "", "custom scheduler class: module.Class, or a torch.optim.lr_scheduler class name"),
    _Flag("lr_scheduler_args", None, 'additional arguments for scheduler (like "T_max=100")', nargs="*"),
    _Flag(
        "lr_scheduler",
        "constant",
        "scheduler to use for learning rate: linear, cosine, cosine_with_restarts, polynomial, constant (default), "
        "constant_with_warmup, inverse_sqrt, cosine_with_min_lr, cosine_warmup_with_min_lr, warmup_stable_decay, "
        "piecewise_constant, adafactor, rex",
    ),
    _Flag("lr_warmup_steps", 0, f"warmup of the lr scheduler: {_STEPS_HELP}", parse_step_count),
    _Flag("lr_decay_steps", 0, f"decay of the lr scheduler (warmup_stable_decay): {_STEPS_HELP}", parse_step_count),
    _Flag("lr_scheduler_num_cycles", 1, "Number of restarts for cosine scheduler with restarts", int),
    _Flag("lr_scheduler_power", 1, "Polynomial power for polynomial scheduler", float),
    _Flag(
        "fused_backward_pass",
        False,
        "Combines backward pass and optimizer step to reduce VRAM usage (Adafactor, gradient accumulation 1)",
    ),
    _Flag("lr_scheduler_timescale", None, "Inverse sqrt timescale for inverse sqrt scheduler, defaults to warmup", int),
    _Flag(
        "lr_scheduler_min_lr_ratio",
        None,
        "The minimum learning rate as a ratio of the initial learning rate for cosine_with_min_lr, "
        "cosine_warmup_with_min_lr, warmup_stable_decay and rex",
        float,
    ),
)


def add_optim_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add sd-scripts' optimizer and LR-scheduler flags (same names, types, defaults) as the group "optimizer"."""
    group = parser.add_argument_group("optimizer", "optimizer and learning-rate schedule")
    for flag in _FLAGS:
        if isinstance(flag.default, bool):
            group.add_argument(f"--{flag.name}", action="store_true", help=flag.help)
        else:
            group.add_argument(f"--{flag.name}", type=flag.type, default=flag.default, nargs=flag.nargs, help=flag.help)
    return group


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text  # a bare word (e.g. step_rules=1:10,0.1) stays a string


def parse_key_values(flag: str, items: Sequence[str] | str | None, problems: list[str]) -> dict[str, Any]:
    """``["weight_decay=0.01", "betas=0.9,0.99"]`` -> ``{"weight_decay": 0.01, "betas": (0.9, 0.99)}``.

    Values go through ``ast.literal_eval`` as in sd-scripts; a value that is not a Python literal is kept as a
    string. A single string (from a TOML file) is split like a shell line. Malformed items are added to ``problems``.
    """
    if items is None:
        return {}
    parsed: dict[str, Any] = {}
    for item in shlex.split(items) if isinstance(items, str) else items:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"{flag}: '{item}' is not key=value (e.g. weight_decay=0.01)")
        elif key in parsed:
            problems.append(f"{flag}: '{key}' is given twice")
        else:
            parsed[key] = _literal(text.strip())
    return parsed


def _step_value(flag: str, value: Any, problems: list[str]) -> int | float:
    """A warmup/decay value from the command line (already parsed) or a config file (int, float or str)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        problems.append(f"{flag}: {value!r} is not a step count, a ratio below 1 or a percentage")
        return 0
    if isinstance(value, str):
        try:
            return parse_step_count(value)
        except argparse.ArgumentTypeError as e:
            problems.append(f"{flag}: {e}")
            return 0
    if value < 0 or (isinstance(value, float) and value >= 1.0):
        problems.append(f"{flag}: {value!r} is not a whole number of steps or a ratio below 1")
        return 0
    return value


def _number(flag: str, value: Any, kind: type, problems: list[str]) -> Any:
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return kind(value) if value is not None and kind is float else value
    try:
        return kind(value)
    except (TypeError, ValueError):
        problems.append(f"--{flag}: {value!r} is not {'an integer' if kind is int else 'a number'}")
        return None


def _optimizer_name(raw: dict[str, Any], problems: list[str]) -> str:
    """``--optimizer_type`` with the legacy ``--use_8bit_adam`` / ``--use_lion_optimizer`` resolved."""
    name = (raw["optimizer_type"] or "").strip()
    legacy = [alias for flag, alias in (("use_8bit_adam", "AdamW8bit"), ("use_lion_optimizer", "Lion")) if raw[flag]]
    if len(legacy) > 1:
        problems.append("--use_8bit_adam and --use_lion_optimizer are both given; use one --optimizer_type")
    elif legacy and name and name.lower() != legacy[0].lower():
        flag = "--use_8bit_adam" if legacy[0] == "AdamW8bit" else "--use_lion_optimizer"
        problems.append(f"{flag} (= {legacy[0]}) conflicts with --optimizer_type {name}; keep one of them")
    return legacy[0] if legacy else name or "AdamW"


WHAT = "optimizer / LR scheduler settings"  # the header of their problems


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and LR-schedule settings, validated on construction (raises :class:`~library.cli.problems.ConfigError`).

    ``lr_warmup_steps`` / ``lr_decay_steps``: an int is a number of optimizer steps, a float in [0, 1] a fraction
    of the run. ``lr_scheduler`` is stored lower-case (``"adafactor:<lr>"`` becomes ``"adafactor"``).
    """

    optimizer_type: str = "AdamW"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    learning_rate: float = 2e-6
    max_grad_norm: float = 1.0
    lr_scheduler: str = "constant"
    lr_scheduler_type: str = ""
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    lr_warmup_steps: int | float = 0
    lr_decay_steps: int | float = 0
    lr_scheduler_num_cycles: int = 1
    lr_scheduler_power: float = 1.0
    lr_scheduler_timescale: int | None = None
    lr_scheduler_min_lr_ratio: float | None = None
    fused_backward_pass: bool = False
    unet_lr: float | None = None  # adapters: the UNet part's lr (--unet_lr; None = learning_rate)
    text_encoder_lr: tuple[float, ...] | None = None  # adapters: per text encoder (--text_encoder_lr)

    def __post_init__(self) -> None:
        name = (self.lr_scheduler or "constant").strip().lower()
        object.__setattr__(self, "lr_scheduler", "adafactor" if name.startswith("adafactor:") else name)
        problems = self.problems()
        if problems:
            raise ConfigError(problems, WHAT)

    @property
    def optimizer_spec(self) -> OptimizerSpec | None:
        """The registry entry for ``optimizer_type`` (None when it cannot be resolved)."""
        try:
            return resolve_optimizer(self.optimizer_type)[0]
        except ValueError:
            return None

    @property
    def is_schedule_free(self) -> bool:
        """True for schedule-free optimizers: the trainer must toggle ``set_train_mode`` around eval and saving."""
        spec = self.optimizer_spec
        return spec is not None and spec.kind == SCHEDULE_FREE

    @property
    def adafactor_relative_step(self) -> bool:
        """True when Adafactor computes its own lr (``relative_step``, default True as in sd-scripts)."""
        spec = self.optimizer_spec
        return (
            spec is not None
            and spec.kind == ADAFACTOR
            and resolve_optimizer_kwargs(spec, self.optimizer_kwargs)["relative_step"] is True
        )

    @property
    def has_warmup(self) -> bool:
        """True when ``lr_warmup_steps`` asks for any warmup."""
        return self.lr_warmup_steps not in (0, 0.0)

    def problems(self) -> list[str]:
        """Everything wrong with these settings (empty when they are usable)."""
        problems = _range_problems(self)
        try:
            spec, cls = resolve_optimizer(self.optimizer_type)
        except ValueError as e:
            problems.append(str(e))
            spec = None
        else:
            problems += optimizer_arg_problems(spec, cls, self.optimizer_kwargs)
        if self.fused_backward_pass and (spec is None or spec.kind != ADAFACTOR):
            problems.append("--fused_backward_pass only works with --optimizer_type Adafactor (as in sd-scripts)")
        if self.adafactor_relative_step and (self.lr_scheduler_type or self.lr_scheduler != "adafactor"):
            problems.append(
                "Adafactor with relative_step=True computes its own lr, so it needs --lr_scheduler adafactor and no "
                "--lr_scheduler_type; to drive it with a schedule, add relative_step=False to --optimizer_args"
            )
        return problems + scheduler_problems(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OptimConfig:
        """Read the flags added by :func:`add_optim_args` (or set from a config file) into a validated config.

        Missing attributes take sd-scripts' defaults. With Adafactor and relative_step=True the scheduler is forced
        to ``adafactor`` as in sd-scripts (logged). ``--fused_backward_pass`` also reads
        ``args.gradient_accumulation_steps`` (must be 1). Raises one :class:`~library.cli.problems.ConfigError` (a ``ValueError``)
        listing every problem.
        """
        raw = {flag.name: getattr(args, flag.name, flag.default) for flag in _FLAGS}
        problems: list[str] = []
        values = {
            "optimizer_type": _optimizer_name(raw, problems),
            "optimizer_kwargs": parse_key_values("--optimizer_args", raw["optimizer_args"], problems),
            "lr_scheduler_kwargs": parse_key_values("--lr_scheduler_args", raw["lr_scheduler_args"], problems),
            "lr_warmup_steps": _step_value("--lr_warmup_steps", raw["lr_warmup_steps"], problems),
            "lr_decay_steps": _step_value("--lr_decay_steps", raw["lr_decay_steps"], problems),
            "lr_scheduler": str(raw["lr_scheduler"] or "constant"),
            "lr_scheduler_type": str(raw["lr_scheduler_type"] or ""),
            "fused_backward_pass": bool(raw["fused_backward_pass"]),
            **_part_lrs(args, problems),
        }
        for name, kind in _NUMBERS.items():
            values[name] = _number(name, raw[name], kind, problems)
            if values[name] is None and raw[name] is not None:
                values[name] = next(f.default for f in _FLAGS if f.name == name)
        if values["fused_backward_pass"] and getattr(args, "gradient_accumulation_steps", 1) != 1:
            problems.append("--fused_backward_pass does not work with --gradient_accumulation_steps > 1")
        requested = values["lr_scheduler"]
        values["lr_scheduler"] = _forced_scheduler(values)
        try:
            cfg = cls(**values)
        except ConfigError as e:
            raise ConfigError(problems + e.problems, WHAT) from None
        if problems:
            raise ConfigError(problems, WHAT)
        _log_notes(cfg, requested)
        return cfg


def add_part_lr_args(parser: argparse.ArgumentParser) -> None:
    """Learning rates of an adapter's UNet and text-encoder parts (sd-scripts' train_network.py)."""
    g = parser.add_argument_group("adapter learning rates")
    g.add_argument("--unet_lr", type=float, default=None, help="UNet adapter lr (default: --learning_rate)")
    g.add_argument(
        "--text_encoder_lr",
        type=float,
        nargs="*",
        default=None,
        help="text-encoder adapter lr; one value, or one per text encoder (TE1 TE2 ...); 0 = do not train it",
    )


def _part_lrs(args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    unet_lr, te_lr = getattr(args, "unet_lr", None), getattr(args, "text_encoder_lr", None)
    for flag, value in [("--unet_lr", unet_lr)] + [("--text_encoder_lr", v) for v in te_lr or []]:
        problems += [p for p in [lr_problem(flag, value)] if p]
    return {"unet_lr": unet_lr, "text_encoder_lr": tuple(te_lr) if te_lr else None}


_NUMBERS = {
    "learning_rate": float,
    "max_grad_norm": float,
    "lr_scheduler_num_cycles": int,
    "lr_scheduler_power": float,
    "lr_scheduler_timescale": int,
    "lr_scheduler_min_lr_ratio": float,
}


def _forced_scheduler(values: dict[str, Any]) -> str:
    """sd-scripts replaces the scheduler with ``adafactor`` for Adafactor with relative_step=True."""
    try:
        spec = resolve_optimizer(values["optimizer_type"])[0]
    except ValueError:
        return values["lr_scheduler"]
    if spec.kind != ADAFACTOR or values["lr_scheduler_type"]:
        return values["lr_scheduler"]
    relative = resolve_optimizer_kwargs(spec, values["optimizer_kwargs"]).get("relative_step")
    return "adafactor" if relative is True else values["lr_scheduler"]


FLOAT32_MAX = 3.4028234663852886e38


def lr_problem(flag: str, value: float | None) -> str | None:
    """A learning rate must be a number >= 0 that float32 holds (optimizers keep it next to float32 weights):
    ``nan``, ``inf`` and values above ~3.4e38 are refused."""
    if value is None or (math.isfinite(value) and 0 <= value <= FLOAT32_MAX):
        return None
    if not math.isfinite(value) or value > FLOAT32_MAX:
        return (
            f"{flag}: {value} is not a usable learning rate (it must be a finite number that fits in "
            "float32, at most 3.4e38); e.g. 1e-4"
        )
    return f"{flag}: {value} must be >= 0"


def _range_problems(cfg: OptimConfig) -> list[str]:
    checks = [
        ("--learning_rate", cfg.learning_rate, cfg.learning_rate is not None, "given"),
        ("--max_grad_norm", cfg.max_grad_norm, cfg.max_grad_norm >= 0, ">= 0 (0 disables clipping)"),
        ("--lr_scheduler_num_cycles", cfg.lr_scheduler_num_cycles, cfg.lr_scheduler_num_cycles >= 1, ">= 1"),
        ("--lr_scheduler_power", cfg.lr_scheduler_power, cfg.lr_scheduler_power > 0, "> 0"),
        ("--lr_scheduler_timescale", cfg.lr_scheduler_timescale, (cfg.lr_scheduler_timescale or 1) >= 1, ">= 1"),
        (
            "--lr_scheduler_min_lr_ratio",
            cfg.lr_scheduler_min_lr_ratio,
            0 <= (cfg.lr_scheduler_min_lr_ratio or 0) <= 1,
            "between 0 and 1",
        ),
    ]
    for flag, value in (("--lr_warmup_steps", cfg.lr_warmup_steps), ("--lr_decay_steps", cfg.lr_decay_steps)):
        ok = value >= 0 and (not isinstance(value, float) or value <= 1)
        checks.append((flag, value, ok, "a whole number of steps >= 0 or a ratio in [0, 1]"))
    problems = [f"{flag}: {value} must be {rule}" for flag, value, ok, rule in checks if not ok]
    return [p for p in [lr_problem("--learning_rate", cfg.learning_rate)] if p] + problems


def _log_notes(cfg: OptimConfig, requested_scheduler: str) -> None:
    """The advice sd-scripts logs for these settings, once, at configuration time."""
    kwargs = cfg.optimizer_kwargs
    if cfg.optimizer_spec is not None and cfg.optimizer_spec.note:
        logger.warning(f"--optimizer_type {cfg.optimizer_type}: {cfg.optimizer_spec.note}")
    if cfg.adafactor_relative_step:
        if requested_scheduler.split(":")[0].lower() != "adafactor":
            logger.info(f"Adafactor relative_step=True: --lr_scheduler {requested_scheduler} replaced by adafactor")
        if kwargs.get("relative_step") is False and kwargs.get("warmup_init"):
            logger.info("Adafactor: warmup_init=True needs relative_step=True; using relative_step=True")
        if cfg.learning_rate:
            logger.info(f"Adafactor relative_step=True: --learning_rate {cfg.learning_rate} is only logged as lr")
    elif cfg.optimizer_spec is not None and cfg.optimizer_spec.kind == ADAFACTOR:
        if cfg.max_grad_norm != 0:
            logger.warning("Adafactor: --max_grad_norm clips gradients too; consider --max_grad_norm 0")
        if cfg.lr_scheduler != "constant_with_warmup":
            logger.warning("Adafactor with relative_step=False: constant_with_warmup is the usual scheduler")
        if kwargs.get("clip_threshold", 1.0) != 1.0:
            logger.warning("Adafactor: clip_threshold=1.0 is the usual value")
    if cfg.is_schedule_free:
        ignored = [f"--lr_scheduler {cfg.lr_scheduler}"] if cfg.lr_scheduler != "constant" else []
        ignored += [f"--lr_scheduler_type {cfg.lr_scheduler_type}"] if cfg.lr_scheduler_type else []
        ignored += [f"--lr_warmup_steps {cfg.lr_warmup_steps}"] if cfg.has_warmup else []
        if ignored:
            logger.warning(
                f"{cfg.optimizer_type} is schedule-free: {', '.join(ignored)} ignored (as in sd-scripts); "
                "for warmup use --optimizer_args warmup_steps=N"
            )
