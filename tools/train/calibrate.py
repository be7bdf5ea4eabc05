"""Writes an infmoe model's adaptive-budget calibration into its config.json: per layer, the
0, 1/16, .., 1 quantiles of the tokens' mean predicted log-variance (infmoe_model.py,
`calibrate` and `adaptive_samples`) over held-out text, windows of --window tokens from each
file. A request with moe_samples_adaptive then spends its average K where the router is least
sure. The weights are not touched.

Usage: python3 tools/train/calibrate.py MODEL_DIR FILE... [--window 192] [--max-windows 8]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from infmoe_model import InfmoeForCausalLM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--window", type=int, default=192)
    ap.add_argument("--max-windows", type=int, default=8)
    args = ap.parse_args()
    from tokenizers import Tokenizer
    torch.set_num_threads(1)
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    model = InfmoeForCausalLM.load(args.model)
    seqs = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            ids = tok.encode(f.read(), add_special_tokens=False).ids
        for w in range(min(args.max_windows, len(ids) // args.window)):
            seqs.append(ids[w * args.window:(w + 1) * args.window])
    model.calibrate(seqs)
    cfg_path = os.path.join(args.model, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["adaptive_logvar_quantiles"] = model.config["adaptive_logvar_quantiles"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    print(f"{cfg_path}: calibrated on {len(seqs)} windows of {args.window} tokens")


if __name__ == "__main__":
    main()
