"""torch.profiler over training steps of any trainer whose step bar is a tqdm named "steps" (ours, sd-scripts').

    STEP_PROFILE=FIRST,COUNT,OUT PYTHONPATH=benchmarks/peer/step_profile[:...] python <trainer>.py ...

Put this folder first on PYTHONPATH (Python imports ``sitecustomize`` at start-up): when the bar reaches FIRST the
profiler starts, at FIRST + COUNT it stops and writes OUT (wall ms per step, the operators' self CPU ms per step and
their table, sorted by self CPU time) and OUT.json (a Chrome trace). Nothing happens without STEP_PROFILE. Used to
compare one family's step on both sides on the same tiny files (benchmarks/README.md, issue 40).
"""

import os
import time

_spec = os.environ.get("STEP_PROFILE")
if _spec:
    _first, _count, _out = _spec.split(",", 2)
    _first, _count = int(_first), int(_count)
    import tqdm.std as _tqdm

    _update, _state = _tqdm.tqdm.update, {}

    def _profiled_update(self, n=1):
        result = _update(self, n)
        if not str(getattr(self, "desc", "") or "").startswith("steps"):
            return result
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.n == _first:
            _state["prof"] = profile(activities=[ProfilerActivity.CPU])
            _state["prof"].__enter__()
            _state["t0"] = time.perf_counter()
        elif self.n == _first + _count and "prof" in _state:
            step_ms = (time.perf_counter() - _state["t0"]) * 1000 / _count
            _state["prof"].__exit__(None, None, None)
            events = _state["prof"].key_averages()
            ops_ms = sum(e.self_cpu_time_total for e in events) / 1000 / _count
            with open(_out, "w") as f:
                f.write(f"{step_ms:.2f} ms/step over {_count} steps; operators' self CPU {ops_ms:.2f} ms/step; "
                        f"{torch.get_num_threads()} thread(s)\n")  # fmt: skip
                f.write(events.table(sort_by="self_cpu_time_total", row_limit=45))
            _state.pop("prof").export_chrome_trace(_out + ".json")
        return result

    _tqdm.tqdm.update = _profiled_update
