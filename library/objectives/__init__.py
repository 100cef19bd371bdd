"""Training objectives: what is noised how, what the model output is compared with, how the loss is weighted.

``base`` (the :class:`Objective` protocol the step asks, :class:`Example`, the objective names), ``noising`` and
``losses`` (the shared noise and loss flags and functions), ``ddpm`` (epsilon / v-prediction, SD 1.x / 2.x / SDXL),
``flow`` (rectified flow's shared math; each flow-matching family's own variant and flags live in its folder,
``library/families/<family>/objective.py``), ``musubi_flow`` (musubi-tuner's objective, configured by the families it
trains) and ``sdscripts_flow`` (sd-scripts' flow objective with ``--model_prediction_type``, configured likewise).
"""

from .base import EPSILON, FLOW_MATCHING, OBJECTIVES, V_PREDICTION, Example, Objective

__all__ = ["EPSILON", "FLOW_MATCHING", "OBJECTIVES", "V_PREDICTION", "Example", "Objective"]
