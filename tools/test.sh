#!/usr/bin/env bash
# The test command of README.md: installs dependencies, builds moeserve (warnings are errors),
# runs the whole CTest suite, then builds again with AddressSanitizer + UndefinedBehaviorSanitizer
# and runs the suite under them. Set MOESERVE_SKIP_SANITIZE=1 to skip the sanitizer pass.
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
