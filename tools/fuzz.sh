#!/usr/bin/env bash
# Fuzzes moeserve's input parsers with libFuzzer under AddressSanitizer + UBSan (harnesses in
# tests/fuzz: fuzz_http, fuzz_proto, fuzz_tokenizer, fuzz_model_files, fuzz_jinja,
# fuzz_grammar):
#   tools/fuzz.sh                                 every harness for 60 s (what CI runs)
#   tools/fuzz.sh --time 600 fuzz_jinja           one harness for ten minutes
#   nice -n 19 tools/fuzz.sh --runs 10000000      ten million executions of each, one at a time
# Builds build-fuzz (clang, -DMOESERVE_FUZZ=ON) first unless --no-build. A harness starts from
# its committed seeds (tests/fuzz/corpus/NAME) plus what earlier runs kept (BUILD/fuzz-corpus/
# NAME), with tests/fuzz/NAME.dict when there is one and the libFuzzer flags listed in
# tests/fuzz/NAME.options (one a line; they override the defaults -timeout=20
# -rss_limit_mb=4096). Crashes, leaks, timeouts and OOMs are
# written to BUILD/fuzz-findings/NAME/ (reproduce: BUILD/NAME FILE). Prints one line per
# harness: executions, seconds, new findings; exits 1 when any harness found something.
set -euo pipefail
cd "$(dirname "$0")/.."

build=build-fuzz
time_s=60
runs=""
do_build=1
names=()
while [ $# -gt 0 ]; do
    case "$1" in
        --time) time_s=$2; runs=""; shift 2 ;;
        --runs) runs=$2; shift 2 ;;
        --build-dir) build=$2; shift 2 ;;
        --no-build) do_build=0; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
        *) names+=("$1"); shift ;;
    esac
done

if [ "$do_build" = 1 ]; then
    cmake -S . -B "$build" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          -DMOESERVE_FUZZ=ON -DMOESERVE_SANITIZE=address,undefined -DMOESERVE_CUDA=OFF >/dev/null
    cmake --build "$build" -j"$(nproc 2>/dev/null || echo 2)" --target fuzzers
fi
if [ ${#names[@]} -eq 0 ]; then
    for f in tests/fuzz/fuzz_*.c; do names+=("$(basename "$f" .c)"); done
fi

status=0
for name in "${names[@]}"; do
    work=$build/fuzz-corpus/$name
    found=$build/fuzz-findings/$name
    log=$build/fuzz-logs/$name.log
    mkdir -p "$work" "$found" "$(dirname "$log")"
    if [ -n "$runs" ]; then limit=(-runs="$runs"); else limit=(-max_total_time="$time_s"); fi
    extra=()
    if [ -f "tests/fuzz/$name.dict" ]; then extra+=(-dict="tests/fuzz/$name.dict"); fi
    if [ -f "tests/fuzz/$name.options" ]; then
        while read -r opt; do
            case "$opt" in -*) extra+=("$opt") ;; esac
        done <"tests/fuzz/$name.options"
    fi
    before=$(find "$found" -type f | wc -l)
    start=$SECONDS
    rc=0
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        "$build/$name" "${limit[@]}" -timeout=20 -rss_limit_mb=4096 "${extra[@]}" \
        -print_final_stats=1 -artifact_prefix="$found/" "$work" "tests/fuzz/corpus/$name" \
        >"$log" 2>&1 || rc=$?
    execs=$(grep -a -o 'stat::number_of_executed_units: [0-9]*' "$log" | awk '{print $2}' || true)
    new=$(( $(find "$found" -type f | wc -l) - before ))
    echo "$name: ${execs:-?} executions in $((SECONDS - start)) s, $new new findings" \
         "(exit $rc; log $log)"
    if [ "$rc" -ne 0 ] || [ "$new" -ne 0 ]; then
        status=1
        tail -40 "$log"
    fi
done
exit $status
