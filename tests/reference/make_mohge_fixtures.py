"""Golden fixtures for the `mohge` architecture, written by our own reference implementation
(tools/train/mohge_model.py; transformers has no mohge).

1. tests/fixtures/models/mohge_tiny/: a tiny random checkpoint (hidden 64, 2 layers, 4 query /
   2 KV heads, 4 groups x 2 experts of widths 16/24/32/40, kg=2, k=2, one shared expert of
   width 32, untied embeddings, vocab 512) with the tokenizer of tests/fixtures/models/mixtral/,
   and reference.safetensors: prompt{i}.ids (int32), prompt{i}.logits (n, vocab) f32 from a full
   forward, prompt{i}.greedy (32 int32 tokens, plain argmax, full recompute each step).
2. With --trained DIR (default models/mohge-small, if present): DIR/reference.safetensors in the
   same format for three prompts of the trained model (weights as stored, computed in f32),
   plus, when the model has an MTP module (tools/train/train_mtp.py), prompt{i}.mtp_logits
   (n - 1, vocab: index i fuses token i + 1 with the trunk's normed h_i) and
   prompt{i}.mtp_chain_logits (vocab: index n - 2 fused with the module's own output at n - 3)
   in tests/test_mtp.c's format.

Weights of the tiny model are redrawn like make_model_fixtures.py does (projections
N(0, 1/fan_in), embeddings std 0.5, routers std 0.4 / group router std 0.2, norms 1 + 0.1 N) so
logits spread over several units and routing choices are clearly separated; the script prints
the smallest top-k / top-kg routing gaps so a fragile fixture is visible. Everything runs in
float32 on one thread with fixed seeds.

Usage: python3 tests/reference/make_mohge_fixtures.py [--trained DIR]
"""

import argparse
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "train"))
from mohge_model import MohgeForCausalLM, mohge_route  # noqa: E402

TINY = REPO / "tests" / "fixtures" / "models" / "mohge_tiny"
MIXTRAL = REPO / "tests" / "fixtures" / "models" / "mixtral"
SEED = 4321
GREEDY_TOKENS = 32
TINY_PROMPTS = [
    "First Citizen:\n",
    "ROMEO:\nBut soft, what light?",
    "Now is the winter of our discontent\nMade glorious summer by this sun; caf\u00e9 42!",
]
TRAINED_CANDIDATES = [
    ("shakespeare", ["ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING HENRY VI:\n",
                     "MENENIUS:\nWhat", "ROMEO:\nBut soft"]),
    ("arithmetic", ["12+35=", "3+4=7\n12+35=", "25+13=", "40+41=", "7+2=", "61+8=", "5+5=",
                    "23+14=", "50+27=", "8+31=", "44+3="]),
    ("json", ['{"id": 7, "name": "', '{"id": 12, "name": "Alice', '{"id": 3, "name": "Bob Kim"',
              '{"id": 88, "name": "Zoe Silva", "email": "']),
]

TINY_CONFIG = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=512, tie_word_embeddings=False, num_expert_groups=4,
    experts_per_group=2, group_intermediate_sizes=[16, 24, 32, 40], num_experts_per_tok=2,
    num_groups_per_tok=2, num_shared_experts=1, shared_intermediate_size=32, eos_token_id=0,
)


def redraw(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(tuple(p.shape), generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * r
            elif "embed_tokens" in name:
                v = 0.5 * r
            elif name.endswith("mlp.group_gate.weight"):
                v = 0.2 * r
            elif name.endswith("mlp.gate.weight"):
                v = 0.4 * r
            elif name.startswith("lm_head"):
                v = 2.0 * r / math.sqrt(p.shape[-1])
            else:
                v = r / math.sqrt(p.shape[-1])
            p.copy_(v)


@torch.no_grad()
def routing_gaps(model, seqs):
    """Smallest relative gap (kg-th - (kg+1)-th) / kg-th group score, and the same for the k-th
    and (k+1)-th q, over every layer and token. Relative: the engine's rounding of a score is
    relative to it (a sigmoid deep in its lower tail, a q of a weakly kept group), so a gap of
    1e-5 between scores of 1e-4 is as safe as one of 0.1 between scores of 1."""
    gaps = [math.inf, math.inf]
    for ids in seqs:
        hook_in = []
        hs = [layer.mlp.register_forward_hook(lambda mod, inp, out: hook_in.append((mod, inp[0])))
              for layer in model.model.layers]
        model(torch.tensor([ids]))
        for h in hs:
            h.remove()
        for mod, x in hook_in:
            x = x.reshape(-1, x.shape[-1])
            s = torch.sigmoid(x @ mod.group_gate.weight.t())
            if mod.kg < mod.G:
                v = torch.sort(s, -1, descending=True).values
                gaps[0] = min(gaps[0], float(((v[:, mod.kg - 1] - v[:, mod.kg])
                                              / v[:, mod.kg - 1]).min()))
            _, _, s2, mask, p = mohge_route(x, mod.group_gate.weight, mod.gate.weight, mod.G,
                                            mod.kg, mod.k)
            sg = s2 * mask
            sg = sg / sg.sum(-1, keepdim=True)
            q = (p * sg[:, :, None] * mask[:, :, None]).reshape(x.shape[0], -1)
            q = q / q.sum(-1, keepdim=True)
            v = torch.sort(q, -1, descending=True).values
            gaps[1] = min(gaps[1], float(((v[:, mod.k - 1] - v[:, mod.k]) / v[:, mod.k - 1]).min()))
    return gaps


@torch.no_grad()
def greedy_margin(model, ids):
    """GREEDY argmax tokens (full recompute each step) and the smallest top1-top2 logit gap."""
    seq, out, margin = list(ids), [], math.inf
    for _ in range(GREEDY_TOKENS):
        logits, _ = model(torch.tensor([seq]))
        top2 = torch.topk(logits[0, -1], 2)
        margin = min(margin, float(top2.values[0] - top2.values[1]))
        out.append(int(top2.indices[0]))
        seq.append(out[-1])
    return out, margin


def prompt_stats(model, ids):
    gr, margin = greedy_margin(model, ids)
    ggap, kgap = routing_gaps(model, [ids + gr])
    return gr, margin, ggap, kgap


@torch.no_grad()
def write_reference(model, folder, prompts):
    tensors = {}
    for i, ids in enumerate(prompts):
        logits, _ = model(torch.tensor([ids]))
        gr, margin, ggap, kgap = prompt_stats(model, ids)
        tensors[f"prompt{i}.ids"] = torch.tensor(ids, dtype=torch.int32)
        tensors[f"prompt{i}.logits"] = logits[0].float().contiguous()
        tensors[f"prompt{i}.greedy"] = torch.tensor(gr, dtype=torch.int32)
        if model.config.get("num_nextn_predict_layers", 0) > 0 and len(ids) >= 3:
            # the MTP module at indices 0..n-2 (token i+1 with the trunk's normed h_i), and
            # index n-2 chained on the module's own output at n-3 (before its head's norm)
            hid = []
            model(torch.tensor([ids]), hidden=hid)
            h = hid[0][:, :-1]
            mlog, out = model.mtp_forward(torch.tensor([ids]), h)
            h2 = h.clone()
            h2[:, -1] = out[:, -2]
            clog, _ = model.mtp_forward(torch.tensor([ids]), h2)
            tensors[f"prompt{i}.mtp_logits"] = mlog[0].float().contiguous()
            tensors[f"prompt{i}.mtp_chain_logits"] = clog[0, -1].float().contiguous()
        print(f"  prompt{i}: {len(ids)} tokens, min greedy top1-top2 {margin:.3g}, "
              f"min group-score gap {ggap:.3g}, min top-k prob gap {kgap:.3g}")
    save_file(tensors, str(folder / "reference.safetensors"), metadata={"format": "pt"})


def build_tiny():
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(MIXTRAL / "tokenizer.json"))
    torch.manual_seed(SEED)
    model = MohgeForCausalLM(TINY_CONFIG)
    redraw(model, SEED)
    model.eval()
    if TINY.exists():
        shutil.rmtree(TINY)
    model.save(str(TINY))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(MIXTRAL / f, TINY / f)
    model = MohgeForCausalLM.load(str(TINY))
    prompts = [tok.encode(t, add_special_tokens=False).ids for t in TINY_PROMPTS]
    print("mohge_tiny:")
    write_reference(model, TINY, prompts)


def build_trained(folder):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = MohgeForCausalLM.load(str(folder))
    # The first candidate of each domain whose greedy margins (>= 2e-3 logits) and relative
    # routing gaps (>= 1e-3) are hundreds of times the engine's rounding (~1e-6 relative, ~2e-5
    # absolute on logits), so another CPU or BLAS cannot flip a token or an expert choice.
    chosen = []
    for domain, cands in TRAINED_CANDIDATES:
        for text in cands:
            ids = tok.encode(text, add_special_tokens=False).ids
            gr, margin, ggap, kgap = prompt_stats(model, ids)
            ok = margin >= 2e-3 and ggap >= 1e-3 and kgap >= 1e-3
            print(f"  {domain} {text!r}: margin {margin:.3g}, group gap {ggap:.3g}, "
                  f"top-k gap {kgap:.3g}{'' if ok else ' (rejected)'}")
            if ok:
                chosen.append(ids)
                print("     ", repr(tok.decode(ids + gr)))
                break
    if len(chosen) < 2:
        raise SystemExit("fewer than two robust prompts for the trained model")
    print(f"{folder}:")
    write_reference(model, folder, chosen)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trained", default=str(REPO / "models" / "mohge-small"))
    ap.add_argument("--skip-tiny", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if not args.skip_tiny:
        build_tiny()
    tr = Path(args.trained)
    if (tr / "model.safetensors").exists():
        build_trained(tr)


if __name__ == "__main__":
    main()
