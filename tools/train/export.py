"""Exports a training checkpoint folder (written by train.py, f32) as the committed model:
weights cast to bfloat16 (the engine converts them to f32 at load), config.json,
generation_config.json, tokenizer.json and tokenizer_config.json. Prints the folder size,
which must stay under 20 MB. Run tests/reference/make_mohge_fixtures.py afterwards to write the
folder's reference.safetensors (golden logits computed from the bf16 values in f32).

infmoe checkpoints (train.py --preset infmoe) export the same way, to the OUT_DIR given.

Usage: python3 tools/train/export.py CKPT_DIR [OUT_DIR (default models/mohge-small)]
"""

import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from infmoe_model import InfmoeForCausalLM  # noqa: E402
from mohge_model import MohgeForCausalLM  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    src = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(REPO, "models", "mohge-small")
    with open(os.path.join(src, "config.json")) as f:
        infmoe = json.load(f).get("model_type") == "infmoe"
    model = (InfmoeForCausalLM if infmoe else MohgeForCausalLM).load(src)
    if os.path.exists(out):
        shutil.rmtree(out)
    model.save(out, dtype=torch.bfloat16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(src, f), os.path.join(out, f))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{out}: {size / 1e6:.1f} MB")
    if size > 20e6:
        raise SystemExit("model folder is over 20 MB")


if __name__ == "__main__":
    main()
