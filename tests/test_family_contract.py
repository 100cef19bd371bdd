"""The ModelFamily contract: every family satisfies the Protocol (members and signatures), the facts a family states
agree with each other and with what a run records, and a family registered from outside (a toy one, built here
from SD1's parts under a new name and config) trains, saves and reloads through the ordinary entry script.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import train_network
from library.families import FAMILIES, OBJECTIVES, ModelFamily, detect_family, register_family, unregister_family
from library.families.base import FamilySpec
from library.families.protocol import family_members, missing_members
from library.families.sd import SD1, SD2, SDXL, SDFamily
from library.files.weights import load_state_dict, read_metadata
from library.objectives.base import Objective
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig
from networks.inject import network_from_file
from networks.targets import builtin_preset, find_targets


def signature_problems(family: object) -> list[str]:
    """Why ``family``'s methods cannot be called as the Protocol's are (empty: every call the Protocol allows binds).

    Each Protocol method is bound twice against the family's: with only its required parameters, and with all of
    its named parameters (positional ones by position, keyword-only ones by name); ``**options`` stands for
    family-specific options and is not bound."""
    problems = []
    for name in family_members():
        declared = getattr(ModelFamily, name, None)
        if not inspect.isfunction(declared):
            continue
        params = list(inspect.signature(declared).parameters.values())[1:]  # without self
        theirs = inspect.signature(getattr(family, name))
        for required_only in (True, False):
            args, kwargs = [], {}
            for p in params:
                if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or (required_only and p.default is not p.empty):
                    continue
                if p.kind == p.KEYWORD_ONLY:
                    kwargs[p.name] = object()
                else:
                    args.append(object())
            try:
                theirs.bind(*args, **kwargs)
            except TypeError as e:
                problems.append(f"{name}{theirs}: {e}")
        named = {p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD}
        accepts_kwargs = any(p.kind == p.VAR_KEYWORD for p in theirs.parameters.values())
        missing = sorted(n for n in named if n not in theirs.parameters and not accepts_kwargs)
        if missing:
            problems.append(f"{name}{theirs}: no parameter {', '.join(missing)} (callers may pass it by name)")
    return problems


@pytest.mark.parametrize("family", [SD1, SD2, SDXL], ids=lambda f: f.name)
def test_each_family_satisfies_the_protocol(family, tiny_parts):
    assert isinstance(family, ModelFamily) and missing_members(family) == []
    assert signature_problems(family) == []
    assert FAMILIES[family.name] is family
    parts = tiny_parts[family.name]
    # the static facts agree with what the family does with a model
    assert tuple(root.prefix for root in family.adapter_roots(parts)) == family.adapter_prefixes
    assert family.ti_embedding_keys == tuple(te.ti_key for te in family.spec.text_encoders)
    assert len(family.ti_embedding_keys) == family.num_text_encoders == len(parts.text_encoders)
    assert family.objective(parts) in OBJECTIVES and family.objective(parts) == parts.prediction_type
    objective = family.training_objective(parts, NoiseConfig(), LossConfig())
    assert isinstance(objective, Objective) and objective.name == family.objective(parts)
    # the objective's own flags are the family's: its options read them, its objective refuses what it cannot train
    assert family.objective_problems(NoiseConfig(), LossConfig(), family.options()) == []
    (problem,) = family.objective_problems(NoiseConfig(timestep_sampling="sigma"), LossConfig(), family.options())
    assert "--timestep_sampling" in problem
    full = builtin_preset("full", family.target_classes)
    unet_names = [t.name for t in find_targets(family.adapter_roots(parts), full, conv=True, train_norm=False)
                  if t.is_unet]  # fmt: skip
    assert any(family.blocks.names_match(n) for n in unet_names)
    assert all(
        0 <= family.blocks.index(n) < family.blocks.num_blocks for n in unet_names if family.blocks.names_match(n)
    )
    reference = family.reference_parts()
    assert reference.family == family.name and reference.vae is None
    assert {p.device.type for p in reference.denoiser.parameters()} == {"meta"}
    assert [r.prefix for r in family.adapter_roots(reference)] == list(family.adapter_prefixes)


def test_the_checks_catch_a_family_that_breaks_the_contract():
    class Broken(SDFamily):
        def tokenize(self, parts, captions):  # drops max_token_length
            return []

    broken = Broken(SD1.spec, version="sd_v1", architectures={}, resolutions={}, warn_clip_skip=False)
    assert any(p.startswith("tokenize") for p in signature_problems(broken))
    del broken.ss_v2
    assert missing_members(broken) == ["ss_v2"]
    with pytest.raises(TypeError, match="ss_v2"):
        register_family(broken)
    with pytest.raises(ValueError, match="already registered"):
        register_family(SDFamily(SD1.spec, version="x", architectures={}, resolutions={}, warn_clip_skip=False))


def test_one_native_resolution_per_family_and_prediction():
    assert not hasattr(SD2, "resolution")  # one name for the fact: default_resolution(prediction_type)
    assert [SD1.default_resolution(p) for p in ("epsilon", "v_prediction")] == [512, 512]
    assert [SD2.default_resolution(p) for p in ("epsilon", "v_prediction")] == [512, 768]
    assert [SDXL.default_resolution(p) for p in ("epsilon", "v_prediction")] == [1024, 1024]


def _train(model, dataset, out, names, *extra):
    argv = [
        "--pretrained_model_name_or_path", str(model),
        "--train_data_dir", str(dataset),
        "--caption_extension", ".txt",
        "--output_dir", str(out),
        "--output_name", "t",
        "--network_module", "networks.lora",
        "--network_dim", "2",
        "--train_batch_size", "1",
        "--max_train_steps", "1",
        "--max_data_loader_n_workers", "0",
        "--seed", "1",
        *extra,
    ]  # fmt: skip
    return train_network.run(argv, family_names=names)


@pytest.mark.parametrize(
    "family,flags,native",
    [
        ("sd1", [], 512),
        # the tiny SD2 is a v-prediction model: without --v_parameterization the run picks its resolution before the
        # model is loaded (512, as for SD2-512) and records that; with the flag, 768 (SD2 768-v)
        ("sd2", [], 512),
        ("sd2", ["--v_parameterization"], 768),
        ("sdxl", [], 1024),
    ],
)
def test_a_run_without_resolution_records_the_resolution_it_trained_at(
    family, flags, native, tiny_dir, dataset, tmp_path, caplog
):
    names = ("sdxl",) if family == "sdxl" else ("sd1", "sd2")
    # the 64 px images kept at their size (no upscale into the native-size bucket): what is recorded is the run's
    # resolution, and the one step costs what a 64 px step does
    result = _train(tiny_dir / family, dataset, tmp_path, names, *flags, "--enable_bucket", "--bucket_no_upscale")
    meta = read_metadata(result.output)
    assert meta["ss_resolution"] == f"({native}, {native})"
    assert meta["modelspec.resolution"] == f"{native}x{native}"
    assert meta["ss_v2"] == str(family == "sd2")
    if family == "sd2" and not flags:  # the 768-v model trained at 512: said, with the fix
        assert "--resolution 768" in caplog.text


# ------------------------------------------------------------------------------------------------ a toy family
TOY_SPEC = FamilySpec(
    name="toy",
    title="Toy",
    text_encoders=SD1.spec.text_encoders,
    configs={"epsilon": "sd15", "v_prediction": "sd15"},
    pipeline_class="StableDiffusionPipeline",
    training_script="toy_train_network.py",
    load_hint="train_network.run(argv, family_names=('toy',))",
)


@pytest.fixture
def toy_family():
    toy = SDFamily(
        TOY_SPEC,
        version="toy_v1",
        architectures={"epsilon": "toy-v1", "v_prediction": "toy-v1"},
        resolutions={"epsilon": 64, "v_prediction": 64},
        warn_clip_skip=False,
    )
    register_family(toy)
    yield toy
    unregister_family("toy")


def test_a_registered_family_trains_saves_and_reloads(toy_family, tiny_parts, dataset, tmp_path):
    parts = copy.deepcopy(tiny_parts["sd1"])
    parts.family = "toy"
    model = toy_family.save(parts, tmp_path / "toy.safetensors")
    assert detect_family(model) is toy_family
    with pytest.raises(ValueError, match="Toy model"):
        SD1.load(model)

    result = _train(model, dataset, tmp_path / "out", ("toy",))  # no --resolution: the toy's native 64
    meta = read_metadata(result.output)
    assert meta["ss_base_model_version"] == "toy_v1" and meta["modelspec.architecture"] == "toy-v1/lora"
    assert meta["ss_resolution"] == "(64, 64)" and meta["ss_v2"] == "False"

    saved, _ = load_state_dict(result.output)
    network = network_from_file(result.output, toy_family.adapter_roots(toy_family.load(model)))
    again = network.state_dict_for_file()
    assert len(network) > 0 and set(again) == set(saved)
    for key, tensor in saved.items():
        assert torch.equal(again[key].to(tensor.dtype), tensor), key
