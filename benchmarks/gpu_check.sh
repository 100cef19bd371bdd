#!/usr/bin/env bash
# Everything the project checks on a CUDA GPU, in one command, in under 10 minutes (first run, H200: ~6.5):
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # PYTHON=... picks the interpreter (default: .venv/bin/python, else python)
#
# 1. pytest -m "gpu and not slow" (every family in bf16 against fp32 on the CPU, noise/loss, 8-bit optimizers,
#    CUDA tensor counting, ...)                                                                          ~1.5 min
# 2. benchmarks/bench_device_memory.py --device cuda: real-size SD1.5 at 512 px and SDXL at 1024 px (random weights,
#    made on the GPU), LoRA with --fp8_base --cache_latents --cache_text_encoder_outputs --gradient_checkpointing:
#    per phase (load, caching, step, sampling, save) torch.cuda.max_memory_allocated, max_memory_reserved and the
#    driver's used memory: what the memory planner's calibration is set from                             35 s each
#    (and SDXL once more with --sample_vae_tiling off: the sampling round's whole decode)
# 3. benchmarks/bench_flux_memory.py --device cuda: real-size FLUX.1-dev LoRA at 1024 px, --blocks_to_swap 0 and 16,
#    the same three numbers per phase                                                                    ~2.5 min
# 4. with SDS=sd-scripts' source (SDS_SITE: its pinned packages; SDS_TOKCACHE: CLIP tokenizers):
#    benchmarks/gpu_pair_sdxl.py, sdtrain vs sd-scripts s/step, real-size SDXL LoRA at 1024 px         ~3 min
# 5. while the budget lasts: benchmarks/gpu_runs.py (the tiny SD1 / SDXL demo models, 30 steps each: fp16, --full_fp16
#    with a real GradScaler, bf16, --full_bf16, --fp8_base, LoCon convs + checkpointing, sdpa, xformers, a low-VRAM
#    run that samples; ~3.5 min), the SD1.5 / SDXL speed runs (s/step, FLOPs, MFU; ~2 min), pytest -m "gpu and slow"
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

check pytest_gpu 150 $PY -m pytest -m "gpu and not slow" -p no:cacheprovider -rs  # addopts has -q; -qq hides the counts
for family in sd1 sdxl; do
    check "memory_$family" 90 $PY benchmarks/bench_device_memory.py --family "$family" --device cuda \
        --workdir "$OUT/memory_$family"
done
# the SDXL sampling round as before the low-memory decode (the run above tiles it: --sample_vae_tiling auto)
check memory_sdxl_whole_decode 75 $PY benchmarks/bench_device_memory.py --family sdxl --device cuda \
    --extra "--sample_vae_tiling off" --workdir "$OUT/memory_sdxl_whole_decode"
# FLUX.1-dev LoRA at real size, 1024 px, batch 1, fp8 + checkpointing + cached outputs: --blocks_to_swap 0 and 16
if [ "$(left)" -gt 200 ]; then
    check memory_flux 200 $PY benchmarks/bench_flux_memory.py --device cuda --rows 24 12 --batch 1 \
        --workdir "$OUT/memory_flux"
fi
# sdtrain vs sd-scripts, real-size SDXL LoRA at 1024 px on this GPU (when SDS points to sd-scripts' source, with its
# pinned packages in SDS_SITE and the CLIP tokenizers in SDS_TOKCACHE)
if [ -n "${SDS:-}" ] && [ "$(left)" -gt 190 ]; then
    check pair_sdxl "$(($(left) - 10))" $PY benchmarks/gpu_pair_sdxl.py --sdscripts "$SDS" --sds_site "$SDS_SITE" \
        --tokcache "$SDS_TOKCACHE" --steps 20 --timeout 110 --workdir "$OUT/pair_sdxl"
fi
if [ "$(left)" -gt 240 ]; then
    check gpu_runs 240 $PY benchmarks/gpu_runs.py --steps 30 --workdir "$OUT/gpu_runs"
fi
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
    "device_memory": [r for n in ("memory_sd1", "memory_sdxl", "memory_sdxl_whole_decode", "memory_flux")
                      for r in json_lines(n)],
    "pair_sdxl": json_lines("pair_sdxl"),
    "speed": [r for n in ("speed_sd1_plain", "speed_sd1_low_vram", "speed_sdxl_plain", "speed_sdxl_low_vram")
              for r in json_lines(n)],
}
(out / "results.json").write_text(json.dumps(results, indent=1))
print(json.dumps(results))
EOF
FAILED=$(grep -c '"exit": [1-9]' "$OUT/steps.jsonl")
echo "failures: $FAILED ($(($(date +%s) - STARTED)) s in all; $OUT/results.json)"
exit "$FAILED"
