"""Corpus builder and tokenizer trainer for the bundled mohge model.

Three domains, chosen so experts can specialize and so "easy" and "hard" tokens differ:
  shakespeare  /work/shared/data/tinyshakespeare.txt (first 90% train, last 10% held out,
               split at a line boundary)
  arithmetic   generated sums, one per line ("37+58=95\n"); train and held-out use different
               seeds and held-out excludes every sum seen in training
  json         generated one-line JSON records (people, cities, tags, scores)
Everything is deterministic (fixed seeds). `build(outdir)` writes <domain>.train.txt and
<domain>.heldout.txt; `train_tokenizer(outdir)` trains a byte-level BPE (digits split one per
token so sums are learnable) and writes tokenizer.json + tokenizer_config.json with a chat
template.

Usage: python3 corpus.py OUTDIR [--vocab 2048]
"""

import json
import os
import random
import sys

DOMAINS = ["shakespeare", "arithmetic", "json"]
SHAKESPEARE = os.environ.get("MOHGE_SHAKESPEARE", "/work/shared/data/tinyshakespeare.txt")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _sum_line(rng):
    r = rng.random()
    if r < 0.45:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
    elif r < 0.75:
        a, b = rng.randint(0, 9), rng.randint(0, 99)
        if rng.random() < 0.5:
            a, b = b, a
    else:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
    return a, b


def arithmetic(n_train_chars, n_held_chars):
    rng = random.Random(1234)
    train, seen, size = [], set(), 0
    while size < n_train_chars:
        a, b = _sum_line(rng)
        line = f"{a}+{b}={a + b}\n"
        seen.add((a, b))
        train.append(line)
        size += len(line)
    rng = random.Random(98765)
    held, size = [], 0
    while size < n_held_chars:
        a, b = _sum_line(rng)
        if (a, b) in seen:
            continue
        line = f"{a}+{b}={a + b}\n"
        held.append(line)
        size += len(line)
    return "".join(train), "".join(held)


FIRST = ["Alice", "Bob", "Carla", "David", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas",
         "Kira", "Liam", "Maya", "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sven", "Tara",
         "Umar", "Vera", "Wei", "Xenia", "Yusuf", "Zoe"]
LAST = ["Smith", "Garcia", "Muller", "Rossi", "Tanaka", "Novak", "Silva", "Kim", "Dubois",
        "Jensen", "Okafor", "Ivanova", "Lopez", "Berg", "Costa", "Weber"]
CITIES = ["Paris", "Berlin", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Seoul", "Rome",
          "Madrid", "Toronto", "Sydney", "Mumbai", "Nairobi", "Vienna", "Dublin"]
TAGS = ["red", "blue", "green", "admin", "guest", "beta", "vip", "new", "archived", "staff"]


def _record(rng, i):
    first, last = rng.choice(FIRST), rng.choice(LAST)
    rec = {
        "id": i,
        "name": f"{first} {last}",
        "email": f"{first.lower()}.{last.lower()}@example.com",
        "age": rng.randint(18, 90),
        "city": rng.choice(CITIES),
        "active": rng.random() < 0.6,
        "score": round(rng.uniform(0, 100), 1),
        "tags": rng.sample(TAGS, rng.randint(0, 3)),
    }
    return json.dumps(rec) + "\n"


def json_records(n_train_chars, n_held_chars):
    rng = random.Random(4321)
    out, size, i = [], 0, 1
    while size < n_train_chars:
        line = _record(rng, i)
        out.append(line)
        size += len(line)
        i += 1
    rng = random.Random(8765)
    held, size, i = [], 0, 100000
    while size < n_held_chars:
        line = _record(rng, i)
        held.append(line)
        size += len(line)
        i += 1
    return "".join(out), "".join(held)


def shakespeare():
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read()
    cut = text.rfind("\n\n", 0, int(len(text) * 0.9)) + 2
    return text[:cut], text[cut:]


def build(outdir):
    os.makedirs(outdir, exist_ok=True)
    sh_train, sh_held = shakespeare()
    parts = {
        "shakespeare": (sh_train, sh_held),
        "arithmetic": arithmetic(1_000_000, 60_000),
        "json": json_records(1_000_000, 60_000),
    }
    for d, (tr, he) in parts.items():
        with open(os.path.join(outdir, f"{d}.train.txt"), "w", encoding="utf-8") as f:
            f.write(tr)
        with open(os.path.join(outdir, f"{d}.heldout.txt"), "w", encoding="utf-8") as f:
            f.write(he)
    return parts


def train_tokenizer(outdir, vocab=2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    files = [os.path.join(outdir, f"{d}.train.txt") for d in DOMAINS]
    tok.train(files, trainer)
    tok.save(os.path.join(outdir, "tokenizer.json"))
    write_tokenizer_config(outdir)
    return tok


def write_tokenizer_config(outdir):
    cfg = {
        "backend": "tokenizers",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(outdir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    out = sys.argv[1]
    vocab = 2048
    if "--vocab" in sys.argv:
        vocab = int(sys.argv[sys.argv.index("--vocab") + 1])
    build(out)
    train_tokenizer(out, vocab)
    print("corpus and tokenizer in", out)
