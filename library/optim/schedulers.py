"""LR-scheduler registry: sd-scripts' ``--lr_scheduler`` names, REX, and any class through ``--lr_scheduler_type``.

The curves come from the libraries sd-scripts uses (``transformers.optimization`` for the named schedules, diffusers
for ``piecewise_constant``, transformers' ``AdafactorSchedule``); REX is ours. Every scheduler is a ``LambdaLR`` (or
the user's class), so ``state_dict()`` / ``load_state_dict()`` resume it exactly.

Differences from sd-scripts (``get_scheduler_fix``), all deliberate:

* ``cosine_warmup_with_min_lr`` works (sd-scripts passes it ``num_decay_steps`` and crashes); ``reduce_lr_on_plateau``
  is refused up front with the reason (it needs a metric at every step, which the training loop does not pass).
* Integer step counts (``--lr_warmup_steps``, ``--lr_decay_steps``, ``--lr_scheduler_timescale``, the boundaries in
  ``step_rules``) are multiplied by ``num_processes`` like the total, so "100 warmup steps" means 100 optimizer steps
  on any number of GPUs. sd-scripts multiplies only the total, so its integer warmup shrinks with more GPUs.
* Scheduler names are case-insensitive.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from library.optim.optimizers import did_you_mean, value_type_problem


class ScheduleSettings(Protocol):
    """What the scheduler code reads of the settings (:class:`library.optim.config.OptimConfig` has it)."""

    @property
    def learning_rate(self) -> float: ...
    @property
    def lr_scheduler(self) -> str: ...
    @property
    def lr_scheduler_type(self) -> str: ...
    @property
    def lr_scheduler_kwargs(self) -> dict[str, Any]: ...
    @property
    def lr_warmup_steps(self) -> int | float: ...
    @property
    def lr_decay_steps(self) -> int | float: ...
    @property
    def lr_scheduler_num_cycles(self) -> int: ...
    @property
    def lr_scheduler_power(self) -> float: ...
    @property
    def lr_scheduler_timescale(self) -> int | None: ...
    @property
    def lr_scheduler_min_lr_ratio(self) -> float | None: ...
    @property
    def has_warmup(self) -> bool: ...
    @property
    def is_schedule_free(self) -> bool: ...
    @property
    def adafactor_relative_step(self) -> bool: ...


class _LazyModule:
    """A module imported on first attribute access (transformers.optimization pulls in much of transformers)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


hf_optim = _LazyModule("transformers.optimization")


@dataclass(frozen=True)
class ScheduleSteps:
    """Step counts in scheduler steps (optimizer steps × number of processes)."""

    total: int
    warmup: int
    decay: int
    timescale: int | None
    num_processes: int


def rex_lambda(
    num_warmup_steps: int, num_training_steps: int, d: float = 0.9, min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """REX multiplier: Chen, Wolfe & Kyrillidis 2021, "REX: Revisiting Budgeted Training with an Improved Schedule".

    After a linear warmup over ``W`` steps, with progress ``z = (t - W) / (T - W)``::

        rex(z) = (1 - z) / ((1 - d) + d * (1 - z)),    factor = min_lr_ratio + (1 - min_lr_ratio) * rex(z)

    ``d = 0.5`` is the paper's profile; ``d = 0.9`` (default) is OneTrainer's, the REX its users know: the lr stays
    high longer and drops faster at the end. ``d = 0`` is linear decay. The factor is ``min_lr_ratio`` from ``T`` on.
    """

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        z = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        if z >= 1.0:
            return min_lr_ratio
        rex = (1.0 - z) / ((1.0 - d) + d * (1.0 - z))
        return min_lr_ratio + (1.0 - min_lr_ratio) * rex

    return factor


def get_rex_schedule(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    d: float = 0.9,
    min_lr_ratio: float = 0.0,
    last_epoch: int = -1,
) -> LambdaLR:
    """A ``LambdaLR`` following :func:`rex_lambda` (each param group scaled from its own lr)."""
    return LambdaLR(optimizer, rex_lambda(num_warmup_steps, num_training_steps, d, min_lr_ratio), last_epoch)


def parse_step_rules(rules: str) -> tuple[list[tuple[float, int]], float]:
    """diffusers' ``step_rules`` ("1:10,0.1:20,0.01": ×1 before step 10, ×0.1 before 20, then ×0.01)."""
    *pairs, last = str(rules).split(",")
    parsed = []
    for pair in pairs:
        multiplier, sep, step = pair.partition(":")
        if not sep:
            raise ValueError(f"'{pair}' is not 'multiplier:step'")
        parsed.append((float(multiplier), int(step)))
    return parsed, float(last)


def get_piecewise_constant_schedule(
    optimizer: torch.optim.Optimizer, step_rules: str, last_epoch: int = -1
) -> LambdaLR:
    """diffusers' piecewise-constant schedule (diffusers is imported only when this schedule is used)."""
    from diffusers.optimization import get_piecewise_constant_schedule as build

    return build(optimizer, step_rules, last_epoch)


def _scaled_step_rules(rules: str, factor: int) -> str:
    pairs, last = parse_step_rules(rules)
    return ",".join([f"{m}:{s * factor}" for m, s in pairs] + [str(last)])


# --- builders: (optimizer, cfg, steps, user kwargs from --lr_scheduler_args) -> scheduler --------------------------
Builder = Callable[[torch.optim.Optimizer, ScheduleSettings, ScheduleSteps, dict[str, Any]], LRScheduler]


def get_constant_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0, last_epoch: int = -1
) -> LambdaLR:
    """The lr rises linearly from 0 over ``num_warmup_steps`` scheduler steps, then stays (factor 1; no warmup: the
    constant schedule). The same factors as transformers' ``get_constant_schedule[_with_warmup]`` (tested), without
    importing transformers.optimization: its trainer utilities pull in peft and bitsandbytes, and reading the flags
    (where a bad one is reported) should not wait for that (~2 s instead of ~7 s of CPU to the error message)."""

    def factor(step: int) -> float:
        return step / max(1.0, num_warmup_steps) if step < num_warmup_steps else 1.0

    return LambdaLR(optimizer, factor, last_epoch)


def get_constant_schedule(optimizer: torch.optim.Optimizer, last_epoch: int = -1) -> LambdaLR:
    """Factor 1 at every step (transformers' ``get_constant_schedule``)."""
    return get_constant_schedule_with_warmup(optimizer, 0, last_epoch)


def _constant(opt, cfg, s, kw):
    return get_constant_schedule(opt, **kw)


def _constant_with_warmup(opt, cfg, s, kw):
    return get_constant_schedule_with_warmup(opt, s.warmup, **kw)


def _linear(opt, cfg, s, kw):
    return hf_optim.get_linear_schedule_with_warmup(opt, s.warmup, s.total, **kw)


def _cosine(opt, cfg, s, kw):
    return hf_optim.get_cosine_schedule_with_warmup(opt, s.warmup, s.total, **kw)


def _cosine_with_restarts(opt, cfg, s, kw):
    return hf_optim.get_cosine_with_hard_restarts_schedule_with_warmup(
        opt, s.warmup, s.total, num_cycles=cfg.lr_scheduler_num_cycles, **kw
    )


def _polynomial(opt, cfg, s, kw):
    return hf_optim.get_polynomial_decay_schedule_with_warmup(
        opt, s.warmup, s.total, power=cfg.lr_scheduler_power, **kw
    )


def _inverse_sqrt(opt, cfg, s, kw):
    return hf_optim.get_inverse_sqrt_schedule(opt, s.warmup, timescale=s.timescale, **kw)


def _min_lr_kwargs(cfg: ScheduleSettings, kw: dict[str, Any]) -> dict[str, Any]:
    # sd-scripts passes num_cycles / 2: the default 1 gives the plain half cosine down to the floor.
    ratio = {} if cfg.lr_scheduler_min_lr_ratio is None else {"min_lr_rate": cfg.lr_scheduler_min_lr_ratio}
    return {"num_cycles": cfg.lr_scheduler_num_cycles / 2, **ratio, **kw}


def _cosine_with_min_lr(opt, cfg, s, kw):
    return hf_optim.get_cosine_with_min_lr_schedule_with_warmup(opt, s.warmup, s.total, **_min_lr_kwargs(cfg, kw))


def _cosine_warmup_with_min_lr(opt, cfg, s, kw):
    fn = hf_optim.get_cosine_with_min_lr_schedule_with_warmup_lr_rate
    return fn(opt, s.warmup, s.total, **_min_lr_kwargs(cfg, kw))


def _warmup_stable_decay(opt, cfg, s, kw):
    return hf_optim.get_wsd_schedule(
        opt,
        s.warmup,
        s.decay,
        num_stable_steps=s.total - s.warmup - s.decay,
        num_cycles=cfg.lr_scheduler_num_cycles / 2,
        min_lr_ratio=cfg.lr_scheduler_min_lr_ratio or 0.0,
        **kw,
    )


def _piecewise_constant(opt, cfg, s, kw):
    rules = _scaled_step_rules(kw.pop("step_rules"), s.num_processes)
    return get_piecewise_constant_schedule(opt, rules, **kw)


def _adafactor(opt, cfg, s, kw):
    return hf_optim.AdafactorSchedule(opt, initial_lr=cfg.learning_rate or 0.0)


def _rex(opt, cfg, s, kw):
    return get_rex_schedule(opt, s.warmup, s.total, min_lr_ratio=cfg.lr_scheduler_min_lr_ratio or 0.0, **kw)


@dataclass(frozen=True)
class SchedulerSpec:
    """One ``--lr_scheduler`` name: its builder and the library function that bounds ``--lr_scheduler_args``."""

    build: Builder
    fn: str | Callable[..., Any]  # the function (a name: in transformers.optimization) whose keyword arguments
    # not in `managed` may come from --lr_scheduler_args
    managed: Mapping[str, str]  # argument -> the flag that sets it
    warmup: bool = True  # False: a non-zero --lr_warmup_steps is an error


_W = {"num_warmup_steps": "--lr_warmup_steps"}
_WT = {**_W, "num_training_steps": "--max_train_steps"}
_MIN = {**_WT, "num_cycles": "--lr_scheduler_num_cycles", "min_lr_rate": "--lr_scheduler_min_lr_ratio"}
_WSD = {"num_decay_steps": "--lr_decay_steps", "num_stable_steps": "--max_train_steps and the warmup/decay steps"}

SCHEDULERS: dict[str, SchedulerSpec] = {
    "constant": SchedulerSpec(_constant, get_constant_schedule, {}, warmup=False),
    "constant_with_warmup": SchedulerSpec(_constant_with_warmup, get_constant_schedule_with_warmup, _W),
    "linear": SchedulerSpec(_linear, "get_linear_schedule_with_warmup", _WT),
    "cosine": SchedulerSpec(_cosine, "get_cosine_schedule_with_warmup", _WT),
    "cosine_with_restarts": SchedulerSpec(
        _cosine_with_restarts,
        "get_cosine_with_hard_restarts_schedule_with_warmup",
        {**_WT, "num_cycles": "--lr_scheduler_num_cycles"},
    ),
    "polynomial": SchedulerSpec(
        _polynomial, "get_polynomial_decay_schedule_with_warmup", {**_WT, "power": "--lr_scheduler_power"}
    ),
    "inverse_sqrt": SchedulerSpec(
        _inverse_sqrt, "get_inverse_sqrt_schedule", {**_W, "timescale": "--lr_scheduler_timescale"}
    ),
    "cosine_with_min_lr": SchedulerSpec(_cosine_with_min_lr, "get_cosine_with_min_lr_schedule_with_warmup", _MIN),
    "cosine_warmup_with_min_lr": SchedulerSpec(
        _cosine_warmup_with_min_lr, "get_cosine_with_min_lr_schedule_with_warmup_lr_rate", _MIN
    ),
    "warmup_stable_decay": SchedulerSpec(
        _warmup_stable_decay,
        "get_wsd_schedule",
        {**_WT, **_WSD, "num_cycles": "--lr_scheduler_num_cycles", "min_lr_ratio": "--lr_scheduler_min_lr_ratio"},
    ),
    "piecewise_constant": SchedulerSpec(_piecewise_constant, get_piecewise_constant_schedule, {}, warmup=False),
    "adafactor": SchedulerSpec(_adafactor, "AdafactorSchedule", {"initial_lr": "--learning_rate"}, False),
    "rex": SchedulerSpec(_rex, get_rex_schedule, {**_WT, "min_lr_ratio": "--lr_scheduler_min_lr_ratio"}),
}

_UNSUPPORTED = {
    "reduce_lr_on_plateau": "it lowers the lr when a metric stops improving and needs that metric at every "
    "scheduler step, which the training loop does not pass (it crashes in sd-scripts too); use cosine, "
    "cosine_with_min_lr or rex",
}
_UNSUPPORTED_CLASSES = {"reducelronplateau": _UNSUPPORTED["reduce_lr_on_plateau"]}


def scheduler_names() -> list[str]:
    """Every accepted ``--lr_scheduler`` value."""
    return list(SCHEDULERS)


def resolve_scheduler_class(path: str) -> type:
    """The class for ``--lr_scheduler_type``: ``module.Class``, or a ``torch.optim.lr_scheduler`` class name."""
    module_name, _, attr = path.strip().rpartition(".")
    try:
        module = importlib.import_module(module_name or "torch.optim.lr_scheduler")
    except ImportError as e:
        raise ValueError(f"--lr_scheduler_type {path}: cannot import module '{module_name}' ({e})") from e
    classes = {n.lower(): n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")}
    found = getattr(module, attr, None) if module_name else getattr(module, classes.get(attr.lower(), ""), None)
    if not isinstance(found, type):
        raise ValueError(
            f"--lr_scheduler_type {path}: '{module.__name__}' has no class '{attr}'"
            f"{did_you_mean(attr, classes.values())}"
        )
    if found.__name__.lower() in _UNSUPPORTED_CLASSES:
        raise ValueError(f"--lr_scheduler_type {path}: {_UNSUPPORTED_CLASSES[found.__name__.lower()]}")
    return found


def _kwarg_problems(where: str, fn: Callable[..., Any], managed: Mapping[str, str], kwargs: Mapping) -> list[str]:
    params = list(inspect.signature(fn).parameters.values())[1:]  # first: the optimizer
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    by_name = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    accepted = [n for n in by_name if n not in managed]
    problems = []
    for key, value in kwargs.items():
        if key in managed:
            problems.append(f"{where}: '{key}' is set by {managed[key]}; remove it from --lr_scheduler_args")
        elif key not in by_name:
            hint = f"Accepted: {', '.join(accepted)}" if accepted else "It takes no arguments"
            problems.append(f"{where} has no argument '{key}'{did_you_mean(key, accepted)}. {hint}")
        elif problem := value_type_problem(key, value, by_name[key].default):
            problems.append(f"{where}: {problem}")
    missing = [n for n in accepted if by_name[n].default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        problems.append(f"{where} needs --lr_scheduler_args {' '.join(f'{m}=...' for m in missing)}")
    return problems


def _custom_problems(cfg: ScheduleSettings) -> list[str]:
    try:
        cls = resolve_scheduler_class(cfg.lr_scheduler_type)
    except ValueError as e:
        return [str(e)]
    problems = _kwarg_problems(f"--lr_scheduler_type {cfg.lr_scheduler_type}", cls, {}, cfg.lr_scheduler_kwargs)
    if cfg.has_warmup:
        problems.append(
            f"--lr_scheduler_type {cfg.lr_scheduler_type} does not take --lr_warmup_steps (as in sd-scripts); "
            "set it to 0, or use a named --lr_scheduler with warmup"
        )
    return problems


def _adafactor_check(cfg: ScheduleSettings) -> list[str]:
    if cfg.adafactor_relative_step:
        return []
    return [
        "--lr_scheduler adafactor only works with --optimizer_type Adafactor and relative_step=True (it reports "
        "Adafactor's own lr); choose another scheduler, e.g. constant_with_warmup"
    ]


def _min_lr_check(cfg: ScheduleSettings) -> list[str]:
    has_min_lr = "min_lr" in cfg.lr_scheduler_kwargs
    if (cfg.lr_scheduler_min_lr_ratio is not None) == has_min_lr:
        return [
            f"--lr_scheduler {cfg.lr_scheduler} needs exactly one floor: --lr_scheduler_min_lr_ratio (e.g. 0.1) "
            "or --lr_scheduler_args min_lr=..."
        ]
    return []


def _step_rules_check(cfg: ScheduleSettings) -> list[str]:
    rules = cfg.lr_scheduler_kwargs.get("step_rules")
    if rules is None:  # reported as a missing argument
        return []
    try:
        parse_step_rules(rules)
    except ValueError as e:
        return [
            f"--lr_scheduler piecewise_constant: step_rules={rules!r} is not valid ({e}); write e.g. "
            "--lr_scheduler_args step_rules=1:100,0.1:200,0.01 (×1 before step 100, ×0.1 before 200, then ×0.01)"
        ]
    return []


def _polynomial_check(cfg: ScheduleSettings) -> list[str]:
    lr_end = cfg.lr_scheduler_kwargs.get("lr_end", 1e-7)
    if cfg.learning_rate is not None and not cfg.learning_rate > lr_end:
        return [f"--lr_scheduler polynomial decays to lr_end={lr_end}, which must be below --learning_rate"]
    return []


def _rex_check(cfg: ScheduleSettings) -> list[str]:
    d = cfg.lr_scheduler_kwargs.get("d", 0.9)
    if isinstance(d, (int, float)) and not 0.0 <= d < 1.0:
        return [f"--lr_scheduler rex: d={d} must be in [0, 1) (0.9 as OneTrainer, 0.5 as the REX paper)"]
    return []


_CHECKS: dict[str, Callable[[ScheduleSettings], list[str]]] = {
    "adafactor": _adafactor_check,
    "cosine_with_min_lr": _min_lr_check,
    "cosine_warmup_with_min_lr": _min_lr_check,
    "piecewise_constant": _step_rules_check,
    "polynomial": _polynomial_check,
    "rex": _rex_check,
}


def scheduler_problems(cfg: ScheduleSettings) -> list[str]:
    """Everything wrong with the scheduler settings that can be known before the run length is."""
    if cfg.is_schedule_free:
        return []
    if cfg.lr_scheduler_type:
        return _custom_problems(cfg)
    name = cfg.lr_scheduler
    if name in _UNSUPPORTED:
        return [f"--lr_scheduler {name} is not supported: {_UNSUPPORTED[name]}"]
    spec = SCHEDULERS.get(name)
    if spec is None:
        return [
            f"--lr_scheduler {name!r}: unknown scheduler{did_you_mean(name, SCHEDULERS)}. Accepted: "
            f"{', '.join(SCHEDULERS)}, or a scheduler class with --lr_scheduler_type module.Class"
        ]
    problems = []
    if not spec.warmup and cfg.has_warmup:
        fix = {
            "constant": "use constant_with_warmup",
            "adafactor": "Adafactor's relative step warms up with --optimizer_args warmup_init=True; or add "
            "relative_step=False and use constant_with_warmup",
        }.get(name, "set --lr_warmup_steps 0")
        problems.append(f"--lr_scheduler {name} does not use --lr_warmup_steps (as in sd-scripts); {fix}")
    if cfg.lr_scheduler_kwargs or not isinstance(spec.fn, str):  # transformers' functions need no other argument
        fn = getattr(hf_optim, spec.fn) if isinstance(spec.fn, str) else spec.fn
        problems += _kwarg_problems(f"--lr_scheduler {name}", fn, spec.managed, cfg.lr_scheduler_kwargs)
    return problems + _CHECKS.get(name, lambda _: [])(cfg)


def schedule_steps(cfg: ScheduleSettings, num_training_steps: int, num_processes: int = 1) -> ScheduleSteps:
    """Resolve warmup / decay (steps or ratios) against the run length, in scheduler steps."""
    if num_training_steps < 1 or num_processes < 1:
        raise ValueError(f"make_scheduler: num_training_steps={num_training_steps} and num_processes={num_processes}")
    total = num_training_steps * num_processes

    def count(value: int | float) -> int:
        return int(value * total) if isinstance(value, float) else int(value) * num_processes

    warmup, decay = count(cfg.lr_warmup_steps), count(cfg.lr_decay_steps)
    if warmup + decay > total:
        raise ValueError(
            f"--lr_warmup_steps {cfg.lr_warmup_steps} and --lr_decay_steps {cfg.lr_decay_steps} together are "
            f"longer than the run ({num_training_steps} optimizer steps); shorten them or give ratios like 0.05"
        )
    timescale = None if cfg.lr_scheduler_timescale is None else cfg.lr_scheduler_timescale * num_processes
    return ScheduleSteps(total, warmup, decay, timescale, num_processes)


def make_scheduler(
    cfg: ScheduleSettings, optimizer: torch.optim.Optimizer, num_training_steps: int, num_processes: int = 1
) -> LRScheduler:
    """Build the LR scheduler for ``optimizer`` (the bare optimizer, before ``accelerator.prepare``).

    Step counts: accelerate's prepared scheduler steps the wrapped one ``num_processes`` times per optimizer step
    (unless ``split_batches``), so, as sd-scripts does, the schedule runs over ``num_training_steps ×
    num_processes`` scheduler steps, and warmup / decay ratios are fractions of that. Pass ``max_train_steps`` and
    ``accelerator.num_processes`` when the scheduler goes through ``accelerator.prepare``; pass ``num_processes=1``
    when the loop steps it itself once per optimizer step. Integer warmup / decay / timescale / step_rules are
    scaled the same way (sd-scripts does not scale them; see the module docstring). A ``--lr_scheduler_type`` class
    gets ``--lr_scheduler_args`` unchanged.

    Schedule-free optimizers get a constant schedule (sd-scripts: a dummy), kept for logging and resume.
    Raises ``ValueError`` when the warmup and decay do not fit in the run.
    """
    if cfg.is_schedule_free:
        return hf_optim.get_constant_schedule(optimizer)
    steps = schedule_steps(cfg, num_training_steps, num_processes)
    kwargs = dict(cfg.lr_scheduler_kwargs)
    if cfg.lr_scheduler_type:
        return resolve_scheduler_class(cfg.lr_scheduler_type)(optimizer, **kwargs)
    return SCHEDULERS[cfg.lr_scheduler].build(optimizer, cfg, steps, kwargs)


def step_without_optimizer(scheduler: Any) -> None:
    """Step ``scheduler`` at an optimizer step that moved nothing (no trained tensor got a gradient), so the
    learning rates keep following the step count. torch's warning that the scheduler stepped before the optimizer
    is meant for a misordered loop; here the order is deliberate, so it is not shown."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()
