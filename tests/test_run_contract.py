"""The run layer's two seams: every method config a training script hands to ``library.run.config.read_config`` satisfies
``MethodConfig`` (library/run/method.py), and every Trainable the loop trains satisfies ``Trainable``
(library/run/trainable.py): members present, methods callable as the Protocol declares them. The set-up reads the
method config through these members only (no ``getattr`` fallbacks), so a config missing one fails here, not in a run.
"""

from __future__ import annotations

import copy
import inspect
from typing import Protocol

import pytest

import train_network
from library.families.full_training import PlainRules
from library.run.method import MethodConfig, NothingTrained, method_members
from library.run.model_trainable import ModelTrainable, ModelTrainingConfig
from library.run.token_embeddings import TextualInversionConfig, TokenEmbeddings
from library.run.trainable import Trainable, TrainableSet
from networks.controlnet import ControlNet
from networks.controlnet_config import ControlNetConfig
from networks.lllite import LLLiteNetwork
from networks.lllite_config import LLLiteConfig
from networks.network import AdapterNetwork


def protocol_members(protocol: type) -> tuple[str, ...]:
    annotated = tuple(getattr(protocol, "__annotations__", {}))
    declared = tuple(k for k in vars(protocol) if not k.startswith("_") and k not in annotated)
    return annotated + declared


def problems(protocol: type[Protocol], obj: object) -> list[str]:
    """Members of ``protocol`` that ``obj`` (a class or an instance) lacks, or whose methods cannot be called with
    the Protocol's parameters (required ones only, then all named ones)."""
    out = []
    for name in protocol_members(protocol):
        declared = vars(protocol).get(name)
        if not hasattr(obj, name):
            out.append(f"{name}: missing")
            continue
        if not inspect.isfunction(declared):
            continue
        theirs = getattr(obj, name)
        if not callable(theirs):
            out.append(f"{name}: not callable")
            continue
        params = list(inspect.signature(declared).parameters.values())[1:]
        signature = inspect.signature(theirs)
        if isinstance(obj, type):  # an unbound function: bind self too
            params = [None, *params]
        for required_only in (True, False):
            args = [object() for p in params if p is None or (p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                                            and not (required_only and p.default is not p.empty))]  # fmt: skip
            try:
                signature.bind(*args)
            except TypeError as e:
                out.append(f"{name}{signature}: {e}")
    return out


METHOD_CONFIGS = [
    train_network.AdapterMethod,
    TextualInversionConfig,
    ModelTrainingConfig,
    NothingTrained,
    LLLiteConfig,
    ControlNetConfig,
]


def test_method_members_are_the_protocol():
    assert set(method_members()) == {"trains_text_encoder", "trained_parts", "fused_backward_pass",
                                     "no_token_padding", "resume_settings", "with_text_cached", "deepspeed_plugin", "check_plan"}  # fmt: skip


@pytest.mark.parametrize("config", METHOD_CONFIGS, ids=lambda c: c.__name__)
def test_every_method_config_satisfies_the_protocol(config):
    assert problems(MethodConfig, config) == []


def test_a_config_without_a_member_is_caught():
    class Partial:
        trains_text_encoder = False

        def check_plan(self, plan, extra):  # needs one argument more than the Protocol gives
            return []

    found = problems(MethodConfig, Partial)
    assert any(p.startswith("trained_parts: missing") for p in found)
    assert any(p.startswith("check_plan") and "missing" in p for p in found)


def test_method_configs_answer_what_the_run_reads(tiny_dir):
    """The answers differ where the recipes do: adapters and embeddings train no part's own weights; a fine-tune of
    the UNet does, and asks for DeepSpeed only with --deepspeed."""
    adapter = train_network.AdapterMethod.from_args(
        train_network.build_parser().parse_args(["--network_module", "networks.lora"])
    )
    assert (adapter.trained_parts, adapter.fused_backward_pass, adapter.no_token_padding) == ((), False, False)
    assert adapter.deepspeed_plugin(None) is None and adapter.check_plan(None) == []
    assert adapter.resume_settings()["dim"] == adapter.network.dim  # what --resume compares
    fine = ModelTrainingConfig(PlainRules(text_encoder_lrs=None))
    assert fine.resume_settings() == {} and NothingTrained().resume_settings() == {}
    assert fine.trained_parts == ("denoiser",) and fine.trains_text_encoder is False
    assert fine.deepspeed_plugin(None) is None
    ti = TextualInversionConfig("sks")
    assert ti.trains_text_encoder is True and ti.trained_parts == ()


TRAINABLES = [AdapterNetwork, TokenEmbeddings, ModelTrainable, LLLiteNetwork, ControlNet]


@pytest.mark.parametrize("cls", TRAINABLES, ids=lambda c: c.__name__)
def test_every_trainable_satisfies_the_protocol(cls):
    assert problems(Trainable, cls) == []
    assert cls.gradient_sync in ("manual", "accelerate")
    assert cls.kind in ("network", "embedding", "model")


def test_a_trainable_set_satisfies_the_protocol(tiny_parts):
    from _networks_helpers import adapter_roots, make_config

    from networks.inject import inject

    network = inject(make_config(dim=2), adapter_roots(tiny_parts["sd1"]))
    try:
        bundle = TrainableSet([network])
        assert problems(Trainable, bundle) == []
        assert (bundle.kind, bundle.modelspec_kind, bundle.sparse_gradients) == ("network", "lora", False)
    finally:
        network.eject()


def _step_models(denoiser):
    from library.run.train_step import StepModels

    return StepModels(None, None, None, None, None, denoiser, train_text_encoder=True)


def test_trainables_change_the_step_only_through_step_models(tiny_parts):
    """A fine-tune's wrapped model and stopped text encoders, and a token's caption rewrite, reach the step through
    ``step_models``; the run's own StepModels is never written."""
    import torch

    from library.families.sd import SD1
    from library.run.token_embeddings import caption_rewriter

    parts = copy.deepcopy(tiny_parts["sd1"])  # the trainable makes the model trainable: not the shared one
    base = _step_models(parts.denoiser)
    model = ModelTrainable(
        SD1, parts, ModelTrainingConfig(PlainRules(text_encoder_lrs=(1e-5,)), stop_text_encoder_training=2)
    )
    assert model.step_models(base) is base  # nothing prepared, nothing stopped yet
    model.wrapped = wrapped = torch.nn.Identity()
    model.steps_done += 2
    model._apply_text_encoder_stop()  # step 2 >= stop 2
    changed = model.step_models(base)
    assert changed.denoiser is wrapped and changed.train_text_encoder is False
    assert base.denoiser is parts.denoiser and base.train_text_encoder is True  # the run's inputs are untouched

    class Token:  # a stand-in with TokenEmbeddings' step_models (the real one needs the token added to parts)
        caption_rewrite = None
        step_models = TokenEmbeddings.step_models

    token = Token()
    assert token.step_models(base) is base
    token.caption_rewrite = rewrite = caption_rewriter([], ())
    assert token.step_models(base).caption_rewrite is rewrite and base.caption_rewrite is None
