"""A family whose objective is flow matching trains through the ordinary entry script with nothing else changed: a
toy family (SD1's tiny modules under a new name, registered from outside as tests/test_family_contract.py does)
hands out the flow-matching objective; train_network.py with the flow flags (``add_flow_matching_args``, what a
FLUX script adds) trains it, its step's loss is the flow formula on the step's own draws, its validation loss falls,
the flags it ignores warn once, and the file records the objective.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math

import pytest
import torch

import library.run.train_step as T
import train_network
from library.families import register_family, unregister_family
from library.families.base import FLOW_MATCHING, FamilySpec
from library.families.flux.objective import (
    SIGMA_SCALED_WARNING,
    FlowMatchingConfig,
    FlowMatchingObjective,
    add_flow_matching_args,
    flow_matching_objective,
    objective_problems,
)
from library.families.options import NoOptions
from library.families.protocol import missing_members
from library.families.sd import SD1, SDFamily
from library.files.weights import read_metadata
from library.objectives.base import Objective
from library.run import loop

TOY_SPEC = FamilySpec(
    name="toyflow",
    title="Toy flow",
    text_encoders=SD1.spec.text_encoders,
    configs={"epsilon": "sd15", "v_prediction": "sd15"},
    pipeline_class="StableDiffusionPipeline",
    training_script="toyflow_train_network.py",
    load_hint="train_network.run(argv, family_names=('toyflow',)) with the flow-matching flags",
)


@dataclasses.dataclass(frozen=True)
class ToyFlowOptions(NoOptions):
    """The toy family's own flags: the flow-matching objective's (what a FLUX script adds), read for training."""

    flow: FlowMatchingConfig | None = None

    @classmethod
    def add_args(cls, parser, *, training):
        return add_flow_matching_args(parser) if training else parser

    @classmethod
    def from_args(cls, args, *, training):
        return cls(flow=FlowMatchingConfig.from_args(args) if training else None)


class ToyFlow(SDFamily):
    """SD1's modules trained as a rectified flow: the UNet takes the float timesteps 1000 σ as they are."""

    options = ToyFlowOptions

    def load(self, path, *, options=None, **kwargs):
        parts = super().load(path, **kwargs)
        parts.options = options
        return parts

    def objective(self, parts):
        return FLOW_MATCHING

    def objective_problems(self, noise, loss, options):
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts, noise, loss):
        return flow_matching_objective(self.spec.title, parts.options.flow, noise, loss)


@pytest.fixture
def toy():
    family = ToyFlow(TOY_SPEC, version="toyflow_v1", architectures={"epsilon": "toyflow-v1"},
                     resolutions={"epsilon": 64, "v_prediction": 64}, warn_clip_skip=False)  # fmt: skip
    register_family(family)
    yield family
    unregister_family(family.name)


def hand_loss(m, batch, generator, shift: float) -> torch.Tensor:
    """The step's loss by hand, on a copy of the step's generator: x_σ = (1 - σ) x0 + σ ε with σ from
    ``--timestep_sampling shift`` (sigmoid of N(0, 1), then shifted), sigma_scaled output x_σ - σ o, target ε - x0,
    cosmap weight 2 / (π (1 - 2σ + 2σ²)), prior weights."""
    g = torch.Generator(generator.device)
    g.set_state(generator.get_state())
    with torch.no_grad():
        latents = T.batch_latents(m, batch, g)
        cond = T.batch_cond(m, batch, g)
        noise = torch.randn(latents.shape, generator=g)
        v = torch.sigmoid(torch.randn((latents.shape[0],), generator=g))
        sigma = shift * v / (1 + (shift - 1) * v)
        s = sigma.view(-1, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        out = m.denoiser(noisy, sigma * 1000, encoder_hidden_states=cond.hidden_states).sample
        weight = 2 / (math.pi * (1 - 2 * s + 2 * s**2))
        per_sample = (((noisy - s * out) - (noise - latents)) ** 2 * weight).mean(dim=(1, 2, 3))
    return per_sample * batch.loss_weights


def test_a_flow_matching_family_trains_through_train_network(toy, tiny_parts, dataset, tmp_path, monkeypatch, caplog):
    assert missing_members(toy) == []
    parts = copy.deepcopy(tiny_parts["sd1"])
    parts.family = toy.name
    model = toy.save(parts, tmp_path / "toy.safetensors")
    checked, real_loss = [], loop.batch_loss

    def checked_loss(m, batch, generator, **kwargs):
        if not checked:
            assert isinstance(m.objective, Objective) and isinstance(m.objective, FlowMatchingObjective)
            expected = hand_loss(m, batch, generator, shift=2.5)
            loss = real_loss(m, batch, generator, **kwargs)
            checked.append((loss.detach(), expected))
            return loss
        return real_loss(m, batch, generator, **kwargs)

    monkeypatch.setattr(loop, "batch_loss", checked_loss)
    steps, every = 12, 4
    argv = [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(dataset), "--caption_extension",
        ".txt", "--output_dir", str(tmp_path / "out"), "--output_name", "t", "--network_module", "networks.lora",
        "--network_dim", "4", "--network_alpha", "4", "--network_train_unet_only", "--train_batch_size", "2",
        "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0", "--seed", "1", "--optimizer_type",
        "AdamW", "--learning_rate", "3e-3", "--validation_split", "0.25", "--validate_every_n_steps", str(every),
        "--timestep_sampling", "shift", "--discrete_flow_shift", "2.5", "--weighting_scheme", "cosmap",
        "--noise_offset", "0.1",  # sd-scripts ignores it for flow matching: a warning, no effect
    ]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        result = train_network.run(argv, family_names=(toy.name,))  # the family's flags: the flow objective's

    assert result.steps == steps and result.failed is None
    loss, expected = checked[0]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)  # the step's loss is the flow formula
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith(("library.objectives", "library.families"))]
    assert len(warnings) == 2 and SIGMA_SCALED_WARNING in warnings
    assert any("--noise_offset" in w and "ignores" in w for w in warnings)
    values = [v for _, v in result.validation]
    assert [s for s, _ in result.validation] == [every, 2 * every, 3 * every] and all(map(math.isfinite, values))
    assert values[-1] < values[0]  # held-out flow-matching loss falls
    meta = read_metadata(result.output)
    assert meta["ss_base_model_version"] == "toyflow_v1"
    assert (meta["ss_timestep_sampling"], meta["ss_weighting_scheme"], meta["ss_model_prediction_type"],
            meta["ss_discrete_flow_shift"]) == ("shift", "cosmap", "sigma_scaled", "2.5")  # fmt: skip


def test_flow_validation_is_deterministic_and_draws_sigma_per_pass(toy, tiny_parts, dataset, tmp_path, monkeypatch):
    """validation_loss over the objective's passes (None: σ drawn as in training, from seeded generators): the
    same weights give the same value, another seed another one."""
    from library.run import config as run_config
    from library.run import setup as run_setup

    parts = copy.deepcopy(tiny_parts["sd1"])
    parts.family = toy.name
    model = toy.save(parts, tmp_path / "toy.safetensors")
    args = train_network.build_parser(family_names=(toy.name,)).parse_args([
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(dataset), "--caption_extension",
        ".txt", "--output_dir", str(tmp_path / "out"), "--network_module", "networks.lora", "--train_batch_size",
        "2", "--max_data_loader_n_workers", "0", "--model_prediction_type", "raw",
    ])  # fmt: skip
    cfg = run_config.read_config(args, (toy.name,), train_network.AdapterMethod.from_args)
    run = run_setup.start(cfg)
    batches = list(run.make_loader().epoch(0))[:2]
    passes = run.step_models.objective.validation_timesteps()
    first = T.validation_loss(run.step_models, batches, 5, passes)
    assert T.validation_loss(run.step_models, batches, 5, passes) == first
    assert T.validation_loss(run.step_models, batches, 6, passes) != first
    fixed = T.validation_loss(run.step_models, batches, 5, [400.0])  # a fixed 1000 σ works too
    assert math.isfinite(fixed) and fixed != first
