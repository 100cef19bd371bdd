"""Qwen-Image's objective: musubi-tuner's rectified flow (``training/trainer_base.py:
get_noisy_model_input_and_timesteps`` and ``qwen_image_train_network.py: call_dit``), the shared
:mod:`library.objectives.musubi_flow` with Qwen-Image's laws.

``--timestep_sampling`` ``flux_shift`` / ``qwen_shift``: S = e^μ, μ linear in the packed sequence length (h/2)(w/2)
(FLUX.1: (256, 0.5)–(4096, 1.15); Qwen-Image: (256, 0.5)–(8192, 0.9)). The DiT is given (1000 t + 1) / 1000, as
musubi-tuner adds 1 to the timesteps before ``call_dit`` divides them by 1000 (σ itself on the ``sigma`` path).

Refused with a message (not implemented here): ``qinglong_*``, ``flux2_shift``, ``krea2_shift``, ``ideogram4_shift``;
``--weighting_scheme sigma_sqrt / cosmap``; ``--preserve_distribution_shape``, ``--num_timestep_buckets``.
"""

from __future__ import annotations

from library.objectives.flow import ShiftLine
from library.objectives.musubi_flow import MusubiFlowConfig, MusubiFlowLaws, MusubiFlowObjective

LAWS = MusubiFlowLaws(
    title="Qwen-Image",
    lines={"flux_shift": ShiftLine(((256, 0.5), (4096, 1.15))), "qwen_shift": ShiftLine(((256, 0.5), (8192, 0.9)))},
    refused=("qinglong_flux", "qinglong_qwen", "flux2_shift", "krea2_shift", "ideogram4_shift"),
    hint="--timestep_sampling shift with --discrete_flow_shift (musubi-tuner's documented 2.2), or qwen_shift",
    lines_help="flux_shift, qwen_shift (resolution-dependent shift)",
)
add_flow_args = LAWS.add_args
objective_problems = LAWS.problems


class QwenFlowConfig(MusubiFlowConfig):
    """Qwen-Image's objective settings (musubi-tuner's flag names and defaults)."""

    laws = LAWS


class QwenFlowObjective(MusubiFlowObjective):
    """The objective of a Qwen-Image run (module docstring)."""


qwen_objective = QwenFlowObjective.for_run
