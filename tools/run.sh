#!/usr/bin/env bash
# Sets up and builds moeserve (release build), then runs it with the given arguments, e.g.
#   tools/run.sh generate --model tests/fixtures/models/mixtral --prompt "ROMEO:"
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh >&2
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH="$PATH:/usr/local/cuda/bin"; fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc 2>/dev/null || echo 2)" --target moeserve >&2
exec build/moeserve "$@"
