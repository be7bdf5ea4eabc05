#!/usr/bin/env bash
# The test command of README.md: installs dependencies, builds moeserve (warnings are errors),
# runs the whole CTest suite, then builds again with AddressSanitizer + UndefinedBehaviorSanitizer
# and runs the suite under them, then runs each libFuzzer harness (tests/fuzz) for 60 s under
# the same sanitizers. MOESERVE_SKIP_SANITIZE=1 skips the sanitizer pass, MOESERVE_SKIP_FUZZ=1
# the fuzzing.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh

if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH="$PATH:/usr/local/cuda/bin"; fi
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"

if [ "${MOESERVE_SKIP_SANITIZE:-0}" != "1" ]; then
    # The sanitizer build checks the C code; the CUDA library is not instrumented.
    cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DMOESERVE_SANITIZE=address,undefined \
          -DMOESERVE_CUDA=OFF
    cmake --build build-asan -j"$jobs"
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
        ctest --test-dir build-asan --output-on-failure -j"$jobs" -LE slow
fi

if [ "${MOESERVE_SKIP_FUZZ:-0}" != "1" ]; then
    # clang build of the harnesses; each runs 60 s from its committed seeds (tools/fuzz.sh)
    cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          -DMOESERVE_FUZZ=ON -DMOESERVE_SANITIZE=address,undefined -DMOESERVE_CUDA=OFF
    cmake --build build-fuzz -j"$jobs" --target fuzzers
    ctest --test-dir build-fuzz --output-on-failure -j"$jobs" -L fuzz
fi
