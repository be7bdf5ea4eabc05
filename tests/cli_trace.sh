#!/usr/bin/env bash
# CLI checks for the routing-trace tools and the placement simulator: `moeserve trace info`
# and tools/routing_trace.py read the same numbers from a synthetic trace and from the committed
# trace of the bundled model (difficulty split included); both name the same byte offset for a
# corrupt file; `moeserve trace record` writes a trace the readers accept; `placement-sim`
# prints a row per policy and device count; bad flags exit 2 naming the flag, unreadable or
# corrupt input exits 1.
# usage: cli_trace.sh MOESERVE_BINARY TESTS_DIR
set -u
bin=$1
tests=$2
root=$(cd "$tests/.." && pwd)
py="python3 $root/tools/routing_trace.py"
fixture=$tests/fixtures/routing/mohge_small_heldout.rtrace
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }

# The C and Python summaries of a trace agree (counts exactly, means to 1e-9).
same_summary() {
    "$bin" trace info "$1" --json >"$tmp/c.json" 2>"$tmp/e" || { bad "trace info $1: $(cat "$tmp/e")"; return; }
    $py info "$1" --json >"$tmp/p.json" 2>"$tmp/e" || { bad "routing_trace.py $1: $(cat "$tmp/e")"; return; }
    if python3 - "$tmp/c.json" "$tmp/p.json" <<'EOF'
import json, sys
c, p = (json.load(open(f)) for f in sys.argv[1:3])
def close(a, b, path=""):
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a: close(a[k], b[k], path + "/" + k)
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)): close(x, y, "%s[%d]" % (path, i))
    elif isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(a)), (path, a, b)
    else:
        assert a == b, (path, a, b)
close(c, p)
EOF
    then ok; else bad "C and Python summaries of $1 differ"; fi
}

# 1. Synthetic trace: written, summarized the same by both readers.
if "$bin" trace synth --out "$tmp/syn.rtrace" --experts 32 --layers 3 --top-k 4 --tokens 3000 \
    --step-tokens 128 --cluster 8 --seed 5 2>"$tmp/e"; then ok; else bad "trace synth: $(cat "$tmp/e")"; fi
same_summary "$tmp/syn.rtrace"
grep -q '"tokens": 3000' "$tmp/c.json" && ok || bad "synthetic trace token count: $(head -c 300 "$tmp/c.json")"

# 2. The committed trace of the bundled model: losses, tags, the difficulty split.
same_summary "$fixture"
grep -q '"third": "hard"' "$tmp/c.json" && ok || bad "no difficulty split in $(head -c 300 "$tmp/c.json")"
"$bin" trace info "$fixture" >"$tmp/o" && grep -q "| easy |" "$tmp/o" && grep -q "shakespeare" "$tmp/o" && ok ||
    bad "trace info table: $(head -c 400 "$tmp/o")"

# 3. Corrupt and truncated files: exit 1, the same offset from both readers.
python3 -c "
import sys
d = bytearray(open(sys.argv[1], 'rb').read()); d[5000] ^= 0x40
open(sys.argv[2], 'wb').write(d); open(sys.argv[3], 'wb').write(d[:len(d) - 7])
" "$fixture" "$tmp/flip.rtrace" "$tmp/cut.rtrace"
for f in flip cut; do
    "$bin" trace info "$tmp/$f.rtrace" >/dev/null 2>"$tmp/ce"; rc=$?
    $py info "$tmp/$f.rtrace" >/dev/null 2>"$tmp/pe"; prc=$?
    coff=$(grep -o "offset [0-9]*" "$tmp/ce")
    poff=$(grep -o "offset [0-9]*" "$tmp/pe")
    if [ "$rc" -eq 1 ] && [ "$prc" -eq 1 ] && [ -n "$coff" ] && [ "$coff" = "$poff" ]; then ok; else
        bad "$f: C rc $rc '$(cat "$tmp/ce")', Python rc $prc '$(cat "$tmp/pe")'"; fi
done
grep -q "CRC" "$tmp/ce" || grep -q "truncated" "$tmp/ce" && ok || bad "reason: $(cat "$tmp/ce")"

# 4. trace record on a fixture model, read back by both.
printf 'one two three four five six seven eight nine ten eleven twelve' >"$tmp/a.txt"
if "$bin" trace record --model "$tests/fixtures/models/mixtral" --out "$tmp/rec.rtrace" --window 16 \
    --step-tokens 8 --weights a="$tmp/a.txt" 2>"$tmp/e"; then ok; else bad "trace record: $(cat "$tmp/e")"; fi
same_summary "$tmp/rec.rtrace"
"$bin" trace record --model "$tests/fixtures/models/mixtral" --out "$tmp/x.rtrace" b="$tmp/missing.txt" 2>"$tmp/e"
[ $? -eq 1 ] && grep -q "missing.txt" "$tmp/e" && ok || bad "record of a missing file: $(cat "$tmp/e")"
"$bin" trace record --out "$tmp/x.rtrace" 2>"$tmp/e"
[ $? -eq 2 ] && grep -q "NAME=TEXTFILE" "$tmp/e" && ok || bad "record without files: $(cat "$tmp/e")"

# 5. placement-sim: every policy and device count; csv; bad input.
if "$bin" placement-sim --trace "$fixture" --devices 2,8,64 --tokens-per-device 32 --min-steps 2 \
    >"$tmp/sim" 2>"$tmp/e"; then ok; else bad "placement-sim: $(cat "$tmp/e")"; fi
[ "$(grep -c '^| [0-9]* | ' "$tmp/sim")" -eq 12 ] && ok || bad "sim rows: $(cat "$tmp/sim")"
for p in contiguous mohge eplb c2r; do grep -q "| 64 | $p | " "$tmp/sim" && ok || bad "no $p row"; done
"$bin" placement-sim --trace "$tmp/syn.rtrace" --devices 4 --csv --min-steps 1 >"$tmp/csv" 2>"$tmp/e"
head -1 "$tmp/csv" | grep -q "^devices,policy," && [ "$(wc -l <"$tmp/csv")" -eq 5 ] && ok || bad "csv: $(cat "$tmp/csv")"
grep -q "^4,mohge,,," "$tmp/csv" && ok || bad "mohge on a model without groups should be n/a: $(cat "$tmp/csv")"
"$bin" placement-sim --trace "$fixture" --devices 4,8 --nodes 2 --tokens-per-device 32 --min-steps 2 \
    >"$tmp/simn" 2>"$tmp/e" && grep -q "| 8 | eplb/nodes | " "$tmp/simn" && grep -q "cross-node rows" "$tmp/simn" \
    && ok || bad "placement-sim --nodes: $(cat "$tmp/simn" "$tmp/e")"
expect() { # status pattern args...
    local want=$1 pat=$2
    shift 2
    "$bin" "$@" >"$tmp/o" 2>"$tmp/e"
    local rc=$?
    if [ "$rc" -eq "$want" ] && grep -q -- "$pat" "$tmp/e"; then ok; else bad "$* -> rc $rc: $(head -c 300 "$tmp/e")"; fi
}
expect 2 "--trace FILE is required" placement-sim
expect 2 "--devices must be" placement-sim --trace "$fixture" --devices 0
expect 2 "--policies takes" placement-sim --trace "$fixture" --policies best
expect 2 "--fit must be" placement-sim --trace "$fixture" --fit most
expect 2 "--nodes 3 does not divide" placement-sim --trace "$fixture" --devices 4 --nodes 3
expect 1 "offset" placement-sim --trace "$tmp/flip.rtrace"
expect 1 "cannot open" placement-sim --trace "$tmp/nope.rtrace"
expect 2 "--out FILE is required" trace synth
expect 2 "synthetic routing" trace synth --out "$tmp/s2.rtrace" --experts 30 --cluster 8
expect 2 "usage" trace frobnicate
expect 1 "not a routing trace" trace info "$tmp/a.txt"
# An impossible replica budget is reported per cell, naming the flag.
"$bin" placement-sim --trace "$fixture" --devices 2 --redundant-experts 40 >"$tmp/o" 2>&1
grep -q "n/a: --redundant-experts 40" "$tmp/o" && ok || bad "impossible R: $(cat "$tmp/o")"

echo "cli_trace: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
