#!/usr/bin/env python3
"""Golden fixture for tests/test_unicode16.c: every code point assigned in Unicode 16.0 on
planes 0-3 and 14 (surrogates excepted), encoded by the Hugging Face `tokenizers` library with
each shipped tokenizer (tests/fixtures/tokenizers/<name>/tokenizer.json.gz) in three contexts:
alone, after a space, and before "<s" (add_special_tokens=False). Storing every id list would
take megabytes, so the fixture keeps, per tokenizer, context and block of 256 code points, a
64-bit FNV-1a hash of the block's id lists (for each code point: the id count, then the ids, as
32-bit little-endian words). The C test computes the same hashes; a mismatch names the block,
and `--dump NAME CONTEXT BLOCK` prints that block's ids for the diagnosis.

    pip install tokenizers==0.23.3 unicodedata2==16.0.0
    python3 tests/reference/make_unicode16_fixtures.py      # writes tests/fixtures/tokenizers/unicode16.json
"""
import gzip
import json
import os
import struct
import sys

import unicodedata2 as ud
from tokenizers import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "fixtures", "tokenizers")
NAMES = ["qwen3", "deepseek_v3", "llama2", "gptoss"]
CONTEXTS = [("alone", "%s"), ("after_space", " %s"), ("before_lt_s", "%s<s")]
PLANES = [0, 1, 2, 3, 14]
FNV_OFFSET, FNV_PRIME = 0xcbf29ce484222325, 0x100000001b3


def assigned():
    out = []
    for plane in PLANES:
        for cp in range(plane << 16, (plane + 1) << 16):
            if 0xD800 <= cp <= 0xDFFF:
                continue
            if ud.category(chr(cp)) != "Cn":
                out.append(cp)
    return out


def fnv(h, data):
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def load(name):
    with gzip.open(os.path.join(FIX, name, "tokenizer.json.gz"), "rt", encoding="utf-8") as f:
        return Tokenizer.from_str(f.read())


def main():
    assert ud.unidata_version == "16.0.0", ud.unidata_version
    cps = assigned()
    blocks = sorted({cp >> 8 for cp in cps})
    if len(sys.argv) == 5 and sys.argv[1] == "--dump":
        tok, ctx, blk = load(sys.argv[2]), dict(CONTEXTS)[sys.argv[3]], int(sys.argv[4], 0)
        for cp in (c for c in cps if c >> 8 == blk):
            print("U+%04X %s" % (cp, tok.encode(ctx % chr(cp), add_special_tokens=False).ids))
        return
    # assigned code points as ranges
    ranges = []
    for cp in cps:
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    fixture = {"unicode": ud.unidata_version, "tokenizers": __import__("tokenizers").__version__,
               "ranges": ranges, "blocks": blocks, "hashes": {}}
    for name in NAMES:
        tok = load(name)
        fixture["hashes"][name] = {}
        for ctx_name, fmt in CONTEXTS:
            encs = tok.encode_batch([fmt % chr(cp) for cp in cps], add_special_tokens=False)
            h = {}
            for cp, e in zip(cps, encs):
                b = cp >> 8
                words = struct.pack("<%dI" % (len(e.ids) + 1), len(e.ids), *e.ids)
                h[b] = fnv(h.get(b, FNV_OFFSET), words)
            fixture["hashes"][name][ctx_name] = ["%016x" % h[b] for b in blocks]
            print("%s %s: %d code points" % (name, ctx_name, len(cps)), file=sys.stderr)
    with open(os.path.join(FIX, "unicode16.json"), "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
