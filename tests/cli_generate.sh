#!/usr/bin/env bash
# CLI checks for `moeserve generate`: it runs a fixture model and reports speeds; it is
# deterministic with a seed; bad flags and broken model folders give one clear line and a
# non-zero exit, never a crash.
# usage: cli_generate.sh MOESERVE_BINARY TESTS_DIR
set -u
bin=$1
tests=$2
model=$tests/fixtures/models/mixtral
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }

# 1. Greedy generation runs and prints the continuation, then the speeds on stderr.
if "$bin" generate --model "$model" --prompt "ROMEO:" -n 8 >"$tmp/out" 2>"$tmp/err"; then ok; else bad "generate exited $?"; cat "$tmp/err" >&2; fi
grep -q "^prefill: [0-9]* tokens" "$tmp/err" && ok || bad "no prefill line"
grep -q "^decode: 8 tokens" "$tmp/err" && ok || bad "no decode line: $(cat "$tmp/err")"
[ -s "$tmp/out" ] && ok || bad "no text on stdout"

# 2. Greedy output is the same with 1 and 3 devices; seeded sampling repeats.
"$bin" generate --model "$model" --prompt "ROMEO:" -n 12 --devices 3 >"$tmp/out3" 2>/dev/null
"$bin" generate --model "$model" --prompt "ROMEO:" -n 12 >"$tmp/out1" 2>/dev/null
cmp -s "$tmp/out1" "$tmp/out3" && ok || bad "1 and 3 devices differ"
"$bin" generate --model "$model" --prompt "ROMEO:" -n 12 --temperature 0.9 --seed 7 >"$tmp/s1" 2>/dev/null
"$bin" generate --model "$model" --prompt "ROMEO:" -n 12 --temperature 0.9 --seed 7 >"$tmp/s2" 2>/dev/null
cmp -s "$tmp/s1" "$tmp/s2" && ok || bad "same seed, different text"

# 3. Bad input: clear message, exit status 1 (runtime) or 2 (usage), no crash.
expect_fail() { # expected-status grep-pattern args...
    local want=$1 pat=$2
    shift 2
    "$bin" "$@" >"$tmp/o" 2>"$tmp/e"
    local rc=$?
    if [ "$rc" -eq "$want" ] && grep -q -- "$pat" "$tmp/e"; then ok; else bad "$* -> rc $rc, stderr: $(head -c 300 "$tmp/e")"; fi
}
expect_fail 2 "required" generate --model "$model"
expect_fail 2 "--devices must be" generate --model "$model" --prompt hi --devices 0
expect_fail 2 "--temperature must be" generate --model "$model" --prompt hi --temperature abc
expect_fail 2 "--device must be cpu or cuda" generate --model "$model" --prompt hi --device tpu
expect_fail 2 "--device must be cpu or cuda" serve --model "$model" --port 0 --device gpu
# --device cuda without a usable GPU (or without the CUDA backend) is a runtime error that
# says why; with a GPU it generates.
if "$bin" generate --model "$model" --prompt hi -n 2 --device cuda >"$tmp/o" 2>"$tmp/e"; then
    [ -s "$tmp/o" ] && ok || bad "--device cuda produced no text"
else
    grep -q "CUDA" "$tmp/e" && ok || bad "--device cuda failed without naming CUDA: $(head -c 300 "$tmp/e")"
fi
expect_fail 2 "unknown command" frobnicate
# Weight types: bad values name the accepted ones; each type generates; the kernel set is
# logged, and a forced portable set is what runs.
expect_fail 2 "--dtype must be auto, bfloat16 or float32" generate --model "$model" --prompt hi --dtype fp8
expect_fail 2 "--quantization must be none, int8 or int4" generate --model "$model" --prompt hi --quantization int3
expect_fail 2 "--dtype must be auto, bfloat16 or float32" serve --model "$model" --port 0 --dtype half16
expect_fail 2 "--quantization must be none, int8 or int4" serve --model "$model" --port 0 --quantization q4_k
for flags in "--dtype float32" "--dtype bfloat16" "--quantization int8" "--quantization int4"; do
    # shellcheck disable=SC2086
    if "$bin" generate --model "$model" --prompt "ROMEO:" -n 6 $flags >"$tmp/o" 2>"$tmp/e" && [ -s "$tmp/o" ] &&
        grep -q "^cpu kernels: .*${flags#--* }" "$tmp/e"; then ok; else bad "generate $flags: $(head -c 300 "$tmp/e")"; fi
done
MOESERVE_CPU_KERNELS=portable "$bin" generate --model "$model" --prompt "ROMEO:" -n 6 >"$tmp/o" 2>"$tmp/e"
grep -q "^cpu kernels: portable" "$tmp/e" && ok || bad "MOESERVE_CPU_KERNELS=portable not honoured: $(head -c 300 "$tmp/e")"
expect_fail 1 "CPU-only" generate --model "$model" --prompt hi --quantization int8 --device cuda
expect_fail 1 "config.json" generate --model "$tmp/nope" --prompt hi
expect_fail 1 "exceeds the model's top-k" generate --model "$model" --prompt hi --moe-top-k 5
# The continuous-experts budget: refused for another model and outside the model's bounds.
inf="$tests/fixtures/models/infmoe_tiny"
expect_fail 1 "--moe-samples applies to continuous-experts" generate --model "$model" --prompt hi --moe-samples 2
expect_fail 1 "--moe-samples-adaptive needs an infmoe model" generate --model "$model" --prompt hi --moe-samples-adaptive
expect_fail 1 "--moe-samples 9 exceeds the model's max_samples 8" generate --model "$inf" --prompt hi --moe-samples 9
expect_fail 1 "--moe-neuron-fraction 0.5 exceeds" generate --model "$inf" --prompt hi --moe-neuron-fraction 0.5
expect_fail 2 "--moe-samples must be an integer" generate --model "$inf" --prompt hi --moe-samples 0
"$bin" generate --model "$inf" --prompt "ROMEO:" -n 6 --moe-samples 2 --moe-samples-adaptive >"$tmp/o" 2>"$tmp/e" &&
    [ -s "$tmp/o" ] && ok || bad "infmoe adaptive generate: $(head -c 300 "$tmp/e")"

# Broken folders: a copy of the fixture with one thing wrong each time.
mkdir "$tmp/m"
cp "$model"/*.json "$model"/model.safetensors "$tmp/m/"
head -c 1000 "$model/model.safetensors" >"$tmp/m/model.safetensors"
expect_fail 1 "model.safetensors" generate --model "$tmp/m" --prompt hi
cp "$model/model.safetensors" "$tmp/m/"
rm "$tmp/m/tokenizer.json"
expect_fail 1 "tokenizer.json" generate --model "$tmp/m" --prompt hi
cp "$model/tokenizer.json" "$tmp/m/"
sed -i 's/"mixtral"/"no_such_arch"/' "$tmp/m/config.json"
expect_fail 1 "no_such_arch" generate --model "$tmp/m" --prompt hi

echo "cli_generate: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
