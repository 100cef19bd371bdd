"""``--plan_memory``: the device and host memory a training command needs, per phase, before it runs.

    python flux_train_network.py ...the run's flags... --plan_memory [--vram 12] [--ram 32] [--plan_memory_json f]
    python tools/plan_memory.py flux_train_network.py ...the run's flags...

The command runs as written, once, with three differences that change no shape and no lifetime:

* the accelerator's device is the simulated device (library/measure/simulated_device.py: ``meta``, every device
  tensor counted, CUDA's device rules enforced, attention counted as the fused kernel a GPU runs), so nothing is
  computed and no GPU is needed;
* weight files are read from their headers only (library/measure/phantom.py): every host tensor of the model is a
  phantom (the real bytes, never written), so a 24 GB checkpoint plans in seconds and reads no weight values;
* two optimizer steps (the second one's backward runs beside the optimizer state the first one made: the step's
  steady peak), one sampling round after them when the command samples, then the run's save (each tensor
  converted as for the file; the files hold their headers only), all written to a temporary folder that is removed afterwards (``--output_dir`` is replaced, and ``--cache_dir`` when the command caches
  on disk: the caches are made anew there;
  trackers, uploads and data-loader worker processes are off). The user's output folder and caches are not touched.

The table gives per phase (load, latent caching, text caching, step, sampling, save) the device peak, the host
tensors' peak (what the run allocates on the host: phantoms count their bytes) and its pinned part (page-locked
memory, as a CUDA run pins it: block swap's host copies, the loader's batch), what holds the device peak
(library/measure/holders.py), and the peak a CUDA card would reserve (library/measure/calibration.py). ``--vram`` /
``--ram`` say whether the command fits and, if not, which changes make it fit (library/measure/advice.py).

The flags are library/cli/plan_flags.py's (every training script takes them); the script's ``run`` raises
``PlanRequested`` when it reads ``--plan_memory``, and ``main_guard`` (every script's ``main``) answers it with
:func:`plan_command` (registered there when this module is imported), which runs the script again inside the plan.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from library.cli.plan_flags import PlanState, planning, register_planner

logger = logging.getLogger("sdtrain")


def plan_command(
    run: Callable[[], Any],
    out: Callable[[str], None] = print,
    script: str | None = None,
    changes: list[tuple[str, list[str]]] | None = None,
) -> dict:
    """Plan the command that ``run()`` runs (an entry script's ``run(argv)`` with ``--plan_memory`` among the
    flags): returns the plan (:func:`library.measure.plan_report.build`) after printing its table; with ``--vram``
    and a plan that does not fit, the changes that make it fit (library/measure/advice.py) and the command with
    them (``script``: its file name, default the running program's). ``changes``: flags set on top of the command."""
    from library.measure import plan_report
    from library.measure.phantom import header_only_reads, header_only_writes
    from library.measure.simulated_device import fused_attention, simulated_device
    from library.run import setup as run_setup
    from library.run.trainer import Trainer

    gc.collect()  # what earlier runs of this process left in reference cycles is not the plan's
    with tempfile.TemporaryDirectory(prefix="sdtrain-plan-") as tmp:
        out(f"plan_memory: two steps, one sampling round and one save on a simulated device; the model files are "
            f"read from their headers only (no weight values); outputs go to {tmp} (removed afterwards)")  # fmt: skip
        device = simulated_device(mode=_plan_device())
        with planning(Path(tmp), changes) as state, device as sim, fused_attention(), header_only_reads(), \
                header_only_writes():  # fmt: skip
            load_model = run_setup.load_model  # the simulated device's (which starts the step's count after it)
            family_flags: list = []  # the family's own flags that lower a caching phase (families/base.py)

            def loaded(cfg: Any, *args: Any, **kwargs: Any) -> Any:
                parts = load_model(cfg, *args, **kwargs)
                sim.parts = parts
                family_flags[:] = getattr(cfg.family, "caching_memory_flags", ())
                return parts

            run_setup.load_model = loaded
            sim.phases.listeners.append(lambda phase: out(f"plan_memory: {phase}"))
            trainer_init = Trainer.__init__

            def trainer(self: Any, run: Any, trainable: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
                sim.optimizers.add(getattr(optimizer, "optimizer", optimizer))  # accelerate's wrapper holds it
                trainer_init(self, run, trainable, optimizer, *args, **kwargs)

            Trainer.__init__ = trainer
            try:
                result = run()
            finally:
                run_setup.load_model = load_model
                Trainer.__init__ = trainer_init
        if getattr(result, "failed", None):
            raise RuntimeError(f"the planned run stopped: {result.failed}")
        plan = plan_report.build(sim, state.argv_flags)
        # the family's own flags that lower a caching phase, read by the advice (library/measure/advice.py)
        plan["caching_memory_flags"] = [{**dataclasses.asdict(f), "flags": list(f.flags)} for f in family_flags]
        sim.parts = None  # the run's model: nothing of it outlives the plan
    for line in plan_report.lines(plan):
        out(line)
    if plan.get("fits_vram") is False and changes is None:
        plan["advice"] = _advise(run, state, plan, out, script)
    path = state.argv_flags.get("plan_memory_json")
    if path:
        from library.files.weights import atomic_path

        with atomic_path(path) as tmp_path:
            tmp_path.write_text(json.dumps(plan, indent=1))
        out(f"plan_memory: wrote {path}")
    return plan


def _advise(run: Callable[[], Any], state: PlanState, plan: dict, out: Callable[[str], None], script: str | None):
    import sys

    from library.measure.advice import advise, card_peaks, paste_line, total_cost, unplanned

    vram_mib = plan["vram_gib"] * 1024
    out(
        f"changes that make it fit in {plan['vram_gib']:g} GiB, cheapest first (each planned on top of the ones before):"
    )
    taken = advise(lambda changes: plan_command(run, out=lambda line: None, changes=changes), state.argv, vram_mib,
                   out, base=plan)  # fmt: skip
    if not taken or taken[-1]["card_peak_mib"] > vram_mib:
        over = taken[-1]["over"] if taken else [p for p, mib in card_peaks(plan).items() if mib > vram_mib]
        out(f"no change found makes this command fit in {plan['vram_gib']:g} GiB (over: {', '.join(over)})"
            + unplanned(plan, over, state.argv) + "".join(_CACHE_HINTS.get(p, "") for p in over))  # fmt: skip
        return {"fits": False, "changes": taken, "over": over}
    line = paste_line(script or Path(sys.argv[0]).name, state.argv, taken)
    out(f"command that fits ({total_cost(taken)}):\n{line}")
    return {"fits": True, "changes": taken, "command": line, "cost": total_cost(taken)}


# a caching phase that holds the peak after every change: the caches made by a run of their own, which a training run
# with the caches on disk reads instead of running the encoders
_CACHE_HINTS = {
    "text caching": "; the text encoders' caching phase: cache their outputs in a run of their own "
    "(tools/cache_text_encoder_outputs.py) and train with --cache_text_encoder_outputs_to_disk",
    "latent caching": "; the VAE's caching phase: cache the latents in a run of their own (tools/cache_latents.py) and "
    "train with --cache_latents_to_disk",
}


def _plan_device() -> type:
    import torch

    from library.measure.calibration import PhaseFacts
    from library.measure.holders import PeakHolders
    from library.measure.phantom import PhantomDevice

    aten = torch.ops.aten
    kinds = {aten.mm.default: "matmul", aten.addmm.default: "matmul", aten.bmm.default: "matmul",
             aten.baddbmm.default: "matmul", aten.convolution.default: "convolution",
             aten._scaled_dot_product_flash_attention_for_cpu.default: "attention",
             aten._scaled_dot_product_efficient_attention.default: "attention",
             aten._scaled_dot_product_flash_attention.default: "attention"}  # fmt: skip

    class PlanDevice(PhantomDevice, PeakHolders):
        """The phantom simulated device that also keeps what holds each phase's peak and the facts the
        calibration needs (library/measure/calibration.py)."""

        def __init__(self, strict: bool = True) -> None:
            PhantomDevice.__init__(self, strict)
            PeakHolders.__init__(self)
            self.facts: dict[str, PhaseFacts] = {}

        def _dispatch(self, func: Any, args: tuple, kwargs: dict, tensors: list) -> Any:
            out = super()._dispatch(func, args, kwargs, tensors)
            kind = kinds.get(func)
            if kind is not None and isinstance(args[0], torch.Tensor) and args[0].is_meta:
                facts = self.facts.setdefault(self.phase, PhaseFacts())
                facts.kernels.add(kind)
                if kind == "convolution":
                    facts.largest_conv_output = max(facts.largest_conv_output, out.numel() * out.element_size())
            return out

        def __enter__(self) -> Any:
            entered = super().__enter__()
            self.before = {k for k, (where, _) in self._live.copy().items() if where == "meta"}
            return entered

        def _track(self, tensor: Any) -> None:
            super()._track(tensor)
            live = self.live_bytes["meta"]
            if live >= self.peak_bytes["meta"]:
                self.snapshot(self._live, "meta", live)

        def reset_peak(self) -> None:
            super().reset_peak()
            self.restart(self._live, "meta", self.live_bytes["meta"])

        def _read_peak(self) -> int:
            peak = super()._read_peak()
            phase = self.phases.phase
            if self.close(phase, peak):
                self.facts.setdefault(phase, PhaseFacts()).storages_at_peak = len(self._snap)
            return peak

    return PlanDevice


register_planner(plan_command)
