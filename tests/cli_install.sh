#!/usr/bin/env bash
# The binary from anywhere: `cmake --install` into a temporary prefix, then the installed
# `moeserve generate` without --model, run from an unrelated directory, finds the bundled model
# under the prefix; a copy of the binary with no model near it exits 2 naming every place it
# looked in.
# usage: cli_install.sh MOESERVE_BINARY TESTS_DIR
set -u
bin=$1
build=$(dirname "$bin")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }

if cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" 2>&1; then ok; else bad "cmake --install: $(tail -5 "$tmp/install.log")"; fi
[ -x "$tmp/prefix/bin/moeserve" ] && ok || bad "no bin/moeserve in the prefix"
[ -f "$tmp/prefix/share/moeserve/models/mohge-small/config.json" ] && ok || bad "no bundled model in the prefix"

mkdir -p "$tmp/elsewhere"
cd "$tmp/elsewhere"
if "$tmp/prefix/bin/moeserve" generate --prompt "ROMEO:" -n 4 >out 2>err; then ok; else bad "installed generate exited $?: $(head -c 400 err)"; fi
grep -q "^model: $tmp/prefix/bin/../share/moeserve/models/mohge-small (the bundled default)" err && ok || bad "not the prefix's model: $(head -c 400 err)"
grep -q "^decode: 4 tokens" err && ok || bad "no decode line: $(head -c 400 err)"

# a lone copy of the binary: nothing beside it, nothing in the cwd
mkdir -p "$tmp/bare/bin"
cp "$tmp/prefix/bin/moeserve" "$tmp/bare/bin/moeserve"
"$tmp/bare/bin/moeserve" generate --prompt hi -n 1 >out 2>err
rc=$?
[ "$rc" = 2 ] && ok || bad "no model: exit $rc, want 2"
grep -q "no --model given, and the bundled model (models/mohge-small) is in none of: models/mohge-small, $tmp/bare/bin/models/mohge-small, $tmp/bare/bin/../models/mohge-small, $tmp/bare/bin/../share/moeserve/models/mohge-small, .*/models/mohge-small" err && ok || bad "the places looked in are not named: $(head -c 600 err)"

echo "cli_install: $pass passed, $fail failed"
[ "$fail" = 0 ]
