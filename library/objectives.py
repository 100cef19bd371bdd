"""The training objective a family hands the step: what is noised how, what the model output is compared with, and
how the loss is weighted. The step (``library/run/train_step.py``) asks the objective; it never tests a bool.

``family.training_objective(parts, noise, loss)`` builds one per run:

* :class:`DDPMObjective`: epsilon or v-prediction on a discrete DDPM schedule (SD 1.x / 2.x / SDXL), built from
  :mod:`library.noising` (``make_example``) and :mod:`library.losses` (``diffusion_loss_per_sample``), exactly as
  sd-scripts' ``train_network.py`` does;
* :class:`FlowMatchingObjective`: rectified flow with sd-scripts' FLUX.1 meanings, built from
  :mod:`library.flow_matching` and :mod:`library.losses` (``weighted_loss_per_sample``);
* :class:`SD3FlowObjective`: sd-scripts' SD3 / SD3.5 variant (integer timesteps, x0 target).

Builders: :func:`ddpm_objective`, :func:`flow_matching_objective`, :func:`sd3_flow_objective` (a family's
``training_objective`` calls one; the flow ones warn once about the flags flow matching ignores).

The step, per batch (``batch_loss``)::

    ex = objective.example(latents, generator)              # noise, timesteps / σ, noisy input, target
    out = family.predict(denoiser, ex.noisy, ex.timesteps, cond)
    loss = objective.loss_per_sample(objective.prediction(out, ex), ex, loss_weights=..., mask=...)
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from library import flow_matching as fm
from library.families.base import EPSILON, FLOW_MATCHING, V_PREDICTION
from library.losses import (
    LossConfig,
    check_shapes,
    diffusion_loss_per_sample,
    huber_c_by_timestep,
    weighted_loss_per_sample,
)
from library.noising import NoiseConfig, NoiseSchedule, make_example

logger = logging.getLogger(__name__)

# sd-scripts' fixed validation timesteps: linspace(min, max, 6)[1:-1] (train_network.py, NUM_VALIDATION_TIMESTEPS)
NUM_VALIDATION_TIMESTEPS = 4


class Example(NamedTuple):
    """One training example (unpacks as ``noisy, target, timesteps, noise, sigmas``).

    noisy: (B, C, H, W) model input in the latents' dtype; target: (B, C, H, W) float32; timesteps: (B,) what the
    family's ``predict`` receives (long DDPM timesteps, or float ``1000 σ`` for flow matching); noise: (B, C, H, W)
    float32 ε (without the input perturbation); sigmas: (B,) float32 σ of flow matching, None for DDPM.
    """

    noisy: Tensor
    target: Tensor
    timesteps: Tensor
    noise: Tensor
    sigmas: Tensor | None = None


@runtime_checkable
class Objective(Protocol):
    """What the training step asks of a family's objective (``ModelFamily.training_objective``)."""

    name: str
    """One of ``library.families.base.OBJECTIVES`` (epsilon, v_prediction, flow_matching): what the model predicts,
    what metadata and sampling read."""

    predict_options: dict[str, Any]
    """Keyword arguments the step gives the family's ``predict`` besides the batch (FLUX.1-dev: ``{"guidance": g}``,
    sd-scripts' ``--guidance_scale`` in every training step); empty for most objectives."""

    def example(
        self, latents: Tensor, generator: torch.Generator | None = None, *, timesteps: Tensor | None = None
    ) -> Example:
        """Noise, timesteps (drawn, or the given (B,) ones: validation), noisy input and target for clean latents
        (B, C, H, W); every draw from ``generator``."""
        ...

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """The raw model output (B, C, H, W) turned into what is compared with ``example.target``."""
        ...

    def loss_per_sample(
        self,
        pred: Tensor,
        example: Example,
        *,
        loss_weights: Tensor | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Per-sample loss (B,) float32 of ``pred`` (from :meth:`prediction`) with the objective's weighting."""
        ...

    def validation_timesteps(self) -> list[Any]:
        """One entry per validation pass over a batch: the timestep every sample of that pass is noised at, or None
        for a pass whose timesteps are drawn as in training."""
        ...

    def metadata(self) -> dict[str, Any]:
        """The objective's own ``ss_*`` keys for trained files (beyond the noise/loss keys every run writes)."""
        ...

    def to(self, device: torch.device | str) -> Objective:
        """The same objective with its tables on ``device``."""
        ...


# ----------------------------------------------------------------------------------------------------------------------
# DDPM: epsilon / v-prediction


@dataclass(frozen=True, eq=False)
class DDPMObjective:
    """Epsilon or v-prediction on a DDPM schedule (SD 1.x / 2.x / SDXL): :func:`library.noising.make_example` and
    :func:`library.losses.diffusion_loss_per_sample` with the run's settings; ``noise`` / ``loss`` carry
    ``v_parameterization`` = (name == "v_prediction")."""

    name: str
    noise: NoiseConfig
    loss: LossConfig
    schedule: NoiseSchedule
    predict_options: dict[str, Any] = field(default_factory=dict)

    def example(
        self, latents: Tensor, generator: torch.Generator | None = None, *, timesteps: Tensor | None = None
    ) -> Example:
        if timesteps is not None:
            timesteps = timesteps.to(latents.device)
        noisy, target, t, noise = make_example(self.noise, latents, self.schedule, generator, timesteps=timesteps)
        return Example(noisy, target, t, noise)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """The UNet output is the prediction (ε or v) itself."""
        return output

    def loss_per_sample(
        self,
        pred: Tensor,
        example: Example,
        *,
        loss_weights: Tensor | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """:func:`library.losses.diffusion_loss_per_sample` (loss type, mask, prior weights, SNR weightings)."""
        target = example.target.to(pred.device)
        return diffusion_loss_per_sample(pred, target, example.timesteps, self.loss, self.schedule,
                                         loss_weights=loss_weights, mask=mask, generator=generator)  # fmt: skip

    def validation_timesteps(self) -> list[int]:
        """sd-scripts' fixed validation timesteps: ``linspace(min_t, max_t, 6)[1:-1]`` (200/400/600/800 by
        default)."""
        lo = self.noise.min_timestep or 0
        hi = self.noise.max_timestep or self.schedule.num_train_timesteps
        points = torch.linspace(lo, hi, NUM_VALIDATION_TIMESTEPS + 2)[1:-1]
        return [int(v) for v in points.round().tolist()]

    def metadata(self) -> dict[str, Any]:
        """None beyond the noise/loss keys every run writes."""
        return {}

    def to(self, device: torch.device | str) -> DDPMObjective:
        return dataclasses.replace(self, schedule=self.schedule.to(device))


def ddpm_objective(title: str, prediction_type: str, scheduler_config: dict, noise: NoiseConfig,
                   loss: LossConfig) -> DDPMObjective:  # fmt: skip
    """The DDPM objective of a model whose ``prediction_type`` is "epsilon" or "v_prediction", on the schedule of
    its ``scheduler_config`` (zero-terminal-SNR rescaled with ``noise.zero_terminal_snr``). ``title`` names the
    family in errors (flow-matching flags, or an objective the DDPM code cannot train)."""
    if noise.flow is not None:
        raise ValueError(
            f"{title} trains on a DDPM schedule ({prediction_type}); the flow-matching flags (--model_prediction_type, "
            "--discrete_flow_shift, --weighting_scheme ...) are for flow-matching models: use the script of this "
            "model's family"
        )
    if prediction_type not in (EPSILON, V_PREDICTION):
        raise ValueError(f"{title}: training objective {prediction_type!r} is not supported on a DDPM schedule "
                         f"(epsilon and v_prediction are)")  # fmt: skip
    v = prediction_type == V_PREDICTION
    schedule = NoiseSchedule.from_config(scheduler_config, zero_terminal_snr=noise.zero_terminal_snr)
    return DDPMObjective(
        prediction_type,
        dataclasses.replace(noise, v_parameterization=v),
        dataclasses.replace(loss, v_parameterization=v),
        schedule,
    )


# ----------------------------------------------------------------------------------------------------------------------
# Flow matching


@dataclass(frozen=True, eq=False)
class FlowMatchingObjective:
    """Rectified flow with sd-scripts' FLUX.1 meanings (:mod:`library.flow_matching`): x_σ = (1 - σ) x0 + σ ε, target
    ε - x0, ``timesteps`` = 1000 σ (float) for the family's ``predict``, ``--model_prediction_type`` on the output,
    ``--weighting_scheme`` per sample with sigma_scaled; the loss is ``--loss_type`` (huber schedules constant /
    exponential on 1000 σ), mask and prior weights, with no SNR weighting (sd-scripts' FLUX ``post_process_loss``)."""

    cfg: fm.FlowMatchingConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)  # e.g. FLUX.1-dev's {"guidance": 3.5}

    def example(
        self, latents: Tensor, generator: torch.Generator | None = None, *, timesteps: Tensor | None = None
    ) -> Example:
        """``timesteps`` given (B,): σ = timesteps / 1000 for every sample, no σ draw."""
        if latents.ndim != 4:
            raise ValueError(f"latents must be (B, C, H, W), got shape {tuple(latents.shape)}")
        device, batch = latents.device, latents.shape[0]
        draw = generator.device if generator is not None else device
        noise = torch.randn(tuple(latents.shape), generator=generator, device=draw, dtype=torch.float32).to(device)
        if timesteps is None:
            sigmas, timesteps = fm.sample_sigmas(self.cfg, batch, tuple(latents.shape[-2:]), generator, device)
        elif timesteps.shape != (batch,):
            raise ValueError(f"timesteps must have shape ({batch},), got {tuple(timesteps.shape)}")
        else:
            timesteps = timesteps.to(device, torch.float32)
            sigmas = timesteps / fm.NUM_TRAIN_TIMESTEPS
        c = self.cfg
        noisy = fm.noisy_input(latents, noise, sigmas, generator, ip_noise_gamma=c.ip_noise_gamma,
                               ip_noise_gamma_random_strength=c.ip_noise_gamma_random_strength)  # fmt: skip
        return Example(noisy.to(latents.dtype), fm.flow_target(latents, noise), timesteps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """``--model_prediction_type``: raw o, additive o + x_σ, sigma_scaled x_σ - σ o."""
        noisy = example.noisy.to(output.device, output.dtype)
        return fm.apply_model_prediction_type(self.cfg.model_prediction_type, output, noisy, example.sigmas)

    def weighting(self, example: Example) -> Tensor | None:
        """(B, 1, 1, 1) loss weight per sample from ``--weighting_scheme`` (sigma_scaled only, as sd-scripts), or
        None for 1."""
        if self.cfg.model_prediction_type != "sigma_scaled":
            return None
        weight = fm.loss_weighting(self.cfg.weighting_scheme, example.sigmas)
        return None if weight is None else weight.view(-1, 1, 1, 1)

    def loss_per_sample(
        self,
        pred: Tensor,
        example: Example,
        *,
        loss_weights: Tensor | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """:func:`library.losses.weighted_loss_per_sample` with :meth:`weighting` per element."""
        return _flow_loss(self.loss, self.weighting(example), pred, example, loss_weights, mask, generator)

    def validation_timesteps(self) -> list[None]:
        """Four passes, each drawing σ as in training: what sd-scripts' FLUX validation does (its loop sets
        ``min_timestep = max_timestep`` to 200/400/600/800 per pass, which only the DDPM path reads; the flow path
        ignores them). The validation generators are seeded, so the value is deterministic for given weights."""
        return [None] * NUM_VALIDATION_TIMESTEPS

    def metadata(self) -> dict[str, Any]:
        """sd-scripts' FLUX objective keys (``flux_train_network.py: update_metadata``)."""
        c = self.cfg
        return {
            "ss_weighting_scheme": c.weighting_scheme,
            "ss_logit_mean": c.logit_mean,
            "ss_logit_std": c.logit_std,
            "ss_mode_scale": c.mode_scale,
            "ss_timestep_sampling": c.timestep_sampling,
            "ss_sigmoid_scale": c.sigmoid_scale,
            "ss_model_prediction_type": c.model_prediction_type,
            "ss_discrete_flow_shift": c.discrete_flow_shift,
        }

    def to(self, device: torch.device | str) -> FlowMatchingObjective:
        """Itself: its σ table is built on the host per draw (1000 entries)."""
        return self


@dataclass(frozen=True, eq=False)
class SD3FlowObjective:
    """SD3's flow matching (sd-scripts' ``sd3_train_network.py``; :mod:`library.flow_matching`): integer timesteps
    t in [min_timestep, max_timestep) by ``--weighting_scheme`` and ``--training_shift``, σ = t / 1000, x_σ = (1 - σ)
    x0 + σ ε, the output preconditioned ``x_σ - σ o`` (Karras et al. 2022, arXiv:2206.00364, section 5) and
    compared with x0, weighted by ``--weighting_scheme`` (sigma_sqrt, cosmap); no input perturbation and no SNR
    weighting (sd-scripts' SD3 path reads neither)."""

    cfg: fm.SD3FlowConfig
    loss: LossConfig
    name: str = FLOW_MATCHING
    predict_options: dict[str, Any] = field(default_factory=dict)

    def example(
        self, latents: Tensor, generator: torch.Generator | None = None, *, timesteps: Tensor | None = None
    ) -> Example:
        """``timesteps`` given (B,): σ = timesteps / 1000 for every sample, no timestep draw."""
        if latents.ndim != 4:
            raise ValueError(f"latents must be (B, C, H, W), got shape {tuple(latents.shape)}")
        device, batch = latents.device, latents.shape[0]
        draw = generator.device if generator is not None else device
        noise = torch.randn(tuple(latents.shape), generator=generator, device=draw, dtype=torch.float32).to(device)
        if timesteps is None:
            sigmas, timesteps = fm.sample_sd3_timesteps(self.cfg, batch, generator, device)
        elif timesteps.shape != (batch,):
            raise ValueError(f"timesteps must have shape ({batch},), got {tuple(timesteps.shape)}")
        else:
            timesteps = timesteps.to(device, torch.float32)
            sigmas = timesteps / fm.NUM_TRAIN_TIMESTEPS
        noisy = fm.noisy_input(latents, noise, sigmas).to(latents.dtype)
        return Example(noisy, latents.float(), timesteps, noise, sigmas)

    def prediction(self, output: Tensor, example: Example) -> Tensor:
        """The x0 estimate ``x_σ - σ o``."""
        noisy = example.noisy.to(output.device, output.dtype)
        return fm.apply_model_prediction_type("sigma_scaled", output, noisy, example.sigmas)

    def weighting(self, example: Example) -> Tensor | None:
        """(B, 1, 1, 1) loss weight from ``--weighting_scheme`` (sigma_sqrt, cosmap), or None for 1."""
        weight = fm.loss_weighting(self.cfg.weighting_scheme, example.sigmas)
        return None if weight is None else weight.view(-1, 1, 1, 1)

    def loss_per_sample(
        self,
        pred: Tensor,
        example: Example,
        *,
        loss_weights: Tensor | None = None,
        mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """:func:`library.losses.weighted_loss_per_sample` with :meth:`weighting` per element."""
        return _flow_loss(self.loss, self.weighting(example), pred, example, loss_weights, mask, generator)

    def validation_timesteps(self) -> list[int]:
        """sd-scripts' fixed validation timesteps ``linspace(t_min, t_max, 6)[1:-1]`` (its SD3 path reads the
        min/max_timestep its validation loop sets)."""
        lo, hi = self.cfg.timestep_range
        points = torch.linspace(lo, hi, NUM_VALIDATION_TIMESTEPS + 2)[1:-1]
        return [int(v) for v in points.round().tolist()]

    def metadata(self) -> dict[str, Any]:
        """sd-scripts' SD3 objective keys (``sd3_train_network.py: update_metadata``) and ``ss_training_shift``."""
        c = self.cfg
        return {"ss_weighting_scheme": c.weighting_scheme, "ss_logit_mean": c.logit_mean,
                "ss_logit_std": c.logit_std, "ss_mode_scale": c.mode_scale,
                "ss_training_shift": c.training_shift}  # fmt: skip

    def to(self, device: torch.device | str) -> SD3FlowObjective:
        return self


def _flow_loss(loss: LossConfig, weights: Tensor | None, pred: Tensor, example: Example, loss_weights: Tensor | None,
               mask: Tensor | None, generator: torch.Generator | None) -> Tensor:  # fmt: skip
    """The flow objectives' loss: ``--loss_type`` (huber schedules constant / exponential on the float timesteps, as
    sd-scripts), the objective's ``weights`` per element, mask, prior weights; no SNR weighting."""
    target = example.target.to(pred.device)
    check_shapes(pred, target, example.timesteps)
    huber_c = None
    if loss.loss_type in ("huber", "smooth_l1"):
        huber_c = huber_c_by_timestep(example.timesteps, loss, fm.NUM_TRAIN_TIMESTEPS)
    return weighted_loss_per_sample(pred, target, loss, huber_c=huber_c, element_weights=weights,
                                    loss_weights=loss_weights, mask=mask, generator=generator)  # fmt: skip


# Flags sd-scripts reads only on its DDPM path: its flow trainers accept them and change nothing
# (flux_train_network.py: noise = randn_like, post_process_loss returns the loss as is; min/max_timestep unread).
FLOW_IGNORED_NOISE_FLAGS = ("noise_offset", "noise_offset_random_strength", "adaptive_noise_scale",
                            "multires_noise_iterations", "multires_noise_discount", "zero_terminal_snr",
                            "min_timestep", "max_timestep")  # fmt: skip
FLOW_IGNORED_LOSS_FLAGS = ("min_snr_gamma", "v_pred_like_loss", "debiased_estimation_loss",
                           "scale_v_pred_loss_like_noise_pred")  # fmt: skip


def _changed(cfg: Any, names: tuple[str, ...]) -> list[str]:
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    return [f"--{name}" for name in names if getattr(cfg, name) != defaults[name]]


def ignored_flow_flags(noise: NoiseConfig, loss: LossConfig) -> list[str]:
    """The flags given (not at their defaults) that flow matching does not read, as sd-scripts ignores them (SD3:
    it reads --min/max_timestep, and ignores --ip_noise_gamma)."""
    names = FLOW_IGNORED_NOISE_FLAGS
    if isinstance(noise.flow, fm.SD3FlowConfig):
        names = tuple(n for n in names if n not in ("min_timestep", "max_timestep"))
        names += ("ip_noise_gamma", "ip_noise_gamma_random_strength")
    return _changed(noise, names) + _changed(loss, FLOW_IGNORED_LOSS_FLAGS)


SIGMA_SCALED_WARNING = (
    "--model_prediction_type sigma_scaled (sd-scripts' default, kept so command lines train as they did) compares "
    "x_σ - σ·output, an x0 estimate, with the velocity target ε - x0; sd-scripts' docs recommend "
    "--model_prediction_type raw"
)


def flow_matching_objective(
    title: str, noise: NoiseConfig, loss: LossConfig, predict_options: dict[str, Any] | None = None
) -> FlowMatchingObjective:
    """The flow-matching objective of a run: ``noise.flow`` (the script's flow flags) with ``loss``;
    ``predict_options``: what every training step gives the family's ``predict`` (FLUX.1-dev's guidance).

    Warns once naming the flags flow matching ignores (as sd-scripts, which ignores them silently), and once for
    ``--model_prediction_type sigma_scaled``. Raises ValueError for ``--huber_schedule snr`` with a Huber loss (no
    DDPM SNR here; sd-scripts raises too) and when the script has no flow-matching flags.
    """
    _check_flow(title, noise, loss, fm.FlowMatchingConfig, "add_flow_matching_args")
    if noise.flow.model_prediction_type == "sigma_scaled":
        logger.warning(SIGMA_SCALED_WARNING)
    return FlowMatchingObjective(noise.flow, loss, predict_options=dict(predict_options or {}))


def sd3_flow_objective(title: str, noise: NoiseConfig, loss: LossConfig) -> SD3FlowObjective:
    """SD3's flow-matching objective of a run: ``noise.flow`` (the script's SD3 flags, ``add_sd3_flow_args``) with
    ``loss``; the same warning and refusals as :func:`flow_matching_objective`."""
    _check_flow(title, noise, loss, fm.SD3FlowConfig, "add_sd3_flow_args")
    return SD3FlowObjective(noise.flow, loss)


def _check_flow(title: str, noise: NoiseConfig, loss: LossConfig, kind: type, flags: str) -> None:
    if not isinstance(noise.flow, kind):
        raise ValueError(
            f"{title} trains by flow matching, but this script has no flow-matching flags for it: its parser needs "
            f"library.flow_matching.{flags} (use the script of this model's family)"
        )
    if loss.loss_type in ("huber", "smooth_l1") and loss.huber_schedule == "snr":
        raise ValueError(
            f"--loss_type {loss.loss_type} with --huber_schedule snr needs a DDPM schedule's SNR, which {title}'s "
            "flow-matching objective does not have; add --huber_schedule constant or exponential"
        )
    ignored = ignored_flow_flags(noise, loss)
    if ignored:
        logger.warning("%s: flow matching ignores %s (as sd-scripts does); the run goes on without them", title,
                       ", ".join(ignored))  # fmt: skip
