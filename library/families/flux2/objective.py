"""FLUX.2's objective: musubi-tuner's rectified flow (``training/trainer_base.py:
get_noisy_model_input_and_timesteps`` and ``flux_2_train_network.py: call_dit``), the shared
:mod:`library.objectives.musubi_flow` with FLUX.2's laws.

``--timestep_sampling`` ``flux_shift`` / ``qwen_shift``: S = e^μ, μ linear in (h/2)(w/2) of the latents (FLUX.1:
(256, 0.5)–(4096, 1.15); Qwen-Image: (256, 0.5)–(8192, 0.9)); ``flux2_shift`` (musubi-tuner's recommended choice for
FLUX.2): μ linear in h·w of FLUX.2's already patched latents through (256, 0.5)–(4096, 1.15). The DiT is given
(1000 t + 1) / 1000, as musubi-tuner adds 1 to the timesteps before ``call_dit`` divides them by 1000 (σ itself on
the ``sigma`` path).

Refused with a message (not implemented here): ``qinglong_*``, ``krea2_shift``, ``ideogram4_shift``;
``--weighting_scheme sigma_sqrt / cosmap``; ``--preserve_distribution_shape``, ``--num_timestep_buckets``.
"""

from __future__ import annotations

from library.objectives.flow import ShiftLine
from library.objectives.musubi_flow import MusubiFlowConfig, MusubiFlowLaws, MusubiFlowObjective

FLUX_POINTS = ((256, 0.5), (4096, 1.15))
LAWS = MusubiFlowLaws(
    title="FLUX.2",
    lines={
        "flux_shift": ShiftLine(FLUX_POINTS),
        "flux2_shift": ShiftLine(FLUX_POINTS, patch=1),  # FLUX.2's latents are patched already: read at h·w
        "qwen_shift": ShiftLine(((256, 0.5), (8192, 0.9))),
    },
    refused=("qinglong_flux", "qinglong_qwen", "krea2_shift", "ideogram4_shift"),
    hint="--timestep_sampling flux2_shift (musubi-tuner's documented choice for FLUX.2), or shift with "
    "--discrete_flow_shift",
    lines_help="flux2_shift (recommended), flux_shift, qwen_shift (resolution-dependent shift)",
)
add_flow_args = LAWS.add_args
objective_problems = LAWS.problems


class Flux2FlowConfig(MusubiFlowConfig):
    """FLUX.2's objective settings (musubi-tuner's flag names and defaults)."""

    laws = LAWS


class Flux2FlowObjective(MusubiFlowObjective):
    """The objective of a FLUX.2 run (module docstring)."""


flux2_objective = Flux2FlowObjective.for_run
