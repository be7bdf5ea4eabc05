"""Golden fixtures for the `infmoe` architecture (continuous experts), written by our own
reference implementation (tools/train/infmoe_model.py; transformers has no infmoe).

tests/fixtures/models/infmoe_tiny/: a tiny random checkpoint (hidden 64, 2 layers, 4 query /
2 KV heads, one FFN of 256 neurons per layer, latent z of 8, neuron_fraction 0.125 = 32 neurons
per sample, num_samples 4, max_samples 8, untied embeddings, vocab 512) with the tokenizer of
tests/fixtures/models/mixtral/, and reference.safetensors holding, per prompt i:
  prompt{i}.ids                 int32 (n)
  prompt{i}.logits              f32 (n, vocab) at the default budget (K = 4, fraction 0.125)
  prompt{i}.logits_k1 / _k2     the same at K = 1 / K = 2
  prompt{i}.logits_k2_f0625     K = 2, neuron fraction 0.0625 (16 neurons per sample)
  prompt{i}.logits_adaptive_k2  the adaptive budget at an average K = 2 (each token 1..3
                                samples by its rank in the config's calibration of the
                                router's log-variance, measured on CALIBRATION text)
  prompt{i}.greedy / greedy_k1  32 greedy tokens (plain argmax, full recompute each step)
  prompt{i}.neurons_k1 / _k2 / neurons  int32 (n_layer): FFN neurons computed over the
                                prompt's tokens in each layer (per token: the union of its K
                                slices), what the engine's counter must report
Weights are redrawn (projections N(0, 1/fan_in), embeddings std 0.5, norms 1 + 0.1 N, keys
N(0, 1), router weights N(0, 1/D) with the log-variance half's bias at -1) so that samples
really differ and logits spread. The seed is the first from SEED whose smallest gap between a
sample's N-th and (N+1)-th neuron score, over every prompt, greedy continuation, layer, token,
sample and budget above, is at least MIN_GAP, so rounding in another implementation (~1e-6)
cannot flip a neuron choice (and whose adaptive K's are at least MIN_GAP / 1000 from a
rounding boundary). Everything runs in float32 on one thread.

With --trained DIR (default models/infmoe-small, if present): DIR/reference.safetensors in the
same format for one prompt per domain of the trained model, the candidate of its domain
(TRAINED_CANDIDATES) with the largest smallest neuron-score gap.

Usage: python3 tests/reference/make_infmoe_fixtures.py [--trained DIR] [--skip-tiny]
"""

import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "train"))
from infmoe_model import (LOGVAR_MAX, LOGVAR_MIN, InfmoeForCausalLM, neurons_kept,  # noqa: E402
                          quasi_offsets)

TINY = REPO / "tests" / "fixtures" / "models" / "infmoe_tiny"
MIXTRAL = REPO / "tests" / "fixtures" / "models" / "mixtral"
SEED = 1789  # where the search starts (it took 1791 last; earlier searches began at 1607)
MIN_GAP = 2e-5
GREEDY_TOKENS = 32
PROMPTS = [
    "First Citizen:\n",
    "ROMEO:\nBut soft, what light?",
    "Now is the winter of our discontent\nMade glorious summer by this sun; caf\u00e9 42!",
]
TINY_CONFIG = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=512, tie_word_embeddings=False, intermediate_size=256, latent_dim=8,
    neuron_fraction=0.125, num_samples=4, max_samples=8, eos_token_id=0,
)
# (name suffix, K, fraction, adaptive) of every budget recorded
BUDGETS = [("", None, None, False), ("_k1", 1, None, False), ("_k2", 2, None, False),
           ("_k2_f0625", 2, 0.0625, False), ("_adaptive_k2", 2, None, True)]
# The adaptive budget's calibration text (not the prompts: a prompt token sitting exactly on a
# calibration quantile would sit on a rounding boundary of its K).
CALIBRATION = ["To be, or not to be, that is the question:\n", "Whether 'tis nobler in the mind",
               "12+35=47\n3+4=7\n", '{"id": 7, "name": "Ada"}\n']


def redraw(model, seed):
    g = torch.Generator().manual_seed(seed)
    Z = model.config["latent_dim"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(tuple(p.shape), generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * r
            elif "embed_tokens" in name:
                v = 0.5 * r
            elif name.endswith("neuron_keys.weight"):
                v = r
            elif name.endswith("router.bias"):
                v = 0.1 * r
                v[Z:] -= 1.0
            elif name.startswith("lm_head"):
                v = 2.0 * r / math.sqrt(p.shape[-1])
            else:
                v = r / math.sqrt(p.shape[-1])
            p.copy_(v)


@torch.no_grad()
def adaptive_margin(model, ids, K):
    """Smallest distance of 2 (K - 1) r + 1/2 to an integer (a K rounding boundary) over layers
    and tokens."""
    inputs = []
    hs = [layer.mlp.register_forward_hook(lambda mod, inp, out: inputs.append((mod, inp[0])))
          for layer in model.model.layers]
    model(torch.tensor([ids]), K, None, None, True)
    for h in hs:
        h.remove()
    worst = math.inf
    for mod, x in inputs:
        u = mod.mean_logvar(x.reshape(-1, x.shape[-1])).tolist()
        q = mod.quantiles
        for ui in u:
            if ui <= q[0] or ui >= q[-1]:
                continue
            i = max(j for j in range(len(q) - 1) if ui >= q[j])
            r = (i + (ui - q[i]) / (q[i + 1] - q[i])) / (len(q) - 1)
            v = 2.0 * (K - 1) * r + 0.5
            worst = min(worst, abs(v - round(v)))
    return worst


@torch.no_grad()
def min_gap(model, ids, K, frac):
    """Smallest N-th minus (N+1)-th neuron score over layers, tokens and samples."""
    inputs = []
    hs = [layer.mlp.register_forward_hook(lambda mod, inp, out: inputs.append((mod, inp[0])))
          for layer in model.model.layers]
    model(torch.tensor([ids]), K, frac)
    for h in hs:
        h.remove()
    gap = math.inf
    for mod, x in inputs:
        x = x.reshape(-1, x.shape[-1])
        k = K or mod.K
        n_sel = neurons_kept(frac or mod.fraction, mod.F)
        r = mod.router(x)
        mu, lv = r[:, :mod.Z], r[:, mod.Z:].clamp(LOGVAR_MIN, LOGVAR_MAX)
        z = mu[:, None] + torch.exp(0.5 * lv)[:, None] * quasi_offsets(k, mod.Z)[None]
        s = torch.sort((z * mod.Z ** -0.5) @ mod.neuron_keys.weight.t(), -1, descending=True).values
        gap = min(gap, float((s[..., n_sel - 1] - s[..., n_sel]).min()))
    return gap


@torch.no_grad()
def greedy(model, ids, K):
    seq, out, margin = list(ids), [], math.inf
    for _ in range(GREEDY_TOKENS):
        logits, _ = model(torch.tensor([seq]), K)
        top2 = torch.topk(logits[0, -1], 2)
        margin = min(margin, float(top2.values[0] - top2.values[1]))
        out.append(int(top2.indices[0]))
        seq.append(out[-1])
    return out, margin


@torch.no_grad()
def build(seed, prompts):
    from tokenizers import Tokenizer
    torch.manual_seed(seed)
    model = InfmoeForCausalLM(TINY_CONFIG)
    redraw(model, seed)
    model.eval()
    tok = Tokenizer.from_file(str(MIXTRAL / "tokenizer.json"))
    model.calibrate([tok.encode(t, add_special_tokens=False).ids for t in CALIBRATION])
    return (model,) + reference_tensors(model, prompts)


@torch.no_grad()
def reference_tensors(model, prompts):
    """Every tensor of the module comment for these prompts, the smallest neuron-score gap and
    the smallest greedy top1-top2 margin."""
    tensors, worst_gap, worst_margin = {}, math.inf, math.inf
    for i, ids in enumerate(prompts):
        tensors[f"prompt{i}.ids"] = torch.tensor(ids, dtype=torch.int32)
        for suffix, K, frac, adaptive in BUDGETS:
            if adaptive and "adaptive_logvar_quantiles" not in model.config:
                continue
            stats = []
            logits, _ = model(torch.tensor([ids]), K, frac, stats, adaptive)
            tensors[f"prompt{i}.logits{suffix}"] = logits[0].float().contiguous()
            tensors[f"prompt{i}.neurons{suffix}"] = torch.tensor(stats, dtype=torch.int32)
            if adaptive:  # its samples are the first 1..2K-1 of max_samples: checked below
                worst_gap = min(worst_gap, 1e3 * adaptive_margin(model, ids, K))
                continue
            worst_gap = min(worst_gap, min_gap(model, ids, K, frac))
        if "adaptive_logvar_quantiles" in model.config:
            worst_gap = min(worst_gap, min_gap(model, ids, model.config["max_samples"], None))
        for suffix, K in (("", None), ("_k1", 1)):
            gr, margin = greedy(model, ids, K)
            tensors[f"prompt{i}.greedy{suffix}"] = torch.tensor(gr, dtype=torch.int32)
            worst_margin = min(worst_margin, margin)
            worst_gap = min(worst_gap, min_gap(model, ids + gr, K, None))
    return tensors, worst_gap, worst_margin


# One prompt per domain for a trained model, each the candidate (in this order) whose smallest
# neuron-score gap is largest: a trained model's 3072 scores crowd, and over some 2,000 (token,
# layer, sample) choices one within ~1e-7 of the threshold is likely, where another summation
# order (another CPU's kernels) could flip a neuron. The random tiny model is searched by seed
# instead.
TRAINED_CANDIDATES = [
    ["ROMEO:\nBut soft", "JULIET:\nO", "KING HENRY:\nNow", "First Citizen:\nWe", "HAMLET:\nTo be",
     "MENENIUS:\nWhy", "LADY:\nMy lord", "GLOUCESTER:\nNow is"],
    ["12+35=", "47+21=", "90+18=", "33+66=", "58+29=", "71+44=", "15+80=", "26+37="],
    ['{"id": 7, "name": "', '{"id": 12, "city": "', '{"name": "', '{"id": 3, "tags": [',
     '{"id": 41, "ok": ', '{"user": "', '{"id": 9, "score": ', '{"item": "'],
]


def build_trained(folder):
    """DIR/reference.safetensors in the same format for one prompt per domain of a trained
    model (weights as stored, computed in f32); prints the gaps so a fragile reference shows."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = InfmoeForCausalLM.load(str(folder))
    prompts = []
    for cands in TRAINED_CANDIDATES:
        best = None
        for text in cands:
            ids = tok.encode(text, add_special_tokens=False).ids
            _, gap, margin = reference_tensors(model, [ids])
            print(f"  candidate {text!r}: min gap {gap:.3g}, greedy margin {margin:.3g}")
            if margin >= 1e-3 and (best is None or gap > best[0]):
                best = (gap, ids, text)
        if best is None:
            raise SystemExit(f"no candidate of {cands[0]!r}'s domain has a robust greedy margin")
        print(f"chosen {best[2]!r}")
        prompts.append(best[1])
    tensors, gap, margin = reference_tensors(model, prompts)
    print(f"{folder}: min neuron-score gap {gap:.3g}, min greedy top1-top2 {margin:.3g}")
    save_file(tensors, str(folder / "reference.safetensors"), metadata={"format": "pt"})


def main():
    import argparse
    from tokenizers import Tokenizer
    ap = argparse.ArgumentParser()
    ap.add_argument("--trained", default=str(REPO / "models" / "infmoe-small"),
                    help="also write DIR/reference.safetensors for a trained model, if present")
    ap.add_argument("--skip-tiny", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if (Path(args.trained) / "model.safetensors").exists():
        build_trained(Path(args.trained))
    if args.skip_tiny:
        return
    tok = Tokenizer.from_file(str(MIXTRAL / "tokenizer.json"))
    prompts = [tok.encode(t, add_special_tokens=False).ids for t in PROMPTS]
    for seed in range(SEED, SEED + 200):
        model, tensors, gap, margin = build(seed, prompts)
        print(f"seed {seed}: min neuron-score gap {gap:.3g}, min greedy top1-top2 {margin:.3g}")
        if gap >= MIN_GAP and margin >= 1e-3:
            break
    else:
        raise SystemExit("no seed gives robust fixtures")
    if TINY.exists():
        shutil.rmtree(TINY)
    model.save(str(TINY))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(MIXTRAL / f, TINY / f)
    # the saved folder must reproduce the reference exactly
    again = InfmoeForCausalLM.load(str(TINY))
    check, _ = again(torch.tensor([prompts[0]]))
    assert torch.equal(check[0], tensors["prompt0.logits"])
    save_file(tensors, str(TINY / "reference.safetensors"), metadata={"format": "pt"})
    for i in range(len(prompts)):
        print(f"  prompt{i}: {len(prompts[i])} tokens, neurons per layer k1 "
              f"{tensors[f'prompt{i}.neurons_k1'].tolist()} k2 "
              f"{tensors[f'prompt{i}.neurons_k2'].tolist()} default "
              f"{tensors[f'prompt{i}.neurons'].tolist()}")


if __name__ == "__main__":
    main()
