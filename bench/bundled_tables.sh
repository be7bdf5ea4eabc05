#!/bin/bash
# Re-measures the README's tables that depend on the bundled model's weights, each by the
# command its README section names, into one folder: what replacing models/mohge-small (or
# checking that a change left them alone) needs. The throughput tables are not here: they
# depend on the machine, not on the weights.
#
#   bash bench/bundled_tables.sh [MODEL_DIR] [OUT_DIR]    (defaults: models/mohge-small, /tmp/bundled_tables)
#
# Writes quant.txt (README "Quantization"), kv.txt ("KV cache types"), trace.txt ("Routing
# traces"), psim.txt ("The placement simulator"), g.json and ablation.txt ("Collaboration
# groups"), eval.txt (held-out loss, three domains), sums.txt (models/mohge-small/README.md),
# difficulty.txt ("Routing traces", bench/difficulty_table.py) and prune.txt (README "prune").
# About 5 minutes on 2 cores; needs build/ (moeserve, mohge_eval).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
M=${1:-models/mohge-small}
O=${2:-/tmp/bundled_tables}
mkdir -p "$O"
D=tools/train/data
S=shakespeare=$D/shakespeare.heldout.txt
A=arithmetic=$D/arithmetic.heldout.txt
J=json=$D/json.heldout.txt
for a in "--dtype float32" "" "--quantization int8" "--quantization int4"; do
    echo "== ${a:-auto}"
    # shellcheck disable=SC2086 # $a is zero or two words
    build/mohge_eval --model "$M" $a "$S" "$A"
done > "$O/quant.txt"
for t in float32 bfloat16 float16 fp8_e4m3 fp8_e5m2 int8; do
    echo "== $t"
    build/mohge_eval --model "$M" --dtype float32 --kv-cache-dtype "$t" "$S" "$A"
done > "$O/kv.txt"
build/moeserve trace record --model "$M" --out "$O/b.rtrace" --window 192 --max-tokens 1000000 \
    "$S" "$A" "$J" > "$O/trace.txt"
build/moeserve trace info "$O/b.rtrace" >> "$O/trace.txt"
build/moeserve placement-sim --trace "$O/b.rtrace" > "$O/psim.txt"
build/moeserve analyze --model "$M" --calib "$D/shakespeare.heldout.txt" \
    --calib "$D/arithmetic.heldout.txt" --calib "$D/json.heldout.txt" --max-tokens 2048 \
    --groups 4 --out "$O/g.json" > /dev/null
python3 bench/collab_ablation.py --model "$M" > "$O/ablation.txt"
build/mohge_eval --model "$M" "$S" "$A" "$J" > "$O/eval.txt"
python3 bench/sums_eval.py --model "$M" > "$O/sums.txt"
python3 bench/difficulty_table.py "bundled=$M" > "$O/difficulty.txt"
bash bench/prune_eval.sh build "$O/prune_work" "$M" > "$O/prune.txt"
echo "wrote $O"
