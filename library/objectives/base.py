"""What a training objective is: the protocol the training step asks, its example, and the objective names.

A family hands the step one :class:`Objective` per run (``ModelFamily.training_objective``); the step
(``library/run/train_step.py``) asks it and never tests a bool::

    ex = objective.example(latents, generator)              # noise, timesteps / σ, noisy input, target
    out = family.predict(denoiser, ex.noisy, ex.timesteps, cond, **objective.predict_options)
    loss = objective.loss_per_sample(objective.prediction(out, ex), ex, loss_weights=..., mask=...)

The DDPM objective (SD 1.x / 2.x / SDXL) is :mod:`library.objectives.ddpm`; rectified flow's shared math is
:mod:`library.objectives.flow`, and each flow-matching family's variant is its own
(``library/families/<family>/objective.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

# The training objectives a family can state (``ModelFamily.objective``): what the denoiser is trained to predict.
EPSILON = "epsilon"  # the noise (DDPM)
V_PREDICTION = "v_prediction"  # v = sqrt(a_t) noise - sqrt(1 - a_t) x0 (Salimans & Ho 2022)
FLOW_MATCHING = "flow_matching"  # the velocity noise - x0 of a rectified flow (SD3, FLUX)
OBJECTIVES = (EPSILON, V_PREDICTION, FLOW_MATCHING)

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
    """One of :data:`OBJECTIVES` (epsilon, v_prediction, flow_matching): what the model predicts,
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
