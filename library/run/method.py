"""What a recipe trains, as the run layer reads it: the :class:`MethodConfig` protocol.

Every training script reads its own method flags into one frozen config (``AdapterMethod`` in train_network.py,
``TextualInversionConfig`` in library/run/token_embeddings.py, ``ModelTrainingConfig`` in library/run/model_trainable.py)
and hands its reader to ``config.read_config``. The run set-up asks the config only these members;
tests/test_run_contract.py checks every method config against this list.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MethodConfig(Protocol):
    """The run layer's whole view of a recipe's method config."""

    @property
    def trains_text_encoder(self) -> bool:
        """Whether the text encoders run with autograd (their own weights, an adapter on them, or new token rows)."""
        ...

    @property
    def trained_parts(self) -> tuple[str, ...]:
        """The parts whose own weights are trained ("denoiser", "text_encoders"): loaded in the training dtype, never
        stored in float8. Empty for adapters and embeddings, which train tensors of their own."""
        ...

    @property
    def fused_backward_pass(self) -> bool:
        """Whether the optimizer steps inside the backward pass (``--fused_backward_pass``: whole models only)."""
        ...

    @property
    def no_token_padding(self) -> bool:
        """train_db.py's ``--no_token_padding``: captions padded to the batch's longest, not to 77 tokens."""
        ...

    def resume_settings(self) -> Mapping[str, Any]:
        """The shape-giving settings a state records and ``--resume`` compares (``library.run.resume.SETTINGS``
        names; an adapter run's network config), {} when the method has none."""
        ...

    def with_text_cached(self) -> MethodConfig | None:
        """The method as it can train when every text-encoder output is cached (``--cache_text_encoder_outputs``):
        adapters placed on the text encoders by default only are left out (the denoiser's train); None when what
        trains in the encoders was asked for (``--network_train_text_encoder_only``, new tokens, whole encoders)."""
        ...

    def deepspeed_plugin(self, cfg: Any) -> Any:
        """accelerate's DeepSpeed plugin for the run (``cfg``: its TrainConfig), or None."""
        ...

    def check_plan(self, plan: Any) -> list[str]:
        """Before the model loads: notes on the dataset plan (textual inversion: captions without the token); may
        raise ``ConfigError``."""
        ...


def method_members() -> tuple[str, ...]:
    """The names of every :class:`MethodConfig` member, in declaration order."""
    return tuple(k for k in vars(MethodConfig) if not k.startswith("_"))


class NothingTrained:
    """The method config of a run that trains nothing (the caching tools read a run's model and data only)."""

    trains_text_encoder = False
    trained_parts: tuple[str, ...] = ()
    fused_backward_pass = False
    no_token_padding = False

    def resume_settings(self) -> Mapping[str, Any]:
        return {}

    def with_text_cached(self) -> None:
        return None

    def deepspeed_plugin(self, cfg: Any) -> None:
        return None

    def check_plan(self, plan: Any) -> list[str]:
        return []


class ControlModuleMethod:
    """The shared members of a method that trains a module of its own beside frozen parts (ControlNet,
    ControlNet-LLLite): the text encoders never train, so a run with cached text outputs trains the same method; no
    fused backward, no DeepSpeed, no dataset notes. Subclasses (frozen dataclasses) add their flags,
    ``resume_settings`` and ``from_args``."""

    trains_text_encoder = False
    trained_parts: tuple[str, ...] = ()  # the module is tensors of its own
    fused_backward_pass = False
    no_token_padding = False

    def resume_settings(self) -> Mapping[str, Any]:
        return {}

    def with_text_cached(self) -> Any:
        return self  # the text encoders never train

    def deepspeed_plugin(self, cfg: Any) -> None:
        return None

    def check_plan(self, plan: Any) -> list[str]:
        return []
