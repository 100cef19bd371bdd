"""sd-scripts' 16 sampler names (plus the hidden ``ddpm``) as diffusers schedulers built for the model's schedule.

sd-scripts (``train_util.get_my_scheduler``) builds every scheduler from the class defaults plus SD's betas,
``prediction_type="v_prediction"`` under ``--v_parameterization`` and ``clip_sample=True``. Here each scheduler is
built the way diffusers swaps schedulers on a pipeline (``Scheduler.from_config(pipe.scheduler.config)``): from the
model's own scheduler config (betas, ``prediction_type``, ``steps_offset``, ``timestep_spacing``...), so v-prediction
models sample as v-prediction, and x0 is not clipped (``clip_sample=False``, as in every released SD scheduler
config). Differences from sd-scripts, on purpose: no latent clipping; Euler-family schedulers use the model's
``leading`` spacing instead of their class default ``linspace``; PNDM skips the PRK warm-up steps as diffusers' SD
configs do.

Zero terminal SNR (Lin et al. 2023, arXiv:2305.08891, section 3.3): when the model or the training uses it, every
scheduler gets the rescaled schedule and ``trailing`` timestep spacing. Schedulers with ``rescale_betas_zero_snr``
get that flag; the others get the rescaled betas as ``trained_betas`` with the final cumulative alpha raised to 2^-24
(what diffusers' Euler schedulers do) so sigma-space samplers keep a finite largest sigma.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from library.objectives.noising import NoiseSchedule

# name -> (diffusers class, extra config)
SAMPLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddim": ("DDIMScheduler", {}),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),
    "lms": ("LMSDiscreteScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "dpm_2": ("KDPM2DiscreteScheduler", {}),
    "dpm_2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    # first-order-final "dpmsolver" cannot end on sigma 0 in diffusers >= 0.30 (it raises); sigma_min is its default
    "dpmsolver": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"}),
    "dpmsolver++": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "dpmsingle": ("DPMSolverSinglestepScheduler", {"lower_order_final": True}),  # diffusers forces it, with a warning
    "k_lms": ("LMSDiscreteScheduler", {}),
    "k_euler": ("EulerDiscreteScheduler", {}),
    "k_euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "k_dpm_2": ("KDPM2DiscreteScheduler", {}),
    "k_dpm_2_a": ("KDPM2AncestralDiscreteScheduler", {}),
}
SAMPLER_NAMES: tuple[str, ...] = tuple(SAMPLERS)  # the 16 --sample_sampler / --sampler choices
HIDDEN_SAMPLERS = {"ddpm": ("DDPMScheduler", {})}  # only via a prompt's --ss, as in sd-scripts
ALL_SAMPLER_NAMES: tuple[str, ...] = SAMPLER_NAMES + tuple(HIDDEN_SAMPLERS)

# What the released SD / SDXL scheduler configs set; used where the model's config does not say.
_SD_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "clip_sample": False,
    "set_alpha_to_one": False,
}
# Keys of the model's config that describe the noise schedule itself (other keys, such as a DDIM-specific
# option stored by another scheduler class, are not carried over).
_SCHEDULE_KEYS = (*_SD_DEFAULTS, "trained_betas", "rescale_betas_zero_snr")
_MIN_TERMINAL_ALPHA_BAR = 2.0**-24


def make_scheduler(name: str, scheduler_config: dict[str, Any], *, zero_terminal_snr: bool = False) -> Any:
    """A fresh diffusers scheduler for sampler ``name`` (one of :data:`ALL_SAMPLER_NAMES`) and the model's
    ``scheduler_config`` (``Parts.scheduler_config``). ``zero_terminal_snr``: the training used
    ``--zero_terminal_snr`` (a config with ``rescale_betas_zero_snr: true`` turns it on too)."""
    import diffusers

    key = name.lower()
    table = SAMPLERS.get(key) or HIDDEN_SAMPLERS.get(key)
    if table is None:
        raise ValueError(f"unknown sampler {name!r}; use one of {', '.join(ALL_SAMPLER_NAMES)}")
    class_name, extra = table
    cls = getattr(diffusers, class_name)
    accepted = set(inspect.signature(cls.__init__).parameters) | set(_init_keys(cls))
    config = {k: scheduler_config[k] for k in _SCHEDULE_KEYS if scheduler_config.get(k) is not None}
    config = {**_SD_DEFAULTS, **config, **extra}
    if zero_terminal_snr or config.pop("rescale_betas_zero_snr", False):
        config["timestep_spacing"] = "trailing"
        if "rescale_betas_zero_snr" in accepted:
            config["rescale_betas_zero_snr"] = True
        else:
            config["trained_betas"] = zero_snr_betas(scheduler_config)
    with warnings.catch_warnings():
        # diffusers marks algorithm_type="dpmsolver" deprecated; it is sd-scripts' "dpmsolver" sampler, kept on purpose
        warnings.filterwarnings("ignore", message=".*algorithm_type dpmsolver.*", category=FutureWarning)
        return cls(**{k: v for k, v in config.items() if k in accepted})


def zero_snr_betas(scheduler_config: dict[str, Any]) -> list[float]:
    """Betas (T,) of the zero-terminal-SNR rescaled schedule, with the last cumulative alpha set to 2^-24."""
    alphas_cumprod = NoiseSchedule.from_config(scheduler_config, zero_terminal_snr=True).alphas_cumprod.clone()
    alphas_cumprod[-1] = _MIN_TERMINAL_ALPHA_BAR
    previous = torch.cat([torch.ones(1, dtype=alphas_cumprod.dtype), alphas_cumprod[:-1]])
    return (1.0 - alphas_cumprod / previous).tolist()


def _init_keys(cls: type) -> list[str]:
    """Config keys of a diffusers scheduler whose ``__init__`` is wrapped (its signature shows *args, **kwargs)."""
    init = getattr(cls.__init__, "__wrapped__", None)
    return list(inspect.signature(init).parameters) if init is not None else []
