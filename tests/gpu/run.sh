#!/usr/bin/env bash
# The one script a lent GPU machine (H200) runs for moeserve. In order, each step with its own
# timeout so that a hang still ends with the table:
#   1. configure with the CUDA backend and build everything;
#   2. the GPU-labelled tests: every backend op against the CPU reference (test_backend_ops)
#      and the full forward on every fixture checkpoint (test_forward_gpu, relative logit error);
#   3. decode tokens/s at batch 1, 32 and 256 on a ~1B-parameter Mixtral-shaped synthetic model,
#      with each MoE layer's time against its HBM-read and bf16-GEMM floors measured in the same
#      run (bench_decode), once with the grouped expert GEMM and once with a GEMM per expert;
#   4. server throughput at concurrency 32 on the bundled model (bench/bench_server.py).
# Full logs go under $OUT when set (the device tool brings that folder back). Budget: 8 minutes
# in all; a step is skipped when too little of it is left. `bash tests/gpu/run.sh`.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$ROOT/build-gpu}
LOG=${OUT:-$BUILD/gpu-logs}
mkdir -p "$LOG"
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 4)}
BUDGET=${BUDGET:-470}
START=$(date +%s)
declare -A status=([configure]=skipped [build]=skipped [gpu-tests]=skipped [model]=skipped
                   [decode]=skipped [decode-per-expert]=skipped [server]=skipped)

elapsed() { echo $(($(date +%s) - START)); }
step() { echo "=== $* ($(elapsed) s)"; }
# left N: true when at least N seconds of the budget remain
left() { [ $((BUDGET - $(elapsed))) -ge "$1" ]; }
# cap N: a timeout of at most N seconds that ends within the budget
cap() {
    local rest=$((BUDGET - $(elapsed) - 5))
    [ "$rest" -lt "$1" ] && echo "$rest" || echo "$1"
}
rc_status() {
    case $1 in
    0) echo ok ;;
    77) echo SKIPPED ;;
    124) echo TIMEOUT ;;
    *) echo "FAIL (rc $1)" ;;
    esac
}

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 |
    tee "$LOG/nvidia-smi.txt"
nvcc --version 2>&1 | tail -1

step "configure"
if timeout "$(cap 120)" cmake -S "$ROOT" -B "$BUILD" -DMOESERVE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$LOG/configure.txt" 2>&1; then
    status[configure]=ok
else
    status[configure]=FAIL
    tail -30 "$LOG/configure.txt"
fi

if [ "${status[configure]}" = ok ]; then
    step "build (-j$JOBS)"
    timeout "$(cap 240)" cmake --build "$BUILD" -j"$JOBS" >"$LOG/build.txt" 2>&1
    status[build]=$(rc_status $?)
    [ "${status[build]}" = ok ] || tail -40 "$LOG/build.txt"
fi

if [ "${status[build]}" = ok ] && left 60; then
    step "gpu tests"
    (cd "$BUILD" && timeout "$(cap 150)" ctest -L gpu --output-on-failure --timeout 140 -V) \
        >"$LOG/tests.txt" 2>&1
    status[gpu-tests]=$(rc_status $?)
    # ctest -V prefixes each line of a test's output with its number
    sed -E 's/^[0-9]+: //' "$LOG/tests.txt" >"$LOG/tests-clean.txt"
    grep -E "CHECK failed|SKIP|passed, [0-9]+ failed" "$LOG/tests-clean.txt" | head -30
    # ctest counts a skipped test as passed: say so
    [ "${status[gpu-tests]}" = ok ] && grep -q "^SKIP" "$LOG/tests-clean.txt" &&
        status[gpu-tests]="SKIPPED (no GPU)"
fi

MODEL=$BUILD/mixtral1b
if [ "${status[build]}" = ok ] && left 120; then
    step "synthetic ~1B model (bf16)"
    rm -rf "$MODEL"
    timeout "$(cap 90)" "$BUILD/make_synthetic_model" "$MODEL" --params 1B --dtype bf16 \
        >"$LOG/model.txt" 2>&1
    status[model]=$(rc_status $?)
    tail -2 "$LOG/model.txt"
fi

if [ "${status[model]}" = ok ] && left 90; then
    step "decode, grouped expert GEMM"
    timeout "$(cap 180)" "$BUILD/bench_decode" "$MODEL" --device cuda --batch 1,32,256 \
        --context 128 --steps 32 >"$LOG/decode.txt" 2>&1
    status[decode]=$(rc_status $?)
    cat "$LOG/decode.txt"
fi

if [ "${status[model]}" = ok ] && left 80; then
    step "decode, one GEMM per expert"
    MOESERVE_CUDA_GROUPED=0 timeout "$(cap 100)" "$BUILD/bench_decode" "$MODEL" --device cuda \
        --batch 32,256 --context 128 --steps 16 >"$LOG/decode-per-expert.txt" 2>&1
    status[decode-per-expert]=$(rc_status $?)
    cat "$LOG/decode-per-expert.txt"
fi

if [ "${status[build]}" = ok ] && left 45; then
    step "server, concurrency 32"
    timeout "$(cap 120)" python3 "$ROOT/bench/bench_server.py" --binary "$BUILD/moeserve" \
        --model "$ROOT/models/mohge-small" --server-args "--device cuda --max-num-seqs 64" \
        --concurrency 32 --requests 128 --max-tokens 64 >"$LOG/server.txt" 2>&1
    status[server]=$(rc_status $?)
    cat "$LOG/server.txt" | tail -8
fi

step "summary"
echo "--- GPU tests (CUDA vs CPU) ---"
if [ -f "$LOG/tests-clean.txt" ]; then
    grep -E "FAIL|SKIP|passed, [0-9]+ failed" "$LOG/tests-clean.txt" | head -20 | sed 's/^/  /'
    sed -n '/^model  *devs  *prefill_err/,/passed, [0-9]* failed/p' "$LOG/tests-clean.txt" | sed 's/^/  /'
fi
echo "--- decode on a ~1B Mixtral-shaped model (bf16) ---"
for f in decode decode-per-expert; do
    [ -f "$LOG/$f.txt" ] && { echo "  [$f]"; grep -E "^floors|^ *batch|^ +[0-9]+ " "$LOG/$f.txt" | sed 's/^/  /'; }
done
echo "--- server at concurrency 32 (bundled mohge-small) ---"
[ -f "$LOG/server.txt" ] && grep -E "^ *conc|^ +32 " "$LOG/server.txt" | sed 's/^/  /'
for k in configure build gpu-tests model decode decode-per-expert server; do
    printf '%-18s %s\n' "$k" "${status[$k]}"
done
printf '%-18s %s\n' seconds "$(elapsed)"
[ "${status[gpu-tests]}" = ok ]
