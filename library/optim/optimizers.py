"""Optimizer registry: every sd-scripts ``--optimizer_type`` name, CAME, schedule-free, torch.optim, module.Class.

Each registry entry says where the class lives (imported only when it is used, so a missing optional package only
matters to the user who asks for it) and what sd-scripts does around it (train_util ``get_optimizer``):

* SGD variants: ``nesterov=True`` always, ``momentum=0.9`` unless given (bitsandbytes' SGD8bit ignores nesterov:
  SGDNesterov8bit is heavy-ball momentum, in sd-scripts too; a warning says so).
* D-Adaptation / Prodigy: warn when ``lr <= 0.1`` (they want ~1.0) and when param groups have different lrs.
  Prodigy >= 1.1 refuses different non-zero group lrs at its first step, so that is an error here, up front.
* Adafactor: ``relative_step=True`` unless given; then Adafactor computes its own lr, group lrs are dropped and the
  ``adafactor`` scheduler reports it (see ``config.py``, which forces that scheduler).
* Schedule-free: the trainer must call :func:`set_train_mode` around sampling, validation and saving.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from library.cli.problems import did_you_mean as suggest

logger = logging.getLogger(__name__)

PLAIN, ADAPTIVE, ADAFACTOR, SCHEDULE_FREE = "plain", "adaptive", "adafactor", "schedule_free"


class OptimizerSettings(Protocol):
    """What the optimizer builders read of the settings (:class:`library.optim.config.OptimConfig` has it)."""

    @property
    def optimizer_type(self) -> str: ...
    @property
    def optimizer_kwargs(self) -> dict[str, Any]: ...
    @property
    def learning_rate(self) -> float: ...


@dataclass(frozen=True)
class OptimizerSpec:
    """One way to build an optimizer: the class's location and sd-scripts' behaviour around it."""

    name: str  # canonical spelling, as logged
    module: str  # module holding the class (imported lazily)
    attr: str  # class name in that module
    package: str  # pip package to suggest when the import fails
    kind: str = PLAIN  # PLAIN, ADAPTIVE (D-Adaptation / Prodigy), ADAFACTOR or SCHEDULE_FREE
    defaults: Mapping[str, Any] = field(default_factory=dict)  # added when --optimizer_args leaves them out
    forced: Mapping[str, Any] = field(default_factory=dict)  # always passed; --optimizer_args may not set them
    note: str = ""  # logged as a warning when the optimizer is chosen


def _bnb(name: str, attr: str | None = None, **kw: Any) -> OptimizerSpec:
    return OptimizerSpec(name, "bitsandbytes.optim", attr or name, "bitsandbytes", **kw)


def _dadapt(name: str, attr: str | None = None, module: str = "dadaptation") -> OptimizerSpec:
    return OptimizerSpec(name, module, attr or name, "dadaptation", kind=ADAPTIVE)


def _schedule_free(name: str) -> OptimizerSpec:
    return OptimizerSpec(name, "schedulefree", name, "schedulefree", kind=SCHEDULE_FREE)


_NESTEROV = {"defaults": {"momentum": 0.9}, "forced": {"nesterov": True}}

OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name.lower(): spec
    for spec in (
        OptimizerSpec("AdamW", "torch.optim", "AdamW", "torch"),
        OptimizerSpec("SGDNesterov", "torch.optim", "SGD", "torch", **_NESTEROV),
        _bnb("AdamW8bit"),
        _bnb("PagedAdamW8bit"),
        _bnb("PagedAdamW"),
        _bnb("PagedAdamW32bit"),
        _bnb(
            "SGDNesterov8bit",
            "SGD8bit",
            note="bitsandbytes' SGD8bit accepts nesterov=True but ignores it, so SGDNesterov8bit is plain momentum "
            "SGD (as in sd-scripts); use SGDNesterov for Nesterov momentum",
            **_NESTEROV,
        ),
        _bnb("Lion8bit"),
        _bnb("PagedLion8bit"),
        _bnb("AdEMAMix8bit"),
        _bnb("PagedAdEMAMix8bit"),
        OptimizerSpec("Lion", "lion_pytorch", "Lion", "lion-pytorch"),
        _dadapt("DAdaptation", "DAdaptAdamPreprint", "dadaptation.experimental"),
        _dadapt("DAdaptAdamPreprint", module="dadaptation.experimental"),
        _dadapt("DAdaptAdaGrad"),
        _dadapt("DAdaptAdam"),
        _dadapt("DAdaptAdan"),
        _dadapt("DAdaptAdanIP", module="dadaptation.experimental"),
        _dadapt("DAdaptLion"),
        _dadapt("DAdaptSGD"),
        OptimizerSpec("Prodigy", "prodigyopt", "Prodigy", "prodigyopt", kind=ADAPTIVE),
        OptimizerSpec(
            "Adafactor", "transformers.optimization", "Adafactor", "transformers", ADAFACTOR, {"relative_step": True}
        ),
        OptimizerSpec("CAME", "came_pytorch", "CAME", "came-pytorch"),
        _schedule_free("AdamWScheduleFree"),
        _schedule_free("RAdamScheduleFree"),
        _schedule_free("SGDScheduleFree"),
    )
}

# torch.optim classes our training loop cannot drive, with the reason.
_UNSUPPORTED_TORCH = {
    "lbfgs": "needs a closure that re-evaluates the loss at every step, which the training loop does not provide",
    "sparseadam": "only works with sparse gradients; the adapters and models here produce dense gradients",
}


def _torch_optimizers() -> dict[str, str]:
    """Lower-case name -> class name of every optimizer class in ``torch.optim``."""
    found = {}
    for attr in dir(torch.optim):
        obj = getattr(torch.optim, attr)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            found[attr.lower()] = attr
    return found


def known_optimizer_names() -> list[str]:
    """Every bare ``--optimizer_type`` name we accept (registry first, then ``torch.optim`` classes)."""
    torch_names = [n for k, n in _torch_optimizers().items() if k not in OPTIMIZERS and k not in _UNSUPPORTED_TORCH]
    return [spec.name for spec in OPTIMIZERS.values()] + sorted(torch_names)


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the up to three closest candidates (case-insensitive), or ``""``."""
    return suggest(word, candidates, form=" ({})", n=3, ignore_case=True)


def resolve_optimizer(optimizer_type: str) -> tuple[OptimizerSpec, type]:
    """Registry entry and class for an ``--optimizer_type`` value.

    Lookup order (as sd-scripts): a registry name (case-insensitive); a ``module.Class`` path (case-sensitive);
    a ``torch.optim`` class (case-insensitive here, a superset of sd-scripts). Raises ``ValueError`` naming the flag,
    the problem and the fix (unknown name with "did you mean", missing package with its pip name).
    """
    name = optimizer_type.strip()
    spec = OPTIMIZERS.get(name.lower())
    if spec is None and "." in name:
        module, _, attr = name.rpartition(".")
        kind = SCHEDULE_FREE if name.lower().endswith("schedulefree") else PLAIN
        spec = OptimizerSpec(name, module, attr, module.split(".")[0], kind=kind)
    if spec is None:
        torch_name = _torch_optimizers().get(name.lower())
        if torch_name is None or name.lower() in _UNSUPPORTED_TORCH:
            reason = _UNSUPPORTED_TORCH.get(name.lower())
            detail = f"torch.optim.{torch_name} {reason}" if reason else "unknown optimizer"
            raise ValueError(
                f"--optimizer_type {optimizer_type!r}: {detail}{did_you_mean(name, known_optimizer_names())}. "
                f"Accepted: {', '.join(known_optimizer_names())}, or any optimizer class as 'module.Class' "
                "(e.g. bitsandbytes.optim.AdEMAMix8bit)."
            )
        spec = OptimizerSpec(torch_name, "torch.optim", torch_name, "torch")
    return spec, _load_class(spec, optimizer_type)


# Optimizers that divide by a running root mean square (Adam-like) and keep it in the parameters' dtype. Under
# --full_fp16 that state is float16: eps 1e-8 and squared gradients below ~6e-8 round to 0, so torch's AdamW turns a
# zero gradient into 0/0 = NaN on its first step (seen on an H200 at step 2, as sd-scripts' users report), and
# where the state survives, a history that underflowed makes later updates too large. bitsandbytes' optimizers
# and Adafactor compute in float32; SGD and Lion divide by nothing.
_FP16_STATE_UNSAFE = {
    "adam", "adamw", "nadam", "radam", "adamax", "adagrad", "adadelta", "rmsprop", "prodigy", "came",
    "dadaptadampreprint", "dadaptadagrad", "dadaptadam", "dadaptadan", "dadaptadanip",
    "adamwschedulefree", "radamschedulefree",
}  # fmt: skip


def full_fp16_problem(optimizer_type: str) -> str | None:
    """Why ``--optimizer_type`` cannot train the float16 weights of ``--full_fp16``, or None (also when unknown)."""
    try:
        spec, cls = resolve_optimizer(optimizer_type)
    except ValueError:
        return None  # the optimizer's own check reports it
    if spec.package == "bitsandbytes" or cls.__name__.lower() not in _FP16_STATE_UNSAFE:
        return None
    return (
        f"--full_fp16 with --optimizer_type {optimizer_type}: {cls.__name__} keeps its moment estimates in the "
        "weights' dtype, float16 here, where its eps and small squared gradients round to 0; the first update "
        "divides 0 by 0 and the loss is NaN from step 2 (sd-scripts fails the same way). Use an optimizer that "
        "keeps float32 state or divides by nothing: AdamW8bit (the usual pairing) or another bitsandbytes "
        "optimizer, Adafactor, Lion or SGDNesterov; or --mixed_precision bf16 --full_bf16; or drop --full_fp16 "
        "(fp32 weights, fp16 compute)"
    )


def _load_class(spec: OptimizerSpec, flag_value: str) -> type:
    try:
        module = importlib.import_module(spec.module)
    except ImportError as e:
        raise ValueError(
            f"--optimizer_type {flag_value}: needs the Python package '{spec.package}', which could not be imported "
            f"({e}). Install it with `pip install {spec.package}`."
        ) from e
    cls = getattr(module, spec.attr, None)
    if not isinstance(cls, type):
        classes = [n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")]
        raise ValueError(
            f"--optimizer_type {flag_value}: module '{spec.module}' has no class '{spec.attr}'"
            f"{did_you_mean(spec.attr, classes)}. If the name is right, the installed '{spec.package}' may be "
            f"too old: `pip install -U {spec.package}`."
        )
    return cls


def _init_parameters(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """Keyword parameters of ``cls(params, ...)`` (the first one, the params, left out) and whether it takes **kw."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return {}, True
    params = list(sig.parameters.values())
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return {p.name: p for p in named[1:]}, takes_any


def value_type_problem(key: str, value: Any, default: Any) -> str | None:
    """Why ``value`` cannot stand in for ``default`` (bool for bool, number for number, same-length tuple), or None."""
    if default is inspect.Parameter.empty or default is None or value is None:
        return None
    if isinstance(default, bool):
        ok, example = isinstance(value, bool), "True or False"
    elif isinstance(default, (int, float)):
        ok, example = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, tuple):
        ok = isinstance(value, (tuple, list)) and len(value) == len(default)
        example = f"{len(default)} comma-separated numbers, e.g. {key}={','.join(str(v) for v in default)}"
    elif isinstance(default, str):
        ok, example = isinstance(value, str), "a string"
    else:
        return None
    return None if ok else f"{key}={value!r} has the wrong type; expected {example} (default {default!r})"


def optimizer_arg_problems(spec: OptimizerSpec, cls: type, kwargs: Mapping[str, Any]) -> list[str]:
    """Everything wrong with ``--optimizer_args`` for this optimizer class: names checked against its signature."""
    params, takes_any = _init_parameters(cls)
    accepted = [n for n in params if n != "lr" and n not in spec.forced]
    problems = []
    for key, value in kwargs.items():
        where = f"--optimizer_args: {spec.name}"
        if key in ("lr", "params"):
            problems.append(f"{where}: '{key}' is set by the trainer; use --learning_rate (and --unet_lr etc.)")
        elif key in spec.forced:
            problems.append(f"{where} always uses {key}={spec.forced[key]!r} (as sd-scripts); remove '{key}'")
        elif key not in params and not takes_any:
            problems.append(
                f"{where} has no argument '{key}'{did_you_mean(key, accepted)}. Accepted: {', '.join(accepted)}"
            )
        elif key in params and (problem := value_type_problem(key, value, params[key].default)):
            problems.append(f"{where}: {problem}")
    given = set(kwargs) | set(spec.defaults) | set(spec.forced) | {"lr"}
    missing = [n for n, p in params.items() if p.default is p.empty and n not in given]
    if missing:
        problems.append(f"--optimizer_args: {spec.name} needs {', '.join(f'{m}=...' for m in missing)}")
    return problems


def resolve_optimizer_kwargs(spec: OptimizerSpec, user_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments passed to the class: sd-scripts' defaults, then the user's, then the forced ones.

    Adafactor: ``warmup_init=True`` turns ``relative_step`` on (as sd-scripts), since it only works with it.
    """
    kwargs = {**spec.defaults, **user_kwargs}
    if spec.kind == ADAFACTOR and not kwargs["relative_step"] and kwargs.get("warmup_init", False):
        kwargs["relative_step"] = True
    return {**kwargs, **spec.forced}


def _as_groups(param_groups: Iterable[Any]) -> list[dict[str, Any]]:
    """Copies of the param groups as dicts (a bare iterable of tensors becomes one group)."""
    items = list(param_groups)
    if not items:
        raise ValueError("make_optimizer: no trainable parameters were given (the param group list is empty)")
    if not isinstance(items[0], Mapping):
        return [{"params": items}]
    return [{**group, "params": list(group["params"])} for group in items]


def _group_lrs(groups: list[dict[str, Any]], default: float) -> list[float]:
    return [group.get("lr", default) for group in groups]


def _prepare_adaptive(lr: float, spec: OptimizerSpec, groups: list[dict[str, Any]], kw: dict) -> float | None:
    lrs = _group_lrs(groups, lr)
    if lrs[0] <= 0.1:
        logger.warning(f"{spec.name}: lr={lrs[0]} is low; D-Adaptation and Prodigy expect an lr around 1.0")
    if len(set(lrs)) > 1:
        if spec.name == "Prodigy" and len({lr for lr in lrs if lr != 0}) > 1:
            raise ValueError(
                f"Prodigy needs the same learning rate in every param group (0 freezes a group); got "
                f"{_describe_lrs(groups, lrs)}. Give --unet_lr and --text_encoder_lr the same value (usually 1.0), "
                "or use d_coef in --optimizer_args to scale the step size."
            )
        logger.warning(
            f"{spec.name}: param groups have different learning rates ({_describe_lrs(groups, lrs)}); "
            "D-Adaptation estimates one step size, so only the first lr takes effect (as sd-scripts warns)"
        )
    return lr


def _prepare_adafactor(lr: float, spec: OptimizerSpec, groups: list[dict[str, Any]], kw: dict) -> float | None:
    if not kw["relative_step"]:
        return lr
    dropped = [group.pop("lr") for group in groups if "lr" in group]
    if dropped:
        logger.warning("Adafactor with relative_step=True computes its own lr: the param-group lrs are ignored")
    return None  # transformers' Adafactor refuses an lr together with relative_step=True


def _prepare_plain(lr: float, spec: OptimizerSpec, groups: list[dict[str, Any]], kw: dict) -> float | None:
    return lr


# What each kind does to the param groups before construction, given the default lr (--learning_rate);
# returns the lr to pass to the class.
_PREPARE = {
    PLAIN: _prepare_plain,
    SCHEDULE_FREE: _prepare_plain,
    ADAPTIVE: _prepare_adaptive,
    ADAFACTOR: _prepare_adafactor,
}


def _describe_lrs(groups: list[dict[str, Any]], lrs: list[float]) -> str:
    return ", ".join(f"{g.get('name', f'group{i}')}={lr}" for i, (g, lr) in enumerate(zip(groups, lrs)))


def make_optimizer(cfg: OptimizerSettings, param_groups: Iterable[Any]) -> torch.optim.Optimizer:
    """Build the optimizer that ``cfg`` names over ``param_groups``.

    ``param_groups`` is an iterable of tensors or of dicts (``{"params": [...], "lr": 1e-4, "name": "unet"}``); a
    group's own "lr" wins over ``cfg.learning_rate`` and its "name" labels it in :func:`effective_lrs`. The groups are
    copied, never changed. Schedule-free optimizers are returned in train mode.
    """
    spec, cls = resolve_optimizer(cfg.optimizer_type)
    groups = _as_groups(param_groups)
    kwargs = resolve_optimizer_kwargs(spec, cfg.optimizer_kwargs)
    lr = _PREPARE[spec.kind](cfg.learning_rate, spec, groups, kwargs)
    logger.info(f"optimizer: {cls.__module__}.{cls.__name__} lr={lr} {kwargs}")
    optimizer = cls(groups, lr=lr, **kwargs, **cpu_fast_path(cls, groups, kwargs))
    set_train_mode(optimizer, True)
    return optimizer


FOREACH_MAX_CPU_PARAMS = 2**25  # 128 MiB of fp32 temporaries per foreach op at most
FUSED_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cpu_fast_path(cls: type, groups: list[dict[str, Any]], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """torch's fused or multi-tensor (foreach) optimizer step when every parameter is on the CPU, else ``{}``.

    On the CPU torch loops over the parameters in Python by default, several calls per tensor (~1,000-2,000 adapter
    tensors for an SDXL LoRA). Where the class has a fused CPU kernel (Adam, AdamW, SGD, Adagrad) it is asked for:
    one C++ call updates every tensor, with no temporaries beyond the tensor in hand, so it is used at any size. One
    AdamW step over the tiny SDXL LoRA's 1,972 tensors: 37 ms per-tensor, 35 ms foreach, 9.5 ms fused (1 thread).
    The fused kernel's rounding differs from the per-tensor path in the last bit (~1e-8 after a few steps; tested).
    Other torch optimizers get the foreach path: the same per-element operations, bitwise the same weights for most
    (Adamax, RMSprop, Adadelta, Rprop; RAdam, NAdam and ASGD round differently in the last bit); it holds temporaries the size of all parameters at once, so it is used only up to
    ``FOREACH_MAX_CPU_PARAMS`` parameters (adapters; a full model keeps the per-tensor path and its memory).
    ``--optimizer_args foreach=...`` or ``fused=...`` is left as given."""
    if not cls.__module__.startswith("torch.") or "foreach" in kwargs or "fused" in kwargs:
        return {}
    params = [p for g in groups for p in g["params"]]
    if not params or any(p.device.type != "cpu" for p in params):
        return {}
    accepted = inspect.signature(cls).parameters
    if "fused" in accepted and not kwargs.get("differentiable") and all(p.dtype in FUSED_CPU_DTYPES for p in params):
        return {"fused": True}
    if "foreach" not in accepted:
        return {}
    return {"foreach": True} if sum(p.numel() for p in params) <= FOREACH_MAX_CPU_PARAMS else {}


def optimizer_metadata(cfg: OptimizerSettings) -> str:
    """The ``ss_optimizer`` metadata string as sd-scripts writes it: ``module.Class(key=value,...)``."""
    spec, cls = resolve_optimizer(cfg.optimizer_type)
    kwargs = {k: v for k, v in resolve_optimizer_kwargs(spec, cfg.optimizer_kwargs).items() if k not in spec.forced}
    args = ",".join(f"{k}={v}" for k, v in kwargs.items())
    return f"{cls.__module__}.{cls.__name__}" + (f"({args})" if args else "")


def set_train_mode(optimizer: Any, training: bool) -> None:
    """Call ``optimizer.train()`` / ``.eval()`` where the optimizer has them (schedule-free); else do nothing.

    Schedule-free optimizers keep two parameter sequences: train mode holds the point gradients are taken at,
    eval mode the averaged weights to sample, validate and save. Call ``set_train_mode(opt, False)`` before
    sampling / validation / saving and ``set_train_mode(opt, True)`` before the next optimizer step. Works on an
    accelerate-wrapped optimizer too.
    """
    method = getattr(optimizer, "train" if training else "eval", None)
    if callable(method):
        method()


def _unwrap(optimizer: Any) -> Any:
    inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _adafactor_lr(optimizer: Any, group: dict[str, Any]) -> float:
    """Adafactor's relative-step lr for the group's first parameter (as transformers' AdafactorSchedule reports)."""
    param = group["params"][0]
    state = optimizer.state.get(param) or {}
    if "step" not in state:  # before the first step: the lr the first step will use
        state = {"step": 1, "RMS": param.detach().float().norm().item() / math.sqrt(max(1, param.numel()))}
    return float(type(optimizer)._get_lr(group, state))


def effective_lrs(optimizer: Any) -> dict[str, float]:
    """Learning rates to log, keyed as sd-scripts logs them.

    ``lr/<name>`` per param group (name from the group's "name" key, else ``group<i>``); for optimizers whose groups
    carry a step size ``d`` (D-Adaptation, Prodigy) also ``lr/d*lr/<name>`` = d × lr. For Adafactor with
    relative_step=True the lr is the one Adafactor computes for the group's first parameter.
    """
    optimizer = _unwrap(optimizer)
    logs = {}
    for i, group in enumerate(optimizer.param_groups):
        name = group.get("name") or f"group{i}"
        lr = group.get("lr")
        if group.get("relative_step") and hasattr(type(optimizer), "_get_lr"):
            lr = _adafactor_lr(optimizer, group)
        logs[f"lr/{name}"] = float(lr or 0.0)
        if "d" in group:
            logs[f"lr/d*lr/{name}"] = float(group["d"]) * float(lr or 0.0)
    return logs
