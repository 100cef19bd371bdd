"""``--plan_memory`` (library/measure/plan.py): the plan of a command, built from the files' headers without a weight
value, against the same command run with its real weights on the simulated device.

Oracle: library/measure/simulated_device.py's byte count of the real run (the tiny model's weights read and
computed on): the planned device peak of every phase equals it to the byte, for every registered family, with the
main flags spread over the families (fp8, block swap, checkpointing, both caches, batch 2). A file cut short right
after its header plans exactly like the whole file (no tensor data is read).
"""

from __future__ import annotations

import gc
import importlib
import os
from pathlib import Path

import pytest

from library.cli.plan_flags import PlanRequested
from library.families.registry import FAMILIES, get_family
from library.measure.plan import plan_command
from library.measure.simulated_device import fused_attention, simulated_device
from library.run.demo import make_example_dataset

CACHED = ["--cache_latents", "--cache_text_encoder_outputs"]
SWAP = ["--blocks_to_swap", "2"]
# family -> the flags of its case (each main flag in several families; every family once)
CASES = {
    "sd1": ["--train_batch_size", "2", "--gradient_checkpointing"],
    "sd2": CACHED,
    "sdxl": [*CACHED, "--fp8_base", "--mixed_precision", "bf16"],
    "flux-dev": [*CACHED, "--fp8_base", *SWAP, "--gradient_checkpointing", "--mixed_precision", "bf16"],
    "flux-schnell": ["--cache_latents"],
    "chroma": [*CACHED, *SWAP, "--model_type", "chroma", "--apply_t5_attn_mask"],
    "sd3": [*CACHED, *SWAP, "--gradient_checkpointing"],
    "sd3.5-medium": [*CACHED, "--train_batch_size", "2"],
    "sd3.5-large": [*CACHED, "--fp8_base", "--mixed_precision", "bf16"],
    "anima": [*CACHED, "--gradient_checkpointing"],
    "lumina2": [*CACHED, *SWAP],
    "hunyuan_image": [*CACHED, *SWAP, "--gradient_checkpointing"],
    "qwen_image": [*CACHED, "--fp8_base", "--mixed_precision", "bf16"],
    "pixart_alpha": [*CACHED, *SWAP, "--gradient_checkpointing"],
    "pixart_sigma": [*CACHED, "--mixed_precision", "bf16"],
}
# the tiny models' own options where a case swaps blocks (each list keeps 2 blocks on the device)
BUILD = {"flux-dev": {"blocks": (4, 4)}, "chroma": {"blocks": (4, 4)}, "sd3": {"blocks": 4}, "lumina2": {"layers": 4},
         "hunyuan_image": {"blocks": 4}, "pixart_alpha": {"layers": 4}}  # fmt: skip
SAMPLED = {"flux-dev", "sdxl"}  # a sampling round after the step (the others: load, caching, step, save)


def test_every_registered_family_is_planned():
    """Every family of the registry is a case (a family registered later gets both caches until it has its own)."""
    assert set(FAMILIES) <= set(cases()) and all(get_family(name).tiny is not None for name in FAMILIES)


def cases() -> dict[str, list[str]]:
    return {name: CASES.get(name, CACHED) for name in FAMILIES}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_example_dataset(tmp_path_factory.mktemp("plan_data"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One folder for the tiny models the SD1 tests share (each is built and written once, read by every run)."""
    return tmp_path_factory.mktemp("plan_models")


_WRITTEN: dict[tuple[str, Path], list[str]] = {}


def model_flags(name: str, root: Path) -> list[str]:
    """The tiny model of ``name`` as its script takes it: the diffusers folder, else the files beside the DiT
    (written once per ``root``: the runs only read it)."""
    if (name, root) in _WRITTEN:
        return list(_WRITTEN[name, root])
    family = get_family(name)
    parts = family.tiny.build(seed=0, **BUILD.get(name, {}))
    try:
        flags = ["--pretrained_model_name_or_path", str(family.tiny.write_folder(parts, root / name))]
    except ValueError:  # no folder layout: the DiT file and the files sd-scripts takes beside it
        files = family.tiny.write_files(parts, root, "tiny")
        flags = ["--pretrained_model_name_or_path", str(files.pop("dit"))]
        flags += [w for part, path in files.items() for w in (f"--{part}", str(path))]
    _WRITTEN[name, root] = flags
    return list(flags)


def command(name: str, root: Path, data: Path, out: Path) -> tuple:
    script = importlib.import_module(get_family(name).spec.training_script.removesuffix(".py"))
    prompts = root / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2\n")
    argv = [*model_flags(name, root), "--train_data_dir", str(data), "--caption_extension", ".txt",
            "--resolution", "64", "--output_dir", str(out), "--output_name", "t", "--network_module",
            "networks.lora", "--network_dim", "4",
            "--network_train_unet_only", "--learning_rate", "1e-3", "--max_train_steps", "2",
            "--max_data_loader_n_workers", "0", "--seed", "1", *cases()[name]]  # fmt: skip
    if name in SAMPLED:
        argv += ["--sample_prompts", str(prompts), "--sample_every_n_steps", "2", "--sample_sampler", "euler"]
    return script.run, argv


# the suite's CPU budget runs two cases (fp8, swap, checkpointing, both caches, sampling among them; batch 2 in the
# advice test's command); SDTRAIN_PLAN_ALL_FAMILIES=1 runs all
# thirteen (~4 min on 2 cores)
DEFAULT = {"flux-dev", "qwen_image"}
ALL = os.environ.get("SDTRAIN_PLAN_ALL_FAMILIES") == "1"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_planned_peaks_equal_the_real_run_on_the_simulated_device(name, data, tmp_path):
    if not ALL and name not in DEFAULT:
        pytest.skip("set SDTRAIN_PLAN_ALL_FAMILIES=1 to plan every family (~4 min)")
    run, argv = command(name, tmp_path, data, tmp_path / "real")
    gc.collect()  # what earlier tests left in reference cycles
    with simulated_device() as sim, fused_attention():  # as the plan counts attention
        result = run(argv)
    assert result.failed is None and result.steps == 2  # as the plan: the second step holds the optimizer state
    before = sim.baseline_bytes.get("meta", 0)  # what earlier runs of this process left on meta (none in a CLI)
    real = {phase: int(v) - before for phase, v in sim.phases.table(scale=1.0).items()}

    plan = plan_command(lambda: run([*argv, "--plan_memory"]), out=lambda line: None)
    planned = {phase: row["device_bytes"] for phase, row in plan["phases"].items()}
    assert planned == real
    assert "step" in planned and "save" in planned and (name not in SAMPLED or "sampling" in planned)


def test_a_file_cut_after_its_header_plans_like_the_whole_file(data, models, tmp_path):
    """The tiny SD1.5 model as a single file, then the file cut right after its header (the tensor data gone): the
    plan reads the header only, so both give the same plan; the real run of the cut file fails."""
    from library.measure.phantom import read_header

    family = get_family("sd1")
    parts = family.tiny.build(seed=0)
    whole = family.save(parts, tmp_path / "whole" / "tiny.safetensors")
    files = {"pretrained_model_name_or_path": whole, **family.tiny.write_files(parts, tmp_path / "whole", "tiny")}
    cut = {}
    for flag, path in files.items():
        data_start = 8 + int.from_bytes(Path(path).read_bytes()[:8], "little")
        cut[flag] = tmp_path / "cut" / Path(path).name
        cut[flag].parent.mkdir(exist_ok=True)
        cut[flag].write_bytes(Path(path).read_bytes()[:data_start])
        assert read_header(cut[flag]) == read_header(path)
    run, argv = command("sd1", models, data, tmp_path / "out")
    base = argv[argv.index("--train_data_dir") :]

    def plan_of(paths: dict) -> dict:
        flags = [w for flag, path in paths.items() for w in (f"--{flag}", str(path))]
        return plan_command(lambda: run([*flags, *base, "--plan_memory"]), out=lambda line: None)

    def device(plan: dict) -> dict:
        return {phase: row["device_bytes"] for phase, row in plan["phases"].items()}

    assert device(plan_of(cut)) == device(plan_of(files))
    with pytest.raises((ValueError, OSError, RuntimeError)):  # the cut files hold no weights: a real load fails
        with simulated_device():
            run([*[w for f, p in cut.items() for w in (f"--{f}", str(p))], *base])


def test_plan_memory_outside_a_plan_asks_for_one_and_the_plan_flags_need_it(data, models, tmp_path):
    from library.cli.problems import ConfigError

    run, argv = command("sd1", models, data, tmp_path / "out")
    with pytest.raises(PlanRequested):
        run([*argv, "--plan_memory"])
    with pytest.raises(ConfigError, match="--vram is read with --plan_memory only"):
        run([*argv, "--vram", "8"])
    assert not (tmp_path / "out").exists()


def test_the_advice_plans_each_change_on_top_of_the_ones_before(data, models, tmp_path):
    """``--vram``'s search (library/measure/advice.py) against the same flags written by hand: asked for the device
    peak that caching both outputs and checkpointing reach, it takes changes in the users' order, stops at the first
    that fits (every earlier one did not), its last plan equals the plan of the command with those flags written by
    hand, and the pasted command carries them."""
    from library.measure.advice import advise, device_peaks, paste_line

    order = [*CACHED[::-1], "--gradient_checkpointing"]  # text outputs first, then latents, then checkpointing
    run, argv = command("sd1", models, data, tmp_path / "out")
    argv = [w for w in argv if w != "--gradient_checkpointing"]
    by_hand_plans = {}

    def by_hand(flags: list[str]) -> dict:  # a command written by hand, planned once (a plan is deterministic)
        if tuple(flags) not in by_hand_plans:
            by_hand_plans[tuple(flags)] = plan_command(lambda: run([*argv, *flags, "--plan_memory"]), out=print)
        return by_hand_plans[tuple(flags)]

    target = by_hand(order)["device_peak_mib"]

    def plan_with(changes):
        return plan_command(lambda: run([*argv, "--plan_memory"]), out=lambda line: None, changes=changes)

    taken = advise(plan_with, argv, target, out=print, base=by_hand([]), peaks=device_peaks)
    flags = [t["flags"][0] for t in taken]
    assert flags and flags == order[: len(flags)]
    plan = by_hand(flags)
    assert taken[-1]["card_peak_mib"] == plan["card_peak_mib"] and plan["device_peak_mib"] <= target
    for earlier in range(1, len(flags)):
        assert by_hand(flags[:earlier])["device_peak_mib"] > target
    assert paste_line("train_network.py", argv, taken).endswith(" ".join(flags))


def test_the_advice_takes_the_change_without_a_step_time_cost_before_a_costly_one(data, models, tmp_path):
    """Asked for the step's device peak that an 8-bit optimizer reaches (a rank-64 LoRA: bitsandbytes keeps 8-bit
    state for tensors of 4096 values and more), the advice takes the 8-bit optimizer alone, before gradient
    checkpointing (which lowers the step too, at a step-time cost: in the issue's order it came first), and says it
    costs no step time."""
    from library.cli.plan_flags import changed_argv
    from library.measure.advice import advise, paste_line, total_cost

    run, argv = command("sd1", models, data, tmp_path / "out")
    argv = [
        *(w for w in argv if w != "--gradient_checkpointing"),
        *CACHED,
        "--network_dim",
        "64",
        "--train_batch_size",
        "1",
    ]
    plans = {}

    def plan_with(changes):  # the command with the changes, planned once (a plan is deterministic)
        words = tuple(changed_argv(argv, changes))
        if words not in plans:
            plans[words] = plan_command(lambda: run([*words, "--plan_memory"]), out=lambda line: None)
        return plans[words]

    def step(plan: dict) -> dict:
        return {"step": plan["phases"]["step"]["device_mib"]}

    base = plan_command(lambda: run([*argv, "--plan_memory"]), out=lambda line: None)
    state = base["phases"]["step"]["holders_mib"]["optimizer state"]
    target = step(base)["step"] - state / 8  # an eighth of AdamW's state: the 8-bit state saves more
    taken = advise(plan_with, argv, target, out=print, base=base, peaks=step)
    assert [t["flags"] for t in taken] == [["--optimizer_type", "AdamW8bit"]] and taken[0]["slowdown"] == 0.0
    (words, plan), *others = plans.items()  # the one change planned: the 8-bit optimizer, which fits
    assert not others and words[-2:] == ("--optimizer_type", "AdamW8bit") and step(plan)["step"] <= target
    assert taken[0]["card_peak_mib"] == plan["card_peak_mib"] and total_cost(taken) == "no step-time cost known"
    assert paste_line("train_network.py", argv, taken).endswith("--optimizer_type AdamW8bit")


def test_the_advice_takes_the_familys_own_flag_for_its_text_caching_phase(data, models, tmp_path):
    """A tiny Qwen-Image command whose text-caching phase is 1 byte over the limit (its steps below it): no shared
    change lowers that phase (the 8-bit optimizer lowers the steps; Qwen-Image's --fp8_base stores the DiT only), so
    the advice takes the family's own ``--fp8_vl`` (its ``caching_memory_flags``, which the command's plan carries)
    and costs no step time; the oracle is the plan of the command with ``--fp8_vl`` written by hand: its
    text-caching bytes are the advice's and fit."""
    from library.cli.plan_flags import changed_argv
    from library.measure.advice import advise, paste_line, total_cost

    run, argv = command("qwen_image", models, data, tmp_path / "out")
    plans = {}

    def plan_with(changes):  # the command with the changes written out by hand, planned once (plans are deterministic)
        words = tuple(changed_argv(argv, changes))
        if words not in plans:
            plans[words] = plan_command(lambda: run([*words, "--plan_memory"]), out=lambda line: None)
        return plans[words]

    def exact(plan: dict) -> dict:  # MiB of device tensors per phase, to the byte
        return {phase: row["device_bytes"] / 2**20 for phase, row in plan["phases"].items()}

    base = plan_with([])
    assert [f["flags"] for f in base["caching_memory_flags"]] == [["--fp8_vl"]]
    limit = exact(base)["text caching"] - 1 / 2**20
    assert max(mib for phase, mib in exact(base).items() if phase != "text caching") <= limit
    taken = advise(plan_with, argv, limit, out=print, base=base, peaks=exact)
    assert [t["flags"] for t in taken] == [["--fp8_vl"]] and taken[0]["slowdown"] == 0.0
    by_hand = plans[(*argv, "--fp8_vl")]  # the command with the flag written at its end, planned as it stands
    assert len(plans) == 2 and max(exact(by_hand).values()) <= limit
    assert taken[0]["card_peak_mib"] == by_hand["card_peak_mib"] and total_cost(taken) == "no step-time cost known"
    assert paste_line("qwen_image_train_network.py", argv, taken).endswith("--fp8_vl")


def test_demo_with_a_plan_is_refused_with_the_reason(tmp_path, monkeypatch, capsys):
    """The demo trains on the CPU: --plan_memory has no device to plan there and says so (exit 2), no traceback."""
    import train_network

    monkeypatch.chdir(tmp_path)
    assert train_network.main(["--demo", "--plan_memory"]) == 2
    out = capsys.readouterr()
    assert "--plan_memory with --demo" in out.out + out.err and "Traceback" not in out.out + out.err


def test_lllite_trainer_plans_like_its_real_run(data, tmp_path):
    """sdxl_train_control_net_lllite.py's plan (conditioning images, the LLLite modules trained) equals its real run
    on the simulated device (run with SDTRAIN_PLAN_ALL_FAMILIES=1, like the families beyond the default two)."""
    if not ALL:
        pytest.skip("set SDTRAIN_PLAN_ALL_FAMILIES=1 to plan the ControlNet-LLLite trainer too")
    import shutil

    import sdxl_train_control_net_lllite as script

    images = data / "10_sks shape"
    cond = tmp_path / "cond"
    cond.mkdir()
    for png in images.glob("*.png"):
        shutil.copy(png, cond / png.name)
    argv = [*model_flags("sdxl", tmp_path), "--train_data_dir", str(images), "--conditioning_data_dir", str(cond),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(tmp_path / "real"),
            "--cond_emb_dim", "8", "--network_dim", "4", "--learning_rate", "1e-3", "--max_train_steps", "2",
            "--max_data_loader_n_workers", "0", "--seed", "1", *CACHED]  # fmt: skip
    gc.collect()
    with simulated_device() as sim, fused_attention():
        result = script.run(argv)
    assert result.failed is None and result.steps == 2
    before = sim.baseline_bytes.get("meta", 0)
    real = {phase: int(v) - before for phase, v in sim.phases.table(scale=1.0).items()}
    plan = plan_command(lambda: script.run([*argv, "--plan_memory"]), out=lambda line: None)
    assert {phase: row["device_bytes"] for phase, row in plan["phases"].items()} == real
