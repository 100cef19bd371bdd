"""library/optim: sd-scripts' optimizer / scheduler flags, real optimizer steps, lr curves against closed forms.

Oracles: sd-scripts' flag defaults and names (library/train_util.py: add_optimizer_arguments, get_optimizer,
get_scheduler_fix), the upstream classes themselves (torch AdamW / Lion as references for the bitsandbytes ones),
closed-form update rules (SGD with Nesterov / heavy-ball momentum, Adafactor's relative step, schedule-free's y = β1·x
+ (1-β1)·z), and lr curves written out below independently of the libraries that implement them.
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import sys

import pytest
import torch

from library.cli.problems import ConfigError
from library.optim import (
    OPTIMIZERS,
    SCHEDULERS,
    OptimConfig,
    add_optim_args,
    effective_lrs,
    make_optimizer,
    make_scheduler,
    optimizer_metadata,
    parse_key_values,
    parse_step_count,
    resolve_optimizer,
    set_train_mode,
)

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_optim_args(parser)
    return parser.parse_args(list(argv))


def config(*argv: str) -> OptimConfig:
    return OptimConfig.from_args(parse(*argv))


def problems_of(*argv: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config(*argv)
    return info.value.problems


# ----------------------------------------------------------------------------------------------------------- flags
# sd-scripts library/train_util.py: every flag of add_optimizer_arguments (optimizer, learning rates, LR scheduler).
SD_SCRIPTS_DEFAULTS = {
    "optimizer_type": "",
    "optimizer_args": None,
    "use_8bit_adam": False,
    "use_lion_optimizer": False,
    "learning_rate": 2e-6,
    "max_grad_norm": 1.0,
    "fused_backward_pass": False,
    "lr_scheduler": "constant",
    "lr_scheduler_type": "",
    "lr_scheduler_args": None,
    "lr_warmup_steps": 0,
    "lr_decay_steps": 0,
    "lr_scheduler_num_cycles": 1,
    "lr_scheduler_power": 1,
    "lr_scheduler_timescale": None,
    "lr_scheduler_min_lr_ratio": None,
}


def test_flags_have_sd_scripts_names_and_defaults():
    assert vars(parse()) == SD_SCRIPTS_DEFAULTS


def test_sd_scripts_command_line_parses():
    cfg = config(
        *("--optimizer_type", "AdamW8bit", "--learning_rate", "1e-4", "--max_grad_norm", "0"),
        *("--optimizer_args", "weight_decay=0.01", "betas=0.9,0.99", "--lr_scheduler", "cosine_with_restarts"),
        *("--lr_scheduler_num_cycles", "3", "--lr_warmup_steps", "5%"),
    )
    assert cfg.optimizer_type == "AdamW8bit" and cfg.learning_rate == 1e-4 and cfg.max_grad_norm == 0
    assert cfg.optimizer_kwargs == {"weight_decay": 0.01, "betas": (0.9, 0.99)}
    assert (cfg.lr_scheduler, cfg.lr_scheduler_num_cycles, cfg.lr_warmup_steps) == ("cosine_with_restarts", 3, 0.05)


@pytest.mark.parametrize(("text", "value"), [("100", 100), ("0", 0), ("0.05", 0.05), ("5%", 0.05), ("100%", 1.0)])
def test_step_count_accepts_steps_ratios_and_percentages(text, value):
    assert parse_step_count(text) == value and type(parse_step_count(text)) is type(value)


@pytest.mark.parametrize("text", ["1.0", "2.5", "-1", "-0.1", "abc", "150%", "1e3", "x%"])
def test_step_count_rejects_what_sd_scripts_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="whole number of steps"):
        parse_step_count(text)
    with pytest.raises(SystemExit):  # argparse reports it as a usage error
        parse("--lr_warmup_steps", text)


def test_config_file_values_are_normalised_like_the_command_line():
    # a config file bypasses argparse types: values arrive as int, float or str
    args = argparse.Namespace(lr_scheduler="cosine", lr_warmup_steps="10%", lr_decay_steps=0.2)
    args.optimizer_args = ["weight_decay=0.1"]
    cfg = OptimConfig.from_args(args)
    assert (cfg.lr_warmup_steps, cfg.lr_decay_steps, cfg.optimizer_kwargs) == (0.1, 0.2, {"weight_decay": 0.1})
    bad = argparse.Namespace(lr_scheduler="cosine", lr_warmup_steps=100.0, learning_rate="fast")
    with pytest.raises(ConfigError) as info:
        OptimConfig.from_args(bad)
    warmup, lr = info.value.problems
    assert warmup.startswith("--lr_warmup_steps: 100.0 is not") and lr == "--learning_rate: 'fast' is not a number"


def test_key_values_use_literal_eval_with_string_fallback():
    problems: list[str] = []
    parsed = parse_key_values("--optimizer_args", ["betas=0.9,0.99", "decouple=True", "x=None", "rules=1:10,0.1"], [])
    assert parsed == {"betas": (0.9, 0.99), "decouple": True, "x": None, "rules": "1:10,0.1"}
    assert parse_key_values("--optimizer_args", "a=1 b='two words'", problems) == {"a": 1, "b": "two words"}
    parse_key_values("--optimizer_args", ["weight_decay", "=1", "a=1", "a=2"], problems)
    assert problems == [
        "--optimizer_args: 'weight_decay' is not key=value (e.g. weight_decay=0.01)",
        "--optimizer_args: '=1' is not key=value (e.g. weight_decay=0.01)",
        "--optimizer_args: 'a' is given twice",
    ]


# ------------------------------------------------------------------------------------------------------ validation
def test_all_problems_are_reported_at_once_with_fixes():
    problems = problems_of(
        *("--optimizer_args", "betta=0.9,0.99", "lr=1", "weight_decay=abc", "amsgrad=true"),
        *("--lr_scheduler", "cosin", "--lr_scheduler_power", "-1"),
    )
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    assert "AdamW has no argument 'betta' (did you mean 'betas'?). Accepted: betas, eps, weight_decay" in text
    assert "'lr' is set by the trainer; use --learning_rate" in text
    assert "weight_decay='abc' has the wrong type; expected a number" in text
    assert "amsgrad='true' has the wrong type; expected True or False" in text
    assert "--lr_scheduler 'cosin': unknown scheduler (did you mean 'cosine'?)" in text
    assert "--lr_scheduler_power: -1.0 must be > 0" in text


def test_unknown_optimizer_suggests_the_closest_names():
    (problem,) = problems_of("--optimizer_type", "AdamW8bti")
    assert "unknown optimizer (did you mean 'AdamW8bit'" in problem and "module.Class" in problem


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--optimizer_args", "betas=0.9"), "betas=0.9 has the wrong type; expected 2 comma-separated numbers"),
        (("--optimizer_type", "SGDNesterov", "--optimizer_args", "nesterov=False"), "always uses nesterov=True"),
        (("--lr_warmup_steps", "10"), "--lr_scheduler constant does not use --lr_warmup_steps"),
        (("--lr_scheduler", "adafactor"), "--lr_scheduler adafactor only works with --optimizer_type Adafactor"),
        (("--lr_scheduler_type", "CosineAnnealingLR"), "needs --lr_scheduler_args T_max=..."),
        (("--lr_scheduler_type", "StepLR", "--lr_scheduler_args", "step_size=5", "--lr_warmup_steps", "3"), "warmup"),
        (("--lr_scheduler_type", "torch.optim.lr_scheduler.CosineAnealingLR"), "did you mean 'CosineAnnealingLR'"),
        (("--lr_scheduler", "reduce_lr_on_plateau"), "needs that metric at every scheduler step"),
        (("--lr_scheduler", "cosine_with_min_lr"), "needs exactly one floor: --lr_scheduler_min_lr_ratio"),
        (("--lr_scheduler", "piecewise_constant"), "needs --lr_scheduler_args step_rules=..."),
        (("--lr_scheduler", "piecewise_constant", "--lr_scheduler_args", "step_rules=1:10;0.1"), "is not valid"),
        (
            ("--lr_scheduler", "cosine_with_restarts", "--lr_scheduler_args", "num_cycles=2"),
            "--lr_scheduler_num_cycles",
        ),
        (("--lr_scheduler", "rex", "--lr_scheduler_args", "d=1.5"), "d=1.5 must be in [0, 1)"),
        (("--lr_scheduler", "polynomial", "--lr_scheduler_args", "lr_end=1e-3"), "must be below --learning_rate"),
        (("--fused_backward_pass",), "--fused_backward_pass only works with --optimizer_type Adafactor"),
        (("--optimizer_type", "LBFGS"), "needs a closure"),
        (("--optimizer_type", "torch.optim.NAdamm"), "has no class 'NAdamm' (did you mean 'NAdam'"),
        (("--optimizer_type", "no_such_package.Opt"), "needs the Python package 'no_such_package'"),
        (("--use_8bit_adam", "--use_lion_optimizer"), "both given"),
        (("--use_8bit_adam", "--optimizer_type", "Lion"), "conflicts with --optimizer_type Lion"),
    ],
)
def test_bad_settings_get_clear_errors(argv, message):
    problems = problems_of(*argv)
    assert any(message in p for p in problems), problems


def test_fused_backward_pass_needs_adafactor_without_accumulation():
    args = parse("--optimizer_type", "Adafactor", "--fused_backward_pass")
    assert OptimConfig.from_args(args).fused_backward_pass
    args.gradient_accumulation_steps = 4
    with pytest.raises(ConfigError, match="gradient_accumulation_steps > 1"):
        OptimConfig.from_args(args)


def test_legacy_flags_are_aliases():
    assert config("--use_8bit_adam").optimizer_type == "AdamW8bit"
    assert config("--use_lion_optimizer").optimizer_type == "Lion"
    assert config("--use_8bit_adam", "--optimizer_type", "adamw8bit").optimizer_type == "AdamW8bit"
    assert config().optimizer_type == "AdamW"


def test_missing_package_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lion_pytorch", None)  # makes `import lion_pytorch` fail
    (problem,) = problems_of("--optimizer_type", "Lion")
    assert "needs the Python package 'lion-pytorch'" in problem and "pip install lion-pytorch" in problem


def test_adafactor_relative_step_forces_its_scheduler(caplog):
    caplog.set_level(logging.INFO)
    cfg = config("--optimizer_type", "Adafactor", "--lr_scheduler", "cosine")
    assert cfg.adafactor_relative_step and cfg.lr_scheduler == "adafactor"
    assert "--lr_scheduler cosine replaced by adafactor" in caplog.text
    warmup_init = config("--optimizer_type", "Adafactor", "--optimizer_args", "relative_step=False", "warmup_init=True")
    assert warmup_init.lr_scheduler == "adafactor"  # sd-scripts turns relative_step back on for warmup_init
    manual = config(
        "--optimizer_type", "adafactor", "--optimizer_args", "relative_step=False", "--lr_scheduler", "linear"
    )
    assert not manual.adafactor_relative_step and manual.lr_scheduler == "linear"
    (problem,) = problems_of("--optimizer_type", "Adafactor", "--lr_warmup_steps", "10")
    assert "--lr_scheduler adafactor does not use --lr_warmup_steps" in problem


def test_schedule_free_ignores_the_schedule_with_a_warning(caplog):
    cfg = config("--optimizer_type", "AdamWScheduleFree", "--lr_scheduler", "cosine", "--lr_warmup_steps", "10")
    assert cfg.is_schedule_free
    assert "--lr_scheduler cosine, --lr_warmup_steps 10 ignored" in caplog.text and "warmup_steps=N" in caplog.text


# -------------------------------------------------------------------------------------------------------- registry
# sd-scripts train_util.get_optimizer, plus CAME: documented name -> (module the class comes from, class name).
DOCUMENTED_OPTIMIZERS = {
    "AdamW": ("torch.optim", "AdamW"),
    "AdamW8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "PagedAdamW8bit": ("bitsandbytes.optim", "PagedAdamW8bit"),
    "PagedAdamW": ("bitsandbytes.optim", "PagedAdamW"),
    "PagedAdamW32bit": ("bitsandbytes.optim", "PagedAdamW32bit"),
    "SGDNesterov8bit": ("bitsandbytes.optim", "SGD8bit"),
    "Lion8bit": ("bitsandbytes.optim", "Lion8bit"),
    "PagedLion8bit": ("bitsandbytes.optim", "PagedLion8bit"),
    "Lion": ("lion_pytorch", "Lion"),
    "SGDNesterov": ("torch.optim", "SGD"),
    "DAdaptation": ("dadaptation.experimental", "DAdaptAdamPreprint"),
    "DAdaptAdamPreprint": ("dadaptation.experimental", "DAdaptAdamPreprint"),
    "DAdaptAdaGrad": ("dadaptation", "DAdaptAdaGrad"),
    "DAdaptAdam": ("dadaptation", "DAdaptAdam"),
    "DAdaptAdan": ("dadaptation", "DAdaptAdan"),
    "DAdaptAdanIP": ("dadaptation.experimental", "DAdaptAdanIP"),
    "DAdaptLion": ("dadaptation", "DAdaptLion"),
    "DAdaptSGD": ("dadaptation", "DAdaptSGD"),
    "Prodigy": ("prodigyopt", "Prodigy"),
    "Adafactor": ("transformers.optimization", "Adafactor"),
    "RAdamScheduleFree": ("schedulefree", "RAdamScheduleFree"),
    "AdamWScheduleFree": ("schedulefree", "AdamWScheduleFree"),
    "SGDScheduleFree": ("schedulefree", "SGDScheduleFree"),
    "CAME": ("came_pytorch", "CAME"),
    "RAdam": ("torch.optim", "RAdam"),  # a bare torch.optim name
    "bitsandbytes.optim.AdEMAMix8bit": ("bitsandbytes.optim", "AdEMAMix8bit"),  # module.Class
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED_OPTIMIZERS))
def test_every_documented_name_resolves_case_insensitively(name):
    import importlib

    module, attr = DOCUMENTED_OPTIMIZERS[name]
    expected = getattr(importlib.import_module(module), attr)
    spellings = [name] if "." in name else [name, name.lower(), name.upper()]
    assert all(resolve_optimizer(s)[1] is expected for s in spellings)


# ------------------------------------------------------------------------------------------------- optimizer steps
def _learning_rate(name: str) -> float:
    kind = OPTIMIZERS[name.lower()].kind if name.lower() in OPTIMIZERS else "plain"
    if kind in ("adaptive", "adafactor") or name.lower() == "sgdschedulefree":
        return 1.0
    return 0.1 if "sgd" in name.lower() else 1e-2


@pytest.mark.parametrize("name", sorted([s.name for s in OPTIMIZERS.values()] + ["RAdam", "torch.optim.NAdam"]))
def test_each_optimizer_lowers_a_regression_loss(name):
    torch.manual_seed(0)
    model, teacher = torch.nn.Linear(64, 96), torch.nn.Linear(64, 96)  # 6144 weights: bitsandbytes' 8-bit path
    x = torch.randn(128, 64)
    y = teacher(x).detach()
    extra = {"d0": 1e-2} if name == "DAdaptAdaGrad" else {}  # its d grows too slowly from 1e-6 for 60 steps
    scheduler = "adafactor" if name == "Adafactor" else "constant"
    cfg = OptimConfig(name, extra, learning_rate=_learning_rate(name), lr_scheduler=scheduler)
    optimizer = make_optimizer(cfg, [{"params": list(model.parameters()), "name": "unet"}])
    first = torch.nn.functional.mse_loss(model(x), y).item()
    for _ in range(60):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    set_train_mode(optimizer, False)  # schedule-free: evaluate the averaged weights
    last = torch.nn.functional.mse_loss(model(x), y).item()
    assert last < 0.6 * first, (first, last)
    assert all(math.isfinite(v) for v in effective_lrs(optimizer).values())


def _trajectory(name: str, shape: tuple[int, ...], steps: int = 10, lr: float = 1e-2, **kwargs):
    """(parameter after `steps` steps on sum((p - t)^2), the optimizer)."""
    torch.manual_seed(0)
    param, target = torch.nn.Parameter(torch.randn(*shape)), torch.randn(*shape)
    optimizer = make_optimizer(OptimConfig(name, kwargs, learning_rate=lr), [param])
    for _ in range(steps):
        optimizer.zero_grad()
        ((param - target) ** 2).sum().backward()
        optimizer.step()
    return param.detach(), optimizer


@pytest.mark.parametrize(
    ("name", "reference"), [("AdamW8bit", "AdamW"), ("PagedAdamW32bit", "AdamW"), ("Lion8bit", "Lion")]
)
def test_bitsandbytes_optimizers_track_their_full_precision_reference(name, reference):
    small, _ = _trajectory(name, (6, 6))  # < 4096 elements: bitsandbytes keeps 32-bit state
    torch.testing.assert_close(small, _trajectory(reference, (6, 6))[0], rtol=0, atol=1e-6)
    big, optimizer = _trajectory(name, (64, 96))
    ref, start = _trajectory(reference, (64, 96))[0], _trajectory(reference, (64, 96), steps=0)[0]
    assert (big - ref).abs().max() < 0.25 * (ref - start).abs().max()  # 8-bit state: close, not equal
    expected = torch.float32 if name == "PagedAdamW32bit" else torch.uint8
    assert optimizer.state[optimizer.param_groups[0]["params"][0]]["state1"].dtype == expected


def _momentum_sgd(nesterov: bool, steps: int = 5, lr: float = 0.1, mu: float = 0.9) -> torch.Tensor:
    """Closed form on loss = sum((p - t)^2): g = 2(p - t); b = mu*b + g; step g + mu*b (Nesterov) or b."""
    torch.manual_seed(0)
    p, t = torch.randn(6, 6), torch.randn(6, 6)
    b = torch.zeros_like(p)
    for _ in range(steps):
        g = 2 * (p - t)
        b = mu * b + g
        p = p - lr * (g + mu * b if nesterov else b)
    return p


def test_sgd_nesterov_defaults_to_momentum_09():
    param, optimizer = _trajectory("SGDNesterov", (6, 6), steps=5, lr=0.1)
    assert optimizer.param_groups[0]["momentum"] == 0.9 and optimizer.param_groups[0]["nesterov"] is True
    torch.testing.assert_close(param, _momentum_sgd(nesterov=True))


def test_sgd_nesterov_8bit_is_heavy_ball_momentum_as_in_sd_scripts(caplog):
    # bitsandbytes' SGD8bit ignores nesterov=True; sd-scripts uses it all the same. We match and say so.
    param, _ = _trajectory("SGDNesterov8bit", (6, 6), steps=5, lr=0.1)
    torch.testing.assert_close(param, _momentum_sgd(nesterov=False))
    config("--optimizer_type", "SGDNesterov8bit")
    assert "ignores it, so SGDNesterov8bit is plain momentum SGD" in caplog.text


def test_group_lrs_and_names_reach_the_optimizer_and_the_logs():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    groups = [{"params": [a], "lr": 1e-3, "name": "unet"}, {"params": [b]}]
    optimizer = make_optimizer(OptimConfig(learning_rate=5e-4), groups)
    assert effective_lrs(optimizer) == {"lr/unet": 1e-3, "lr/group1": 5e-4}
    assert groups[0]["lr"] == 1e-3 and "lr" not in groups[1]  # caller's groups untouched


def test_adafactor_relative_step_lr_matches_its_closed_form(caplog):
    cfg = config("--optimizer_type", "Adafactor", "--learning_rate", "1e-3")
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 8) * 0.2)
    groups = [{"params": [param], "lr": 1e-4, "name": "unet"}]
    optimizer = make_optimizer(cfg, groups)
    scheduler = make_scheduler(cfg, optimizer, num_training_steps=10)
    assert "param-group lrs are ignored" in caplog.text and groups[0]["lr"] == 1e-4
    assert scheduler.get_last_lr() == [1e-3]  # before the first step: --learning_rate, as sd-scripts logs it
    rms = lambda p: p.detach().pow(2).mean().sqrt().item()  # noqa: E731
    assert effective_lrs(optimizer)["lr/unet"] == pytest.approx(1e-2 * max(1e-3, rms(param)))
    for step in range(1, 6):
        before = rms(param)
        optimizer.zero_grad()
        (param**2).sum().backward()
        optimizer.step()
        scheduler.step()
        expected = min(1e-2, 1 / math.sqrt(step)) * max(1e-3, before)  # transformers' Adafactor._get_lr
        assert effective_lrs(optimizer)["lr/unet"] == pytest.approx(expected)
        assert scheduler.get_last_lr()[0] == pytest.approx(expected)


@pytest.mark.parametrize("name", ["Prodigy", "DAdaptAdam"])
def test_adaptive_optimizers_log_d_times_lr(name):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(16, 16))
    optimizer = make_optimizer(OptimConfig(name, learning_rate=1.0), [{"params": [param], "name": "unet"}])
    for _ in range(5):
        optimizer.zero_grad()
        ((param - 1) ** 2).sum().backward()
        optimizer.step()
    group = optimizer.param_groups[0]
    assert group["d"] > 1e-6  # d grew from its start value d0
    assert effective_lrs(optimizer) == {"lr/unet": 1.0, "lr/d*lr/unet": pytest.approx(group["d"] * 1.0)}


def test_adaptive_optimizers_warn_or_refuse_like_their_libraries(caplog):
    def groups():
        return [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in (1e-4, 2e-4)]

    make_optimizer(OptimConfig("DAdaptAdam"), groups())
    assert "lr=0.0001 is low" in caplog.text and "only the first lr takes effect" in caplog.text
    with pytest.raises(ValueError, match="Prodigy needs the same learning rate in every param group"):
        make_optimizer(OptimConfig("Prodigy"), groups())


def test_schedule_free_train_eval_switches_between_y_and_x():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = make_optimizer(OptimConfig("AdamWScheduleFree", learning_rate=1e-2), [param])
    for _ in range(5):
        optimizer.zero_grad()
        (param**2).sum().backward()
        optimizer.step()
    y = param.detach().clone()
    set_train_mode(optimizer, False)
    x, z, beta1 = param.detach().clone(), optimizer.state[param]["z"], optimizer.param_groups[0]["betas"][0]
    assert not torch.equal(x, y)
    torch.testing.assert_close(beta1 * x + (1 - beta1) * z, y)  # schedule-free: y = β1·x + (1-β1)·z
    set_train_mode(optimizer, True)
    torch.testing.assert_close(param.detach(), y)
    plain = make_optimizer(OptimConfig(), [torch.nn.Parameter(torch.ones(2))])
    set_train_mode(plain, False)  # no-op for ordinary optimizers
    set_train_mode(plain, True)


def test_train_eval_and_logging_work_through_accelerate():
    from accelerate import Accelerator

    cfg = config("--optimizer_type", "AdamWScheduleFree", "--learning_rate", "1e-2")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = make_optimizer(cfg, [{"params": list(model.parameters()), "name": "unet"}])
    scheduler = make_scheduler(cfg, optimizer, num_training_steps=10)
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for _ in range(3):
        optimizer.zero_grad()
        accelerator.backward(model(torch.ones(2, 4)).pow(2).sum())
        optimizer.step()
        scheduler.step()
    trained = model.weight.detach().clone()
    set_train_mode(optimizer, False)  # reaches the schedule-free optimizer inside AcceleratedOptimizer
    assert not torch.equal(model.weight, trained)
    set_train_mode(optimizer, True)
    torch.testing.assert_close(model.weight.detach(), trained)
    assert effective_lrs(optimizer) == {"lr/unet": 1e-2}


def test_metadata_string_matches_sd_scripts():
    assert optimizer_metadata(config("--optimizer_type", "SGDNesterov")) == "torch.optim.sgd.SGD(momentum=0.9)"
    cfg = config("--optimizer_args", "weight_decay=0.1", "betas=0.9,0.99")
    assert optimizer_metadata(cfg) == "torch.optim.adamw.AdamW(weight_decay=0.1,betas=(0.9, 0.99))"


# ------------------------------------------------------------------------------------------------------ schedulers
T, W = 100, 10  # steps and warmup used by the curves below


def _progress(t: int, warmup: int = W) -> float:
    return (t - warmup) / (T - warmup)


def _warm(t: int) -> float:
    return t / W


def _cos_to(t: int, floor: float = 0.0) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * _progress(t)))


def _rex(z: float, d: float) -> float:
    return (1 - z) / ((1 - d) + d * (1 - z))


# name -> (flags, closed form of the multiplier at scheduler step t). Written from each schedule's definition.
CURVES = {
    "constant": ((), lambda t: 1.0),
    "constant_with_warmup": (("--lr_warmup_steps", "10"), lambda t: min(1.0, _warm(t))),
    "linear": (("--lr_warmup_steps", "10"), lambda t: _warm(t) if t < W else 1 - _progress(t)),
    "cosine": (("--lr_warmup_steps", "0.1"), lambda t: _warm(t) if t < W else _cos_to(t)),
    "cosine_with_restarts": (
        ("--lr_warmup_steps", "10%", "--lr_scheduler_num_cycles", "3"),
        lambda t: _warm(t) if t < W else 0.5 * (1 + math.cos(math.pi * ((3 * _progress(t)) % 1.0))),
    ),
    # transformers' polynomial (used by sd-scripts and identical in diffusers) decays to the absolute lr_end=1e-7,
    # taken relative to the optimizer's default lr (--learning_rate = 1e-3 here)
    "polynomial": (
        ("--lr_warmup_steps", "10", "--lr_scheduler_power", "2"),
        lambda t: _warm(t) if t < W else ((1e-3 - 1e-7) * (1 - _progress(t)) ** 2 + 1e-7) / 1e-3,
    ),
    "inverse_sqrt": (
        ("--lr_warmup_steps", "10", "--lr_scheduler_timescale", "20"),
        lambda t: _warm(t) if t < W else 1 / math.sqrt((t + 20 - W) / 20),
    ),
    "cosine_with_min_lr": (
        ("--lr_warmup_steps", "10", "--lr_scheduler_min_lr_ratio", "0.1"),
        lambda t: _warm(t) if t < W else _cos_to(t, 0.1),
    ),
    # transformers' variant: warmup starts at 1/W and the decay runs one step ahead (sd-scripts crashes on it)
    "cosine_warmup_with_min_lr": (
        ("--lr_warmup_steps", "10", "--lr_scheduler_min_lr_ratio", "0.1"),
        lambda t: (t + 1) / W if t < W else _cos_to(t + 1, 0.1),
    ),
    "warmup_stable_decay": (
        ("--lr_warmup_steps", "10", "--lr_decay_steps", "0.3", "--lr_scheduler_min_lr_ratio", "0.2"),
        lambda t: (
            0.2 + 0.8 * _warm(t)
            if t < W
            else 1.0
            if t < 70
            else 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * (t - 70) / 30))
        ),
    ),
    "piecewise_constant": (
        ("--lr_scheduler_args", "step_rules=1:10,0.1:20,0.01"),
        lambda t: 1.0 if t < 10 else 0.1 if t < 20 else 0.01,
    ),
    # REX with OneTrainer's d=0.9 (default) and with the paper's profile (1 - z) / (1 - z/2), i.e. d=0.5
    "rex": (("--lr_warmup_steps", "10"), lambda t: _warm(t) if t < W else _rex(_progress(t), 0.9)),
    "rex_paper": (
        ("--lr_scheduler", "rex", "--lr_scheduler_args", "d=0.5", "--lr_scheduler_min_lr_ratio", "0.1"),
        lambda t: 0.1 + 0.9 * (1 - t / T) / (1 - t / T / 2),
    ),
    "CosineAnnealingLR": (
        ("--lr_scheduler_type", "CosineAnnealingLR", "--lr_scheduler_args", "T_max=100", "eta_min=0"),
        lambda t: 0.5 * (1 + math.cos(math.pi * t / T)),
    ),
    "torch.optim.lr_scheduler.StepLR": (
        ("--lr_scheduler_type", "torch.optim.lr_scheduler.StepLR", "--lr_scheduler_args", "step_size=30", "gamma=0.5"),
        lambda t: 0.5 ** (t // 30),
    ),
}


def _argv(name: str) -> list[str]:
    flags = list(CURVES[name][0])
    named = "--lr_scheduler_type" not in flags and "--lr_scheduler" not in flags
    return ["--learning_rate", "1e-3"] + (["--lr_scheduler", name] if named else []) + flags


def _two_groups(cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    return make_optimizer(cfg, [{"params": [params[0]], "name": "unet"}, {"params": [params[1]], "lr": 4e-4}])


def _lrs(cfg: OptimConfig, steps: int, optimizer=None, scheduler=None, num_processes: int = 1) -> list[list[float]]:
    """Each group's lr before each of `steps` optimizer + scheduler steps."""
    optimizer = optimizer or _two_groups(cfg)
    scheduler = scheduler or make_scheduler(cfg, optimizer, T // num_processes, num_processes)
    seen = []
    for _ in range(steps):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return seen


def test_every_named_scheduler_has_a_curve_test():
    assert set(SCHEDULERS) - {"adafactor"} <= set(CURVES)  # adafactor: test_adafactor_relative_step_lr_matches...


@pytest.mark.parametrize("name", sorted(CURVES))
def test_scheduler_curve_matches_closed_form(name):
    curve = CURVES[name][1]
    seen = _lrs(config(*_argv(name)), T)
    for t, (unet, second) in enumerate(seen):  # both groups scaled from their own lr
        assert unet == pytest.approx(1e-3 * curve(t), rel=1e-9, abs=1e-15), t
        assert second == pytest.approx(4e-4 * curve(t), rel=1e-9, abs=1e-15), t


def test_multi_process_runs_scale_the_schedule_to_scheduler_steps():
    # 2 processes: accelerate steps the scheduler twice per optimizer step, so 50 optimizer steps are 100 scheduler
    # steps; a 5-step (or 10%) warmup covers 10 scheduler steps: the single-process curve above.
    cosine = CURVES["cosine"][1]
    for warmup in ("5", "0.1"):
        cfg = config("--lr_scheduler", "cosine", "--lr_warmup_steps", warmup, "--learning_rate", "1e-3")
        seen = _lrs(cfg, T, num_processes=2)
        assert [s[0] for s in seen] == pytest.approx([1e-3 * cosine(t) for t in range(T)], rel=1e-9, abs=1e-15)


def test_warmup_longer_than_the_run_is_an_error():
    cfg = config("--lr_scheduler", "warmup_stable_decay", "--lr_warmup_steps", "60", "--lr_decay_steps", "50")
    with pytest.raises(ValueError, match="longer than the run"):
        make_scheduler(cfg, _two_groups(cfg), num_training_steps=100)


def test_schedule_free_gets_a_constant_schedule():
    cfg = config("--optimizer_type", "AdamWScheduleFree", "--lr_scheduler", "cosine", "--learning_rate", "1e-3")
    assert [s[0] for s in _lrs(cfg, 20)] == [1e-3] * 20


@pytest.mark.parametrize("name", sorted(CURVES))
def test_scheduler_resumes_exactly_from_its_state_dict(name):
    cfg = config(*_argv(name))
    uninterrupted = _lrs(cfg, T)
    optimizer = _two_groups(cfg)
    scheduler = make_scheduler(cfg, optimizer, T)
    first = _lrs(cfg, 37, optimizer, scheduler)
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # as a safe resume loads it
    optimizer = _two_groups(cfg)
    scheduler = make_scheduler(cfg, optimizer, T)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    assert first + _lrs(cfg, T - 37, optimizer, scheduler) == uninterrupted


# ----------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit", "Lion8bit", "PagedLion8bit", "SGDNesterov8bit"])
def test_bitsandbytes_8bit_optimizers_train_on_cuda(name):
    torch.manual_seed(0)
    model, teacher = torch.nn.Linear(64, 96).cuda(), torch.nn.Linear(64, 96).cuda()
    x = torch.randn(128, 64, device="cuda")
    y = teacher(x).detach()
    optimizer = make_optimizer(OptimConfig(name, learning_rate=_learning_rate(name)), model.parameters())
    first = torch.nn.functional.mse_loss(model(x), y).item()
    for _ in range(60):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    assert torch.nn.functional.mse_loss(model(x), y).item() < 0.6 * first
    assert optimizer.state[model.weight]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("warmup", [0, 7])
def test_constant_schedules_equal_transformers_without_importing_it(warmup):
    """constant / constant_with_warmup are built here (transformers.optimization imports its trainer and peft, seconds
    of start-up); their factors are exactly transformers' and reading a plain config does not import it (below)."""
    from transformers.optimization import get_constant_schedule_with_warmup as reference

    from library.optim.schedulers import get_constant_schedule_with_warmup

    ours, theirs = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3) for _ in range(2))
    ours_s, theirs_s = get_constant_schedule_with_warmup(ours, warmup), reference(theirs, warmup)
    for _ in range(20):
        assert ours_s.get_last_lr() == theirs_s.get_last_lr()
        ours.step(), theirs.step(), ours_s.step(), theirs_s.step()


def test_a_constant_schedule_config_does_not_import_transformers():
    """Reading a constant_with_warmup config imports no transformers.optimization (checked in a fresh interpreter:
    the test session has imported it already). Once, not per schedule of the test above: the same command."""
    import subprocess

    code = ("import sys; from library.optim.config import OptimConfig; import argparse; "
            "from library.optim import add_optim_args; p = argparse.ArgumentParser(); add_optim_args(p); "
            "OptimConfig.from_args(p.parse_args(['--lr_scheduler', 'constant_with_warmup', '--lr_warmup_steps', '5'])); "
            "print('transformers.optimization' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def _train_six_steps(*flags: str) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((8, 4), (3,), (5, 5, 2))]
    groups = [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 3e-3}]
    opt = make_optimizer(config(*flags, "--learning_rate", "1e-2"), groups)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


@pytest.mark.parametrize(
    "flags",
    [
        ("--optimizer_type", "AdamW", "--optimizer_args", "weight_decay=0.1"),
        ("--optimizer_type", "AdamW", "--optimizer_args", "amsgrad=True"),
        ("--optimizer_type", "SGDNesterov", "--optimizer_args", "weight_decay=0.01"),
        ("--optimizer_type", "Adagrad"),
    ],
)
def test_cpu_runs_take_the_fused_path_with_the_same_weights(flags):
    """make_optimizer asks torch's optimizers that have a fused CPU kernel for it (one C++ call per step); the weights
    after several steps equal the per-tensor path's up to the last bit."""
    fast, opt = _train_six_steps(*flags)
    slow, slow_opt = _train_six_steps(*flags[:2], "--optimizer_args", *flags[3:], "foreach=False")
    assert all(g["fused"] is True for g in opt.param_groups)
    assert all(not g["fused"] and g["foreach"] is False for g in slow_opt.param_groups)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["Adamax", "RMSprop", "RAdam"])
def test_cpu_runs_without_a_fused_kernel_take_the_foreach_path_with_the_same_weights(name):
    """Optimizers without a fused kernel get torch's multi-tensor path: the same weights (exactly, but for RAdam,
    whose multi-tensor path rounds differently in the last bit)."""
    fast, opt = _train_six_steps("--optimizer_type", name)
    slow, slow_opt = _train_six_steps("--optimizer_type", name, "--optimizer_args", "foreach=False")
    assert all(g["foreach"] is True for g in opt.param_groups)
    assert all(g["foreach"] is False for g in slow_opt.param_groups)
    for a, b in zip(fast, slow):
        if name == "RAdam":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)


def test_foreach_is_not_asked_for_a_full_model_on_the_cpu(monkeypatch):
    """Above the size limit (a full model) the per-tensor path stays: foreach temporaries span all parameters. The
    fused kernel has no such temporaries and is taken at any size."""
    import library.optim.optimizers as optimizers

    params = [torch.nn.Parameter(torch.zeros(10, 10)) for _ in range(3)]
    monkeypatch.setattr(optimizers, "FOREACH_MAX_CPU_PARAMS", 299)
    assert make_optimizer(config("--optimizer_type", "RAdam"), params).param_groups[0]["foreach"] is None
    assert make_optimizer(config("--optimizer_type", "AdamW"), params).param_groups[0]["fused"] is True
    monkeypatch.setattr(optimizers, "FOREACH_MAX_CPU_PARAMS", 300)
    assert make_optimizer(config("--optimizer_type", "RAdam"), params).param_groups[0]["foreach"] is True
