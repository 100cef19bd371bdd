#!/usr/bin/env bash
# Everything the project checks on a CUDA GPU, in one command, in under 10 minutes (first run, H200: ~6.5):
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # PYTHON=... picks the interpreter (default: .venv/bin/python, else python)
#
# 1. pytest -m "gpu and not slow" (bf16/fp16 families, noise/loss, 8-bit optimizers, CUDA tensor counting, ...)  47 s
# 2. benchmarks/gpu_runs.py: the tiny SD1 and SDXL demo models, 30 steps each, with --mixed_precision fp16,
#    --full_fp16 (a real GradScaler; AdamW8bit, and Adafactor), bf16, --full_bf16, --fp8_base, --fp8_base + LoCon convs + checkpointing (cuDNN's
#    conv backward), sdpa, xformers (skipped without the package) and a low-VRAM run that samples     ~3.5 min
# 3. benchmarks/bench_device_memory.py --device cuda: real-size SD1.5 at 512 px and SDXL at 1024 px (random weights,
#    made on the GPU), LoRA with --fp8_base --cache_latents --cache_text_encoder_outputs --gradient_checkpointing:
#    torch.cuda.max_memory_allocated per phase (load, caching, step, sampling, save)                  35 s each
#    (and SDXL once more with --sample_vae_tiling off: the sampling round's whole decode)
# 4. the same runs, 20 steps, bf16 without the low-VRAM flags and with them: s/step, FLOPs per step, MFU  ~2 min
#    (each family's pair only while 3 minutes of the 9-minute budget are left)
# 5. pytest -m "gpu and slow", if time is left (the budget below)
# Each step's output goes to OUT_DIR (default gpu_check_out/); OUT_DIR/results.json gathers every result (one JSON
# object); the summary is printed. A failing step is recorded and the script goes on; exit code = failures.
# Every step has a timeout and the optional ones start only while the budget lasts: 9 minutes at the very worst.
set -u
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python}; fi
OUT=${1:-gpu_check_out}
BUDGET_S=${GPU_CHECK_BUDGET_S:-540} # stop starting optional steps after this many seconds
mkdir -p "$OUT"
STARTED=$(date +%s)
: >"$OUT/steps.jsonl"

check() { # check NAME TIMEOUT_S COMMAND...: run, log to OUT/NAME.log, record status and time
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    printf '{"step": "%s", "exit": %d, "seconds": %d}\n' "$name" "$rc" "$(($(date +%s) - start))" >>"$OUT/steps.jsonl"
    if [ $rc -eq 0 ]; then echo "PASS $name ($(($(date +%s) - start)) s)"; else
        echo "FAIL $name (exit $rc): tail of $OUT/$name.log:"
        tail -n 5 "$OUT/$name.log" | sed 's/^/    /'
    fi
}
left() { echo $((BUDGET_S - ($(date +%s) - STARTED))); }

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA GPU visible to torch ($PY); nothing to check here" >&2
    exit 2
fi

check pytest_gpu 120 $PY -m pytest -m "gpu and not slow" -p no:cacheprovider -rs  # addopts has -q; -qq hides the counts
check gpu_runs 240 $PY benchmarks/gpu_runs.py --steps 30 --workdir "$OUT/gpu_runs"
for family in sd1 sdxl; do
    check "memory_$family" 75 $PY benchmarks/bench_device_memory.py --family "$family" --device cuda \
        --workdir "$OUT/memory_$family"
done
# the SDXL sampling round as before the low-memory decode (the run above tiles it: --sample_vae_tiling auto)
check memory_sdxl_whole_decode 75 $PY benchmarks/bench_device_memory.py --family sdxl --device cuda \
    --extra "--sample_vae_tiling off" --workdir "$OUT/memory_sdxl_whole_decode"
for family in sd1 sdxl; do
    if [ "$(left)" -gt 180 ]; then  # both runs fit in what is left
        check "speed_${family}_plain" 90 $PY benchmarks/bench_device_memory.py --family "$family" --device cuda \
            --steps 20 --no_sample --plain --workdir "$OUT/speed_${family}_plain"
        check "speed_${family}_low_vram" 90 $PY benchmarks/bench_device_memory.py --family "$family" --device cuda \
            --steps 20 --no_sample --workdir "$OUT/speed_${family}_low_vram"
    fi
done
if [ "$(left)" -gt 90 ]; then
    check pytest_gpu_slow "$(left)" $PY -m pytest -m "gpu and slow" -p no:cacheprovider -rs
fi

$PY - "$OUT" <<'EOF'
import json, re, sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]


def json_lines(name):
    log = out / f"{name}.log"
    return [json.loads(l) for l in log.read_text().splitlines() if l.startswith("{")] if log.exists() else []


def pytest_counts(name):
    log = out / f"{name}.log"
    text = log.read_text() if log.exists() else ""
    return {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", text)}


results = {
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "torch": torch.__version__, "cuda": torch.version.cuda,
    "steps": steps, "failures": sum(s["exit"] != 0 for s in steps),
    "pytest_gpu": pytest_counts("pytest_gpu"), "pytest_gpu_slow": pytest_counts("pytest_gpu_slow"),
    "tiny_runs": json_lines("gpu_runs"),
    "device_memory": [r for n in ("memory_sd1", "memory_sdxl", "memory_sdxl_whole_decode") for r in json_lines(n)],
    "speed": [r for n in ("speed_sd1_plain", "speed_sd1_low_vram", "speed_sdxl_plain", "speed_sdxl_low_vram")
              for r in json_lines(n)],
}
(out / "results.json").write_text(json.dumps(results, indent=1))
print(json.dumps(results))
EOF
FAILED=$(grep -c '"exit": [1-9]' "$OUT/steps.jsonl")
echo "failures: $FAILED ($(($(date +%s) - STARTED)) s in all; $OUT/results.json)"
exit "$FAILED"
