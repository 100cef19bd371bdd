"""Z-Image's objective: musubi-tuner's rectified flow (``training/trainer_base.py:
get_noisy_model_input_and_timesteps`` and ``zimage_train_network.py: call_dit``), the shared
:mod:`library.objectives.musubi_flow` with Z-Image's laws (the ones musubi-tuner's trainer shares across its
families: ``flux_shift`` / ``qwen_shift``, μ linear in the packed sequence length (h/2)(w/2) through
(256, 0.5)–(4096, 1.15) / (256, 0.5)–(8192, 0.9)).

Timesteps 1000 t + 1 (musubi-tuner adds 1; 1000 σ on the ``sigma`` path); the DiT is given τ = (1000 − timesteps) /
1000 (Z-Image's time runs from noise 0 to image 1) and predicts x0 − ε (musubi-tuner's target ``latents - noise``).
The family's ``predict`` negates it, so the target here is the usual velocity ε − x0: the loss (MSE, weight 1 with
``--weighting_scheme none``) is musubi-tuner's.

Refused with a message (not implemented here): ``qinglong_*``, ``flux2_shift``, ``krea2_shift``, ``ideogram4_shift``;
``--weighting_scheme sigma_sqrt / cosmap``; ``--preserve_distribution_shape``, ``--num_timestep_buckets``.
"""

from __future__ import annotations

from library.objectives.flow import ShiftLine
from library.objectives.musubi_flow import MusubiFlowConfig, MusubiFlowLaws, MusubiFlowObjective

LAWS = MusubiFlowLaws(
    title="Z-Image",
    lines={"flux_shift": ShiftLine(((256, 0.5), (4096, 1.15))), "qwen_shift": ShiftLine(((256, 0.5), (8192, 0.9)))},
    refused=("qinglong_flux", "qinglong_qwen", "flux2_shift", "krea2_shift", "ideogram4_shift"),
    hint="--timestep_sampling shift with --discrete_flow_shift (musubi-tuner's documented 2.0)",
    lines_help="flux_shift, qwen_shift (resolution-dependent shift)",
)
add_flow_args = LAWS.add_args
objective_problems = LAWS.problems


class ZImageFlowConfig(MusubiFlowConfig):
    """Z-Image's objective settings (musubi-tuner's flag names and defaults)."""

    laws = LAWS


class ZImageFlowObjective(MusubiFlowObjective):
    """The objective of a Z-Image run (module docstring)."""


zimage_objective = ZImageFlowObjective.for_run
