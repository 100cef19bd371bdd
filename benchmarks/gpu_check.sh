#!/usr/bin/env bash
# Everything the project checks on a CUDA GPU, in one command (run from anywhere; takes ~10-20 min on one H100):
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # PYTHON=... to pick the interpreter (default: python)
#
# 1. pytest -m gpu (the GPU-marked tests: bf16/fp16 families, noise/loss, 8-bit optimizers, ZeRO-2, ...)
# 2. training runs on the demo's tiny SD1 and SDXL models on the GPU, 30 steps each, with --mixed_precision fp16,
#    --full_fp16, bf16, --full_bf16, --fp8_base, --xformers and --sdpa (a run passes when it exits 0: a NaN/inf
#    loss stops training with exit 1)
# 3. benchmarks/bench_train.py --real: LoRA on a random-weight real-size SD1.5 at 512 px and SDXL at 1024 px,
#    batch 1: s/step, torch.cuda.max_memory_allocated, FLOPs per step and model FLOP utilisation; then SDXL with
#    --fp8_base --gradient_checkpointing (the low-VRAM setting)
# Every step's output goes to OUT_DIR (default gpu_check_out/); the summary is printed at the end and written to
# OUT_DIR/summary.txt. A failing step is reported and the script goes on; the exit code is the number of failures.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-gpu_check_out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }
check() {  # check NAME COMMAND...: run, log to OUT/NAME.log, note pass/fail with the time taken
    local name=$1 start rc
    shift
    start=$(date +%s)
    "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then note "PASS $name ($(($(date +%s) - start)) s)"; else
        note "FAIL $name (exit $rc, $(($(date +%s) - start)) s): tail of $OUT/$name.log:"
        tail -n 5 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
        FAILED=$((FAILED + 1))
    fi
}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA GPU visible to torch ($PY); nothing to check here" >&2
    exit 2
fi
note "$($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())')  $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$SUMMARY" 2>&1

check pytest_gpu $PY -m pytest -m gpu -p no:cacheprovider
grep -E "passed|failed|error" "$OUT/pytest_gpu.log" | tail -n 1 | tee -a "$SUMMARY"

PRECISIONS=(
    "fp16:--mixed_precision fp16"
    "full_fp16:--mixed_precision fp16 --full_fp16"
    "bf16:--mixed_precision bf16"
    "full_bf16:--mixed_precision bf16 --full_bf16"
    "fp8_base:--mixed_precision bf16 --fp8_base"
    "xformers:--mixed_precision bf16 --xformers"
    "sdpa:--mixed_precision bf16 --sdpa"
)
for script in train_network.py sdxl_train_network.py; do
    for entry in "${PRECISIONS[@]}"; do
        name=${entry%%:*}
        # shellcheck disable=SC2086  # the flags are meant to split
        check "${script%.py}_$name" $PY "$script" --demo --demo_dir "$OUT/demo" --max_train_steps 30 ${entry#*:}
    done
done

check bench_real $PY benchmarks/bench_train.py --real sd1 sdxl --steps 20 --workdir "$OUT/real"
check bench_real_sdxl_fp8 $PY benchmarks/bench_train.py --real sdxl --steps 10 --workdir "$OUT/real" \
    --extra "--fp8_base --gradient_checkpointing"
grep -h "^{" "$OUT/bench_real.log" "$OUT/bench_real_sdxl_fp8.log" 2>/dev/null | tee -a "$SUMMARY"

note "failures: $FAILED"
exit "$FAILED"
