"""The memory watch (library/run/memory_watch.py): a run whose steps suddenly slow down, whose card is full or whose
host is short of memory warns once, with the cause and the flags that avoid it; a normal run never does.

Oracles: a fake clock that the real loop advances (each batch costs a known time, a sampling round a long one), so the
step times the watch sees and logs are known exactly; the simulated device's count of what the run holds as the
card's reserved bytes.
"""

from __future__ import annotations

import argparse
import logging

import pytest

import train_network
from library.run import memory_watch
from library.run.memory_watch import DeviceMemory, GiB, HostMemory, MemoryWatch, WatchConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps(watch: MemoryWatch, clock: FakeClock, seconds: list[float]) -> list[dict]:
    out = []
    for step, s in enumerate(seconds, start=watch.steps + 1):
        clock.now += s
        out.append(watch.step_done(step))
        clock.now += 50.0  # a save / sampling round after the step: not step time
        watch.restart()
    return out


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "memory watch" in r.getMessage()]


def test_a_jump_in_step_time_warns_once_after_several_slow_steps(caplog):
    clock = FakeClock()
    watch = MemoryWatch(clock=clock, host=None, given={"gradient_checkpointing": True, "train_batch_size": 4})
    logged = _steps(watch, clock, [30.0] + [1.0] * 9 + [2.5] * 3)  # a slow first step, then 2.5x: no jump
    assert _warnings(caplog) == [] and all("memory/warning" not in v for v in logged)
    assert [v["memory/step_time_s"] for v in logged[-3:]] == [2.5, 2.5, 2.5]
    logged = _steps(watch, clock, [1.0, 9.0, 9.0, 9.0, 1.0, 9.0, 9.0, 9.0])  # broken off, then 3 in a row: not yet 4
    assert _warnings(caplog) == []
    logged = _steps(watch, clock, [9.0, 9.0, 12.0, 12.0])  # the 4th in a row warns, once
    (message,) = _warnings(caplog)
    assert "memory watch: steps became 9x slower at step 22" in message and "4 steps in a row" in message
    assert "Sysmem Fallback" in message and "the host swapping" in message
    assert "--cache_latents" in message and "--fp8_base" in message and "AdamW8bit" in message
    assert "--gradient_checkpointing" not in message and "a smaller --train_batch_size" in message
    assert "--plan_memory --vram GB" in message and "--blocks_to_swap" not in message
    assert [("memory/warning" in v) for v in logged] == [True, False, False, False]


def test_a_full_card_warns_once_and_names_the_spill():
    total = 8 * GiB
    readings = iter([DeviceMemory(5 * GiB, 3 * GiB, total)] * 3 + [DeviceMemory(total - 100 * 2**20, 0, total)] * 3)
    clock = FakeClock()
    watch = MemoryWatch(clock=clock, device=lambda: next(readings), host=None, given={"fp8_base": True},
                        swappable=True)  # fmt: skip
    logged = _steps(watch, clock, [1.0] * 6)
    warned = [v["memory/warning"] for v in logged if "memory/warning" in v]
    assert len(warned) == 1 and "step 4" in warned[0] and "spills device memory into shared system memory" in warned[0]
    assert "--blocks_to_swap N" in warned[0] and "--fp8_base" not in warned[0]
    assert logged[0]["memory/device_reserved_gib"] == 5.0 and logged[0]["memory/device_free_gib"] == 3.0
    # steps that slow down as the card fills: one warning that says both
    readings = iter([DeviceMemory(5 * GiB, 3 * GiB, total)] * 2 + [DeviceMemory(total, 0, total)] * 2)
    watch = MemoryWatch(WatchConfig(warmup=0, baseline=2, consecutive=1), clock=clock, device=lambda: next(readings),
                        host=None)  # fmt: skip
    warned = [v["memory/warning"] for v in _steps(watch, clock, [1.0, 1.0, 20.0, 20.0]) if "memory/warning" in v]
    assert len(warned) == 1 and "20x slower at step 3" in warned[0] and "The card is at its limit" in warned[0]


def test_host_short_of_memory_or_swapping_warns_once(tmp_path):
    readings = iter([HostMemory(20 * GiB, 32 * GiB, 0), HostMemory(10 * GiB, 32 * GiB, 2 * GiB)])
    clock = FakeClock()
    cfg = WatchConfig(host_every=2)
    watch = MemoryWatch(cfg, clock=clock, host=lambda: next(readings), given={"cache_latents": True})
    logged = _steps(watch, clock, [1.0] * 4)  # read at steps 1 and 3: swap grew by 2 GiB
    assert [v.get("memory/host_available_gib") for v in logged] == [20.0, None, 10.0, None]
    (warned,) = [v["memory/warning"] for v in logged if "memory/warning" in v]
    assert "swap in use grew by 2.0 GiB" in warned and "--cache_latents_to_disk" in warned
    # before the caches are filled: 0.9 of 32 GiB available (under 5 %), then no second warning in the steps
    readings = iter(
        [HostMemory(4 * GiB, 32 * GiB, 0), HostMemory(GiB * 9 // 10, 32 * GiB, 0)] + [HostMemory(GiB, 32 * GiB, 0)] * 2
    )
    watch = MemoryWatch(cfg, clock=clock, host=lambda: next(readings), given={"cache_text_encoder_outputs": True})
    assert watch.check_host("before caching") is None
    warned = watch.check_host("after caching")
    assert warned.startswith("memory watch (after caching): The host is short of memory (0.9 of 32.0 GiB available)")
    assert "--cache_text_encoder_outputs_to_disk" in warned and "--cache_latents_to_disk" not in warned
    assert all("memory/warning" not in v for v in _steps(watch, clock, [1.0] * 3))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:   10 kB\nMemAvailable:    400 kB\nSwapTotal: 50 kB\n"
                       "SwapFree: 20 kB\n")  # fmt: skip
    assert memory_watch._proc_meminfo(meminfo) == HostMemory(400 * 1024, 1000 * 1024, 30 * 1024)
    assert memory_watch._proc_meminfo(tmp_path / "missing") is None


# ------------------------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def model(tiny_dir):
    return tiny_dir / "sd1"


def _argv(model, data, out, *extra, sample=True, steps=9):
    prompts = out / "prompts.txt"
    out.mkdir(parents=True, exist_ok=True)
    prompts.write_text("a shape --w 64 --h 64 --s 1\n")
    sampling = ["--sample_prompts", str(prompts), "--sample_every_n_steps", "2"] if sample else []
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension",
            ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "t", "--network_module",
            "networks.lora", "--network_dim", "2", "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0",
            "--seed", "1", *sampling, *extra]  # fmt: skip


@pytest.fixture
def timed(monkeypatch):
    """The loop's clock is fake: a batch costs 1 s (``slow_from``: 10 s from that step on), a sampling round 100 s;
    the watch judges after 2 steps of warm-up and 3 of baseline, 3 slow steps in a row."""
    from library import sampling
    from library.run import loop

    clock, state = FakeClock(), {"slow_from": None, "batches": 0}
    monkeypatch.setattr(memory_watch, "CLOCK", clock)
    monkeypatch.setattr(WatchConfig, "from_args", classmethod(lambda cls, args: cls(
        enabled=not args.no_memory_watch, warmup=2, baseline=3, consecutive=3)))  # fmt: skip
    batch_loss = loop.batch_loss

    def costly(*args, **kwargs):
        state["batches"] += 1
        slow = state["slow_from"] is not None and state["batches"] >= state["slow_from"]
        clock.now += 10.0 if slow else 1.0
        return batch_loss(*args, **kwargs)

    def sampling_round(*args, **kwargs):
        clock.now += 100.0
        return []

    monkeypatch.setattr(loop, "batch_loss", costly)
    monkeypatch.setattr(sampling, "sample_during_training", sampling_round)
    return state


def test_a_run_whose_steps_slow_down_warns_once_and_logs_it(model, dataset, tmp_path, timed, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    timed["slow_from"] = 6
    logs = tmp_path / "logs"
    result = train_network.run(_argv(model, dataset, tmp_path / "out", "--logging_dir", str(logs)))
    assert result.steps == 9
    (message,) = _warnings(caplog)
    assert "10x slower at step 8" in message and "3 steps in a row" in message and "--plan_memory" in message
    events = EventAccumulator(str(next(logs.rglob("events.out.*")).parent), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    times = [e.value for e in events.Scalars("memory/step_time_s")]
    assert times == [1.0] * 5 + [10.0] * 4  # the 100 s sampling rounds are not step time
    (text,) = [t for t in events.Tags()["tensors"] if t.startswith("memory/warning")]
    assert [e.step for e in events.Tensors(text)] == [8]


def test_a_normal_run_never_warns(model, dataset, tmp_path, timed, caplog):
    """Its sampling rounds take 100x a step: they are not step time."""
    result = train_network.run(_argv(model, dataset, tmp_path / "a"))
    assert result.steps == 9 and _warnings(caplog) == []


def test_the_switch_turns_the_watch_off():
    from types import SimpleNamespace

    parser = argparse.ArgumentParser()
    memory_watch.add_memory_watch_args(parser)
    off, on = (WatchConfig.from_args(parser.parse_args(a)) for a in (["--no_memory_watch"], []))
    unwatched = memory_watch.for_run(SimpleNamespace(family=None, args={}, memory_watch=off), None)
    assert not isinstance(unwatched, MemoryWatch) and unwatched.step_done(1) == {}
    assert isinstance(memory_watch.for_run(SimpleNamespace(family=None, args={}, memory_watch=on), None), MemoryWatch)


def test_a_full_simulated_card_warns_once(model, dataset, tmp_path, monkeypatch, caplog):
    """The simulated device's count of what the run holds stands in for the allocator's reserved bytes, on a card
    100 MiB larger than that: the run warns once, at its first step."""
    from library.measure.simulated_device import simulated_device

    with simulated_device() as sim:
        held = lambda: sim.live_bytes["meta"]  # noqa: E731
        card = lambda: DeviceMemory(held(), 100 * 2**20, held() + 100 * 2**20)  # noqa: E731
        monkeypatch.setattr(memory_watch, "cuda_memory", lambda device: card if device.type == "meta" else None)
        train_network.run(_argv(model, dataset, tmp_path / "out", "--mixed_precision", "bf16", sample=False, steps=1))
    (message,) = _warnings(caplog)
    assert "memory watch (step 1): The card is at its limit" in message and "--gradient_checkpointing" in message
