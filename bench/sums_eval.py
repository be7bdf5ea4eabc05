#!/usr/bin/env python3
"""How many two-digit sums a bundled-style model gets right: N random "a+b=" prompts (a fixed
seed, so every model sees the same ones), greedy `moeserve generate`, the digits before the
first line break compared with a + b. The prompt is the whole context (position 0), which the
third training phase (windows starting after line breaks) teaches.

  python3 bench/sums_eval.py --model models/mohge-small [--n 30] [-- extra generate flags]

Prints "MODEL: R of N right" and exits 0.
"""
import argparse
import os
import random
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("extra", nargs="*", help="more `moeserve generate` flags (after --)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    right = 0
    for _ in range(args.n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out = subprocess.run([os.path.join(args.build, "moeserve"), "generate", "--model",
                              args.model, "--prompt", "%d+%d=" % (a, b), "--max-tokens", "5",
                              "--threads", "1"] + args.extra,
                             capture_output=True, text=True, check=True).stdout
        right += out.split("\n", 1)[0].strip() == str(a + b)
    print("%s: %d of %d right" % (args.model, right, args.n))


if __name__ == "__main__":
    main()
