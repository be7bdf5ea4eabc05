#!/usr/bin/env python3
"""Writes the two small lm-evaluation-harness tasks tests/server/test_lm_eval.py runs against the
server, from the bundled model's held-out data (tools/train/data):
  mc.jsonl, mc_rot.jsonl  multiple choice: "a+b=" with the true sum and three wrong ones; the
                          second file has every question's choices rotated by one place
  rolling.jsonl           rolling loglikelihood over held-out Shakespeare lines
Deterministic; rerun after changing the held-out files:  python3 tests/lm_eval/make_tasks.py
"""
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "tools", "train", "data")


def main():
    rnd = random.Random(11)
    mc = []
    with open(os.path.join(DATA, "arithmetic.heldout.txt")) as f:
        lines = [l.strip() for l in f if "=" in l][:24]
    for line in lines:
        q, a = line.split("=")
        wrong = set()
        while len(wrong) < 3:
            w = int(a) + rnd.choice([-100, -10, -1, 1, 10, 100, 11, -11])
            if w >= 0 and str(w) != a:
                wrong.add(str(w))
        choices = [a] + sorted(wrong)
        rnd.shuffle(choices)
        mc.append({"question": q + "=", "choices": choices, "answer": choices.index(a)})
    rot = [{"question": d["question"], "choices": d["choices"][1:] + d["choices"][:1],
            "answer": (d["answer"] - 1) % 4} for d in mc]
    with open(os.path.join(DATA, "shakespeare.heldout.txt")) as f:
        text = [l.rstrip("\n") for l in f if len(l.strip()) > 20][:12]
    for name, docs in (("mc.jsonl", mc), ("mc_rot.jsonl", rot),
                       ("rolling.jsonl", [{"text": t} for t in text])):
        with open(os.path.join(HERE, name), "w") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")


if __name__ == "__main__":
    main()
