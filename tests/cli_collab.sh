#!/usr/bin/env bash
# CLI checks for `moeserve analyze` and `moeserve prune` (engine/collab): analyze on a synthetic
# trace with planted groups recovers them (ARI >= 0.9, the same JSON for the same seed), and on
# the bundled model's text finds one group per domain; prune writes a folder that loads and
# generates, with the expert count, the router rows and the kept experts' weights as selected;
# every bad input (empty or binary calibration, ratio outside (0, 1), a ratio that removes nothing
# or leaves fewer experts than top-k, unknown method, existing --out) exits 2 naming the argument
# and leaves no folder behind.
# usage: cli_collab.sh MOESERVE_BINARY TESTS_DIR
set -u
bin=$1
tests=$2
root=$(cd "$tests/.." && pwd)
data=$root/tools/train/data
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }
cd "$root" || exit 1

# 1. Planted groups in a synthetic trace: recovered, deterministic for a seed.
"$bin" trace synth --out "$tmp/s.rtrace" --experts 32 --layers 4 --top-k 2 --cluster 4 \
    --tokens 8192 --seed 3 2>"$tmp/e" && ok || bad "trace synth: $(cat "$tmp/e")"
for run in a b; do
    "$bin" analyze --calib "$tmp/s.rtrace" --out "$tmp/g$run.json" --groups 8 --seed 5 \
        2>"$tmp/e" && ok || bad "analyze synthetic: $(cat "$tmp/e")"
done
cmp -s "$tmp/ga.json" "$tmp/gb.json" && ok || bad "analyze is not deterministic for a seed"
python3 - "$tmp/ga.json" <<'PYEOF' && ok || bad "planted groups not recovered"
import json, sys
g = json.load(open(sys.argv[1]))
# the trace's tags are the tokens' topics; a planted group serves one topic: each coarse group's
# usage must be concentrated on one topic, and every topic must have its own group
owner = {}
for grp in g["levels"][0]["groups"]:
    share = grp["share"]
    top = max(share, key=share.get)
    assert share[top] > 0.5, (grp["id"], share)
    owner.setdefault(top, grp["id"])
assert len(owner) == 8, owner
# and against the nodes' coarse groups: a pure partition of the 32 x 4 nodes into 8 groups of 16
sizes = {}
for n in g["nodes"]:
    sizes[n["group"]] = sizes.get(n["group"], 0) + 1
assert sorted(sizes.values()) == [16] * 8, sizes
assert 0 < g["reconstruction_error"]["fine"] < 1
PYEOF

# 1b. The Python reference (tools/collab_ref.py, numpy) learns the same groups with the same
# reconstruction error (float64 there, float32 here: 1e-4).
if python3 -c "import numpy" 2>/dev/null; then
    "$bin" trace synth --out "$tmp/r.rtrace" --experts 16 --layers 3 --top-k 2 --cluster 4 \
        --tokens 2048 --seed 4 2>/dev/null &&
        "$bin" analyze --calib "$tmp/r.rtrace" --out "$tmp/r.json" --groups 4 --seed 2 2>"$tmp/e" &&
        python3 "$root/tools/collab_ref.py" "$tmp/r.rtrace" --groups 4 --seed 2 >"$tmp/rref.json" \
            2>"$tmp/e" && ok || bad "reference run: $(cat "$tmp/e")"
    python3 - "$tmp/r.json" "$tmp/rref.json" <<'PYEOF' && ok || bad "C and Python reference differ"
import json, sys
c, p = (json.load(open(f)) for f in sys.argv[1:3])
for level in ("fine", "coarse"):
    a, b = c["reconstruction_error"][level], p["reconstruction_error"][level]
    assert abs(a - b) < 1e-4, (level, a, b)
for x, y in zip(c["nodes"], p["nodes"]):
    assert (x["group"], x["fine_group"]) == (y["group"], y["fine_group"]), (x, y)
PYEOF
else
    echo "cli_collab: SKIPPED the Python reference check (numpy is not installed)" >&2
fi

# 2. The bundled model over the three held-out corpora (text calibration): a group per domain.
"$bin" analyze --calib "$data/shakespeare.heldout.txt" --calib "$data/arithmetic.heldout.txt" \
    --calib "$data/json.heldout.txt" --max-tokens 1024 --groups 4 --out "$tmp/b.json" \
    2>"$tmp/e" && ok || bad "analyze text: $(cat "$tmp/e")"
python3 - "$tmp/b.json" <<'PYEOF' && ok || bad "bundled-model groups: $(head -c 600 "$tmp/b.json")"
import json, sys
g = json.load(open(sys.argv[1]))
assert g["tags"] == ["shakespeare", "arithmetic", "json"], g["tags"]
assert g["tokens"] == 3072 and g["weighted"] is True
coarse, fine = g["levels"][0]["groups"], g["levels"][1]["groups"]
assert len(coarse) == 4 and len(fine) == 16
for f in fine:
    assert f["id"] in coarse[f["parent"]]["children"]
domains = {max(c["share"], key=c["share"].get) for c in coarse}
assert domains == {"shakespeare", "arithmetic", "json"}, domains
for c in coarse:
    assert c["members"] and c["top_tokens"] and all("text" in t for t in c["top_tokens"])
    for m in c["members"]:
        assert 0 <= m["expert"] < 16 and 0 <= m["layer"] < 4
# token classes: shares sum to 1, base rates are the same for every group and sum to 1, lift is
# their ratio; the group arithmetic uses most prefers digits, the JSON one JSON syntax, and the
# labels say so
classes = ["whitespace", "digits", "json_syntax", "punctuation", "capitalized", "lowercase",
           "other"]
for c in coarse + fine:
    tc = c["token_classes"]
    assert list(tc) == classes, list(tc)
    assert abs(sum(v["share"] for v in tc.values()) - 1) < 1e-6
    assert abs(sum(v["base"] for v in tc.values()) - 1) < 1e-6
    assert all(v["base"] == coarse[0]["token_classes"][k]["base"] for k, v in tc.items())
    for v in tc.values():
        assert abs(v["lift"] - (v["share"] / v["base"] if v["base"] else 0)) < 1e-6
    assert c["label"].split("; ")[0].endswith(" tokens"), c["label"]
by_domain = {d: max(coarse, key=lambda c: c["share"][d]) for d in g["tags"]}
for d, cls in (("arithmetic", "digits"), ("json", "json_syntax")):
    tc = by_domain[d]["token_classes"]
    assert max(tc, key=lambda k: tc[k]["lift"]) == cls, (d, tc)
    assert tc[cls]["lift"] > 1.5 and cls in by_domain[d]["label"], by_domain[d]["label"]
PYEOF

# 3. Prune 50% by collab: the folder loads and generates; weights are the kept experts'.
"$bin" prune --ratio 0.5 --method collab --calib "$data/arithmetic.heldout.txt" \
    --calib "$data/json.heldout.txt" --max-tokens 512 --out "$tmp/p50" 2>"$tmp/e" && ok ||
    bad "prune: $(cat "$tmp/e")"
[ -f "$tmp/p50/tokenizer.json" ] && [ -f "$tmp/p50/tokenizer_config.json" ] && ok || bad "tokenizer not copied"
ls "$tmp" | grep -q tmp- && bad "a temporary folder was left" || ok
python3 - "$root/models/mohge-small" "$tmp/p50" "$tmp/e" <<'PYEOF' && ok || bad "pruned weights"
import json, re, struct, sys
def load(path):
    b = open(path + "/model.safetensors", "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    h.pop("__metadata__", None)
    return {k: b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in h.items()}, h
src, sh = load(sys.argv[1])
dst, dh = load(sys.argv[2])
cfg = json.load(open(sys.argv[2] + "/config.json"))
assert cfg["experts_per_group"] == 2 and cfg["num_expert_groups"] == 4, cfg
keep = {}
for line in open(sys.argv[3]):
    m = re.match(r"\s+layer (\d+) keeps (.*)", line)
    if m:
        keep[int(m.group(1))] = [int(x) for x in m.group(2).split()]
assert sorted(keep) == [0, 1, 2, 3], keep
for l, ks in keep.items():
    assert len(ks) == 8
    for g in range(4):  # two per group of four
        assert sum(1 for k in ks if k // 4 == g) == 2, (l, ks)
    gate = "model.layers.%d.mlp.gate.weight" % l
    row = len(src[gate]) // 16
    assert dh[gate]["shape"] == [8, 192]
    assert dst[gate] == b"".join(src[gate][k * row:(k + 1) * row] for k in ks)
    for new, old in enumerate(ks):
        for p in ("gate_proj", "up_proj", "down_proj"):
            a = "model.layers.%d.mlp.experts.%d.%s.weight" % (l, new, p)
            b = "model.layers.%d.mlp.experts.%d.%s.weight" % (l, old, p)
            assert dst[a] == src[b], a
    assert "model.layers.%d.mlp.experts.8.up_proj.weight" % l not in dst
    assert dst["model.layers.%d.mlp.group_gate.weight" % l] == src["model.layers.%d.mlp.group_gate.weight" % l]
PYEOF
"$bin" generate --model "$tmp/p50" --prompt "12+7=" -n 8 --temperature 0 >"$tmp/o" 2>"$tmp/e" &&
    [ -s "$tmp/o" ] && ok || bad "the pruned model does not generate: $(cat "$tmp/e")"
# frequency and random write folders too (random is seeded: the same twice)
for m in frequency random; do
    "$bin" prune --ratio 0.25 --method $m --calib "$data/json.heldout.txt" --max-tokens 256 \
        --out "$tmp/p-$m" 2>"$tmp/e-$m" && grep -q '"experts_per_group": 3' "$tmp/p-$m/config.json" &&
        ok || bad "prune $m: $(cat "$tmp/e-$m")"
done
"$bin" prune --ratio 0.25 --method random --calib "$data/json.heldout.txt" --max-tokens 256 \
    --out "$tmp/p-random2" 2>"$tmp/e-random2" && cmp -s "$tmp/p-random/model.safetensors" \
    "$tmp/p-random2/model.safetensors" && ok || bad "prune random is not seeded"

# DeepSeek-V3.2 with its MTP layer (routed experts of its own, which calibration never
# reaches): the decoder's experts are pruned, the MTP layer is left out and the config says so;
# the pruned folder serves (one group, so that a group can lose experts).
cp -r "$tests/fixtures/models/deepseek_v32" "$tmp/v32"
python3 -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); c['n_group']=1; c['topk_group']=1; json.dump(c,open(p,'w'))" "$tmp/v32/config.json"
"$bin" prune --ratio 0.25 --method frequency --calib "$data/json.heldout.txt" --max-tokens 128 \
    --model "$tmp/v32" --out "$tmp/p-v32" >"$tmp/o" 2>"$tmp/e" && ok || bad "prune deepseek_v32: $(cat "$tmp/e")"
python3 - "$tmp/p-v32" <<'PYEOF' && ok || bad "pruned deepseek_v32: MTP layer or config"
import json, struct, sys
d = sys.argv[1]
c = json.load(open(d + "/config.json"))
f = open(d + "/model.safetensors", "rb")
names = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
layer3 = [k for k in names if k.startswith("model.layers.3.")]
sys.exit(0 if c["n_routed_experts"] == 6 and c["num_nextn_predict_layers"] == 0 and not layer3
         else 1)
PYEOF
"$bin" generate --model "$tmp/p-v32" --prompt "the king" -n 4 >"$tmp/o" 2>"$tmp/e" && ok || \
    bad "the pruned deepseek_v32 does not generate: $(cat "$tmp/e")"

# 4. Bad input: exit 2, the argument named, no folder written.
: >"$tmp/empty.txt"
printf 'abc\0def' >"$tmp/bin.dat"
expect2() { # NEEDLE ARGS...
    local needle=$1
    shift
    "$bin" "$@" >"$tmp/o" 2>"$tmp/e"
    local rc=$?
    [ $rc -eq 2 ] && grep -q -- "$needle" "$tmp/e" && ok || bad "$* -> rc $rc: $(cat "$tmp/e")"
    [ -e "$tmp/never" ] && bad "$*: wrote a folder"
    ls "$tmp" | grep -q 'never.tmp' && bad "$*: left a temporary folder"
}
j="$data/json.heldout.txt"
expect2 "--calib .*empty" prune --ratio 0.5 --method collab --calib "$tmp/empty.txt" --out "$tmp/never"
expect2 "--calib .*neither text" prune --ratio 0.5 --method collab --calib "$tmp/bin.dat" --out "$tmp/never"
expect2 "--calib .*empty" analyze --calib "$tmp/empty.txt" --out "$tmp/never"
expect2 "--ratio" prune --ratio 0 --method collab --calib "$j" --out "$tmp/never"
expect2 "--ratio" prune --ratio 1 --method collab --calib "$j" --out "$tmp/never"
expect2 "--ratio" prune --ratio -0.5 --method collab --calib "$j" --out "$tmp/never"
expect2 "--ratio" prune --ratio abc --method collab --calib "$j" --out "$tmp/never"
expect2 "--ratio 0.9 leaves 0 experts per group" prune --ratio 0.9 --method frequency --calib "$j" --max-tokens 64 --out "$tmp/never"
expect2 "--ratio 0.1 removes no expert" prune --ratio 0.1 --method frequency --calib "$j" --max-tokens 64 --out "$tmp/never"
expect2 "--method" prune --ratio 0.5 --method weights --calib "$j" --out "$tmp/never"
expect2 "required" prune --ratio 0.5 --method collab --out "$tmp/never"
# DeepSeek-V3 scores a group by its best two experts: a group of two cannot lose one
expect2 "best 2 experts" prune --ratio 0.5 --method frequency --calib "$j" --max-tokens 64 \
    --model "$tests/fixtures/models/deepseek_v3" --out "$tmp/never"
expect2 "pruning glm_moe_dsa models is not supported" prune --ratio 0.5 --method frequency \
    --calib "$j" --max-tokens 64 --model "$tests/fixtures/models/glm_moe_dsa" --out "$tmp/never"
mkdir "$tmp/exists"
"$bin" prune --ratio 0.5 --method frequency --calib "$j" --max-tokens 64 --out "$tmp/exists" \
    >/dev/null 2>"$tmp/e"
[ $? -ne 0 ] && grep -q -- "--out .*already exists" "$tmp/e" && [ -z "$(ls "$tmp/exists")" ] && ok ||
    bad "existing --out: $(cat "$tmp/e")"
# a corrupt trace: exit 1 naming the offset
head -c 300 "$tmp/s.rtrace" >"$tmp/cut.rtrace"
"$bin" analyze --calib "$tmp/cut.rtrace" --out "$tmp/never" >/dev/null 2>"$tmp/e"
[ $? -eq 1 ] && grep -q "offset" "$tmp/e" && ok || bad "truncated trace: $(cat "$tmp/e")"

echo "cli_collab: $pass passed, $fail failed"
[ $fail -eq 0 ]
