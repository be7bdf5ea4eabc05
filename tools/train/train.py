"""Training loop for the bundled mohge model (and its homogeneous-experts baseline).

Builds the corpus and tokenizer (corpus.py) unless they exist, tokenizes each domain's train
split once, and trains MohgeForCausalLM with AdamW (warmup + cosine over --steps) on batches
that mix the domains equally (every row is one random window of one domain). A checkpoint
folder (config, weights, tokenizer) is written every --ckpt-minutes and at the end, so a run
stopped early still yields a model; the run also stops on --max-minutes. The last lines of the
log give held-out loss per domain computed by the reference implementation.

--preset small      the committed model: hidden 192, 4 layers, 4 groups x 4 experts of widths
                    96/160/224/288 (x0.5..x1.5 of 192), k=2, kg=2, one shared expert of 192
--preset homogeneous the baseline: the same, but one group of 16 experts of width 192 (equal
                    total and mean active parameters); not shipped
--preset difficulty the small model with difficulty-steered routing (issue: MoHGE routing by
                    difficulty): a width cost centred on the batch's median loss, easy tokens
                    pushed narrow, hard ones wide; difficulty_narrow doubles the group
                    loss, difficulty_lean shifts the weights so every token is also pushed
                    narrow (group_loss_difficulty_offset 0.5); difficulty_budget sets
                    that offset by a controller to a mean routed width of 142, ranks tokens
                    within their sequence and balances inside groups 5x harder
                    (difficulty_budget_bal: 15x)
--preset infmoe     continuous experts (infmoe_model.py) on the same skeleton, at most the
                    same active FFN width per token at its default K = 2

--init DIR continues from a checkpoint (the shipped model was trained in two phases, see
README.md); --mix sets how many batch rows each domain gets per cycle. --resume picks a stopped
run up where its last checkpoint in --out left it, exactly: every checkpoint also holds the
optimizer state, the step, the elapsed time (the schedule depends on it) and the random states,
so a run can be spread over several sittings.

Usage: python3 train.py --out DIR [--preset small|homogeneous|infmoe] [--steps N] [--threads 1]
                        [--init DIR] [--mix 1,1,1] [--resume]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
from infmoe_model import InfmoeForCausalLM  # noqa: E402
from mohge_model import MohgeForCausalLM  # noqa: E402

PRESETS = {
    "small": dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=48, vocab_size=2048, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True,
                  num_expert_groups=4, experts_per_group=4,
                  group_intermediate_sizes=[96, 160, 224, 288], num_experts_per_tok=2,
                  num_groups_per_tok=2, num_shared_experts=1, shared_intermediate_size=192,
                  group_loss_coef=0.01, group_loss_delta=96.0, balance_loss_coef=0.01,
                  eos_token_id=[0, 2]),
}
PRESETS["homogeneous"] = dict(PRESETS["small"], num_expert_groups=1, experts_per_group=16,
                              group_intermediate_sizes=[192], num_groups_per_tok=1)
# The same model trained with difficulty-steered routing (mohge_model.py loss): the group loss
# plus 2 x each token's expected relative width weighted by (1 - 2 r), r its loss rank in the
# batch.
PRESETS["difficulty"] = dict(PRESETS["small"], group_loss_difficulty=2.0)
# The same with twice the group loss: difficulty raised the mean routed width by 4.5%; this
# presses it back toward today's.
PRESETS["difficulty_narrow"] = dict(PRESETS["difficulty"], group_loss_coef=0.02)
# The split's weights moved by 0.5 (1.5 - 2 r): both variants above routed wider than today on
# average, so every token gets a net push toward narrow groups as well.
PRESETS["difficulty_lean"] = dict(PRESETS["difficulty"], group_loss_difficulty_offset=0.5)
# Neither a fixed offset of 0 nor of 0.5 gave both the split and today's width: here a
# controller sets the offset so that the mean routed width settles at 142 (today's model: 149),
# tokens are ranked within their own sequence (one domain) rather than the mixed batch, and the
# balance loss inside groups is five times today's, since the mohge placement's device balance
# is the groups' inner balance (expert i of every group on device i).
PRESETS["difficulty_budget"] = dict(PRESETS["difficulty"], group_loss_width_target=142.0,
                                    group_loss_difficulty_rank="row", balance_loss_coef=0.05)
# The same with the balance loss at 15 x today's.
PRESETS["difficulty_budget_bal"] = dict(PRESETS["difficulty_budget"], balance_loss_coef=0.15)
# Both balanced the groups over the training batch, but their experts specialise by domain,
# so on the held-out mix (more arithmetic than a batch) one expert of a group carries up to
# twice its share: here the balance loss is taken per sequence (one domain each) at 10 x
# today's, and the split weighs 3 instead of 2.
PRESETS["difficulty_seqbal"] = dict(PRESETS["difficulty_budget"], balance_loss_scope="sequence",
                                    balance_loss_coef=0.1, group_loss_difficulty=3.0)
# Both bought balance with the experts' domain specialisation (collaboration groups that no
# longer follow the domains): the width target and row ranks with today's balance loss, the
# split weighted 3.
PRESETS["difficulty_target"] = dict(PRESETS["difficulty_budget"], balance_loss_coef=0.01,
                                    group_loss_difficulty=3.0)
# Continuous experts (infmoe_model.py) on the same skeleton: one FFN of 3072 neurons per layer,
# 288 kept per sample (neuron_fraction 0.09375), K = 2 trained samples, so a token computes at
# most 576 neurons: the mohge model's mean active width (shared 192 + 2 experts of mean 192).
_SKELETON = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
             "tie_word_embeddings", "eos_token_id")
PRESETS["infmoe"] = dict({k: PRESETS["small"][k] for k in _SKELETON}, model_type="infmoe",
                         architectures=["InfmoeForCausalLM"], intermediate_size=3072,
                         latent_dim=16, neuron_fraction=0.09375, num_samples=2, max_samples=8,
                         balance_loss_coef=0.01, kl_loss_coef=0.001)


def model_class(cfg):
    return InfmoeForCausalLM if cfg.get("model_type") == "infmoe" else MohgeForCausalLM


def encode_domains(tok, data_dir, split):
    out = {}
    for d in corpus.DOMAINS:
        with open(os.path.join(data_dir, f"{d}.{split}.txt"), encoding="utf-8") as f:
            text = f.read()
        out[d] = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    return out


def line_starts(tok, data):
    """Per domain, the offsets whose previous token ends a line: windows starting there teach
    the model to predict at position 0 with no context (e.g. a prompt "12+35=")."""
    nl = {i for i in range(tok.get_vocab_size()) if tok.id_to_token(i) and
          tok.decode([i]).endswith("\n")}
    out = {}
    for d, ids in data.items():
        lst = ids.tolist()
        out[d] = [i + 1 for i in range(len(lst) - 1) if lst[i] in nl]
    return out


def batch(data, rng, bsz, seq, mix, starts=None, start_frac=0.0):
    """mix: domains in row order, repeated (a domain listed twice gets twice the rows).
    With starts, a start_frac share of the rows begins right after a line break."""
    rows = []
    for i in range(bsz):
        d = mix[i % len(mix)]
        ids = data[d]
        o = rng.randrange(0, len(ids) - seq - 1)
        if starts and rng.random() < start_frac:
            o = min(rng.choice(starts[d]), len(ids) - seq - 2)
        rows.append(ids[o:o + seq + 1])
    x = torch.stack(rows)
    return x[:, :-1], x[:, 1:]


@torch.no_grad()
def heldout_loss(model, held, seq, max_windows=16):
    model.eval()
    res = {}
    for d, ids in held.items():
        tot, n = 0.0, 0
        for w in range(min(max_windows, (len(ids) - 1) // seq)):
            x = ids[w * seq:(w + 1) * seq + 1]
            logits, _ = model(x[None, :-1])
            tot += torch.nn.functional.cross_entropy(logits[0], x[1:], reduction="sum").item()
            n += seq
        res[d] = tot / max(n, 1)
    model.train()
    return res


def save_ckpt(model, out, data_dir, step, log, resume_state=None):
    tmp = out + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    model.save(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(data_dir, f), os.path.join(tmp, f))
    with open(os.path.join(tmp, "train_state.json"), "w") as f:
        json.dump({"step": step, "log": log[-20:]}, f, indent=1)
    if resume_state is not None:  # what --resume needs beyond the weights
        torch.save(resume_state, os.path.join(tmp, "resume.pt"))
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)


# Arguments that may change between the sittings of one run.
RESUME_FREE = ("resume", "threads", "ckpt_minutes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default="/tmp/mohge_corpus")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--seq", type=int, default=192)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=48.0)
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--init", default=None, help="continue from this checkpoint folder's weights "
                    "(fresh optimizer, new warmup + cosine)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run whose checkpoint is in --out (same other arguments)")
    ap.add_argument("--line-starts", type=float, default=0.0,
                    help="share of rows whose window starts at a line boundary (phase 3)")
    ap.add_argument("--mix", default="1,1,1", help="rows per batch cycle for "
                    + ",".join(corpus.DOMAINS))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if not os.path.exists(os.path.join(args.data, "tokenizer.json")):
        corpus.build(args.data)
        corpus.train_tokenizer(args.data)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(args.data, "tokenizer.json"))
    train = encode_domains(tok, args.data, "train")
    held = encode_domains(tok, args.data, "heldout")
    cfg = dict(PRESETS[args.preset], vocab_size=tok.get_vocab_size())
    cls = model_class(cfg)
    resume = None
    if args.resume:
        path = os.path.join(args.out, "resume.pt")
        if not os.path.exists(path):
            raise SystemExit(f"--resume: no {path} (a checkpoint written by this train.py)")
        resume = torch.load(path, weights_only=False)
        if resume["args"] != {k: v for k, v in vars(args).items() if k not in RESUME_FREE}:
            raise SystemExit("--resume: the arguments differ from the stopped run's: "
                             + json.dumps(resume["args"]))
        model = cls.load(args.out)
        model.train()
    elif args.init:
        model = cls.load(args.init)
        model.train()
        for k, v in cfg.items():
            if k == "group_loss_difficulty_offset" and cfg.get("group_loss_width_target"):
                continue  # a controller's state, carried from the checkpoint
            if model.config.get(k) != v:
                raise SystemExit(f"--init {args.init}: config {k} differs from preset")
    else:
        model = cls(cfg)
        model.init_weights(seed=args.seed)
    starts = line_starts(tok, train) if args.line_starts > 0 else None
    mix = [d for d, n in zip(corpus.DOMAINS, map(int, args.mix.split(","))) for _ in range(n)]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"preset {args.preset}: {n_params} parameters; tokens per domain "
          + ", ".join(f"{d}={len(v)}" for d, v in train.items()), flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = random.Random(args.seed)
    t0 = time.time()
    log = []
    step = first = 0
    if resume:
        opt.load_state_dict(resume["opt"])
        rng.setstate(resume["py_rng"])
        torch.set_rng_state(resume["torch_rng"])
        t0 -= resume["elapsed"]
        log = resume["log"]
        first = step = resume["step"]
        print(f"resuming at step {step + 1} ({resume['elapsed']:.0f} s done)", flush=True)
    last_ckpt = time.time()
    run_args = {k: v for k, v in vars(args).items() if k not in RESUME_FREE}

    def state():
        return {"opt": opt.state_dict(), "py_rng": rng.getstate(),
                "torch_rng": torch.get_rng_state(), "elapsed": time.time() - t0,
                "log": log, "step": step, "args": run_args}

    for step in range(first + 1, args.steps + 1):
        # Progress is the larger of the step and the wall-clock fraction, so a run that hits
        # --max-minutes still ends its cosine decay.
        if step <= args.warmup:
            lr = args.lr * step / args.warmup
        else:
            frac = max((step - args.warmup) / max(1, args.steps - args.warmup),
                       (time.time() - t0) / (args.max_minutes * 60))
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train, rng, args.batch, args.seq, mix, starts, args.line_starts)
        total, lm, aux = model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        el = time.time() - t0
        if step % 10 == 0 or step == 1:
            names = ("bal", "kl") if cls is InfmoeForCausalLM else ("group", "bal")
            rec = {"step": step, "t": round(el, 1), "lr": round(lr, 6), "lm": round(lm.item(), 4),
                   names[0]: round(aux[0].item(), 4), names[1]: round(aux[1].item(), 4)}
            if "group_loss_width_target" in model.config:
                rec["offset"] = round(model.config["group_loss_difficulty_offset"], 4)
            log.append(rec)
            print(json.dumps(rec), flush=True)
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt(model, args.out, args.data, step, log, state())
            last_ckpt = time.time()
        if el > args.max_minutes * 60 and step < args.steps:
            print(f"time limit reached at step {step}", flush=True)
            break
    model.eval()
    save_ckpt(model, args.out, args.data, step, log, state())
    hl = heldout_loss(model, held, args.seq)
    print("heldout " + json.dumps(hl), flush=True)
    with open(os.path.join(args.out, "heldout_python.json"), "w") as f:
        json.dump({"step": step, "heldout": hl}, f, indent=1)
    print(f"done: {step} steps in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
