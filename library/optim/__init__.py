"""Optimizers and LR schedulers with sd-scripts' flags, names and behaviour.

What a training recipe does with this package::

    add_optim_args(parser)                                   # the 16 sd-scripts flags
    cfg = OptimConfig.from_args(args)                        # validated up front; all problems in one ValueError
    optimizer = make_optimizer(cfg, param_groups)            # groups: [{"params": [...], "lr": ..., "name": "unet"}]
    scheduler = make_scheduler(cfg, optimizer, max_train_steps, accelerator.num_processes)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    ...                                                      # clip with cfg.max_grad_norm (0 = off)
    logs.update(effective_lrs(optimizer))                    # lr/<group>, lr/d*lr/<group> (Prodigy, D-Adaptation)
    set_train_mode(optimizer, False); sample(); save(); set_train_mode(optimizer, True)   # schedule-free only

Modules: ``optimizers`` (registry, construction, train/eval mode, effective lrs), ``schedulers`` (registry, REX,
step counts), ``config`` (flags and :class:`OptimConfig`). ``config`` builds on the other two; they read the settings
through the protocols ``OptimizerSettings`` / ``ScheduleSettings`` (what each reads), which :class:`OptimConfig` has.
"""

from library.optim.config import (
    OptimConfig,
    add_optim_args,
    add_part_lr_args,
    parse_key_values,
    parse_step_count,
)
from library.optim.optimizers import (
    OPTIMIZERS,
    OptimizerSpec,
    effective_lrs,
    known_optimizer_names,
    make_optimizer,
    optimizer_metadata,
    resolve_optimizer,
    set_train_mode,
)
from library.optim.schedulers import (
    SCHEDULERS,
    SchedulerSpec,
    get_rex_schedule,
    make_scheduler,
    rex_lambda,
    schedule_steps,
    scheduler_names,
    step_without_optimizer,
)

__all__ = [
    "OPTIMIZERS",
    "SCHEDULERS",
    "OptimConfig",
    "OptimizerSpec",
    "SchedulerSpec",
    "add_optim_args",
    "add_part_lr_args",
    "effective_lrs",
    "get_rex_schedule",
    "known_optimizer_names",
    "make_optimizer",
    "make_scheduler",
    "optimizer_metadata",
    "parse_key_values",
    "parse_step_count",
    "resolve_optimizer",
    "rex_lambda",
    "schedule_steps",
    "scheduler_names",
    "set_train_mode",
    "step_without_optimizer",
]
