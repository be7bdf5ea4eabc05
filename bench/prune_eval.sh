#!/usr/bin/env bash
# Expert pruning on the bundled model: prunes models/mohge-small at 25% and 50% with each method
# (collab, frequency, random), calibrated on held-out text past the first 4096 tokens of each
# corpus, and evaluates every pruned folder with mohge_eval on the first 2048 tokens of each
# corpus (disjoint from the calibration). Prints one markdown table: loss per domain.
#   bash bench/prune_eval.sh [BUILD_DIR (build)] [WORK_DIR (a new temporary folder)] [MODEL_DIR]
set -euo pipefail
build=${1:-build}
work=${2:-$(mktemp -d /tmp/moeserve_prune_eval.XXXXXX)}
model=${3:-models/mohge-small}
mkdir -p "$work"
data=tools/train/data
domains=(shakespeare arithmetic json)
calib=()
evals=()
for d in "${domains[@]}"; do
  calib+=(--calib "$data/$d.heldout.txt")
  evals+=("$d=$data/$d.heldout.txt")
done
loss() { # model folder -> "l1 l2 l3"
  "$build/mohge_eval" --model "$1" "${evals[@]}" 2>/dev/null |
    awk -F'|' '$2 ~ /^ (shakespeare|arithmetic|json) $/ { printf "%s ", $4 }'
}
printf '| method | ratio | experts kept / layer | shakespeare | arithmetic | json | mean |\n'
printf '|---|---|---|---|---|---|---|\n'
row() { # method ratio kept "losses"
  read -r a b c <<<"$4"
  printf '| %s | %s | %s | %.4f | %.4f | %.4f | %.4f |\n' "$1" "$2" "$3" "$a" "$b" "$c" \
    "$(echo "($a + $b + $c) / 3" | bc -l)"
}
row none 0 16 "$(loss "$model")"
for r in 0.25 0.5; do
  for m in collab frequency random; do
    out="$work/$m-$r"
    rm -rf "$out"
    "$build/moeserve" prune --model "$model" --ratio "$r" --method "$m" "${calib[@]}" --skip-tokens 4096 \
      --max-tokens 4096 --out "$out" 2>"$out.log" || { cat "$out.log" >&2; exit 1; }
    kept=$(python3 -c "import json,sys; c=json.load(open(sys.argv[1])); print(c['experts_per_group']*c['num_expert_groups'])" "$out/config.json")
    row "$m" "$r" "$kept" "$(loss "$out")"
  done
done
