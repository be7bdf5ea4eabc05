"""Trains a multi-token-prediction module (mohge_model.MohgeMTP, DeepSeek-V3's layout) for a
trained mohge model whose own weights stay frozen, and writes the model folder with the module
added (config num_nextn_predict_layers 1, mtp_intermediate_size), as the families ship theirs.

The trunk is the model as committed (bf16 values computed in f32, what the engine serves), so
the module learns from exactly the hidden states it will be fed: h_i after the final norm.
Index i fuses h_i with token i + 1 and is trained to predict token i + 2 (cross-entropy over
every index of every training window). The data are the training splits of the three domains
(corpus.py), mixed as the last training phase mixed them; the held-out loss of the module and,
for comparison, of the trunk's own next-token prediction are printed per domain.

Usage: python3 tools/train/train_mtp.py --model models/mohge-small --out /tmp/mohge_mtp
       [--data /tmp/mohge_corpus] [--steps 1500] [--width 384] [--threads 2]
then: python3 tools/train/export.py /tmp/mohge_mtp models/mohge-small
      python3 tests/reference/make_mohge_fixtures.py --skip-tiny
"""

import argparse
import json
import math
import os
import random
import shutil
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
from mohge_model import MohgeForCausalLM  # noqa: E402
from train import batch, encode_domains  # noqa: E402


def mtp_loss(model, x):
    """Mean cross-entropy of the module over indices 0..T-3 of each row of x (B, T)."""
    with torch.no_grad():
        hid = []
        model(x, hidden=hid)
    logits, _ = model.mtp_forward(x[:, :-1], hid[0][:, :-2])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))


@torch.no_grad()
def heldout(model, held, seq, windows=16):
    """Per domain: (module loss on token i + 2, trunk loss on token i + 1) over windows."""
    out = {}
    for d, ids in held.items():
        mt = tr = 0.0
        n = min(windows, (len(ids) - 1) // (seq + 1))
        for w in range(n):
            x = ids[w * (seq + 1):(w + 1) * (seq + 1)][None]
            mt += float(mtp_loss(model, x))
            logits, _ = model(x[:, :-1])
            tr += float(F.cross_entropy(logits[0], x[0, 1:]))
        out[d] = (mt / n, tr / n)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the trained mohge folder (frozen)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default="/tmp/mohge_corpus")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--width", type=int, default=384, help="the module's FFN width")
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--seq", type=int, default=192)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", default="1,2,1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    cfg["mtp_intermediate_size"] = args.width
    model = MohgeForCausalLM(cfg)
    from safetensors.torch import load_file
    trunk = {k: v.float() for k, v in
             load_file(os.path.join(args.model, "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    pre = "model.layers.%d." % cfg["num_hidden_layers"]
    if unexpected or any(not k.startswith(pre) for k in missing):
        raise SystemExit(f"{args.model}: not a mohge trunk ({unexpected or missing})")
    mod = model.mtp()
    D = cfg["hidden_size"]
    with torch.no_grad():  # projections N(0, 0.02), the down projections scaled as train.py's
        for name, p in mod.named_parameters():
            if name.endswith("norm.weight"):
                continue
            s = 0.02 / (math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1)
            p.copy_(torch.randn(p.shape) * s)
        # start close to "the trunk's state carries the prediction": the hidden half of eh_proj
        # near the identity
        mod.eh_proj.weight[:, D:] += torch.eye(D)
    for n, p in model.named_parameters():
        p.requires_grad = n.startswith(pre)
    model.train()

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    data = encode_domains(tok, args.data, "train")
    held = encode_domains(tok, args.data, "heldout")
    mix = []
    for d, r in zip(corpus.DOMAINS, args.mix.split(",")):
        mix += [d] * int(r)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": nodecay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    print(f"module: {sum(p.numel() for p in params)} parameters (FFN width {args.width})")
    t0 = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(data, rng, args.batch, args.seq, mix)
        x = torch.cat([x, y[:, -1:]], dim=1)  # the whole window: index i predicts i + 2
        loss = mtp_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} lr {lr:.2e} {time.time() - t0:.0f}s",
                  flush=True)
    model.eval()
    for d, (mt, tr) in heldout(model, held, args.seq).items():
        print(f"held-out {d}: module (token i+2) {mt:.4f} nats, trunk (token i+1) {tr:.4f}")
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    model.save(args.out)  # f32, as train.py's checkpoints (export.py writes bf16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(args.model, f), os.path.join(args.out, f))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
