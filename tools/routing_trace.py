#!/usr/bin/env python3
"""Reader for moeserve routing traces (the format is documented in
engine/routing/route_trace.h; the C reader is rtrace_open/rtrace_next there).

    from routing_trace import RoutingTrace
    with RoutingTrace("run.rtrace") as tr:
        print(tr.info)                 # header: n_layer, n_expert, top_k, widths, ...
        for step in tr.steps():        # Step(step, tokens, tags, loss, ids, weights)
            step.ids[l][t]             # the experts token t chose at MoE layer l (-1: unused)

`python3 tools/routing_trace.py info FILE [--json]` prints the same summary as
`moeserve trace info FILE [--json]` (steps, tokens, tags, per-layer expert load, mean routed
width and the difficulty split: tokens by loss terciles and their mean routed width).

Only the standard library is needed. A corrupt or truncated file raises TraceError naming the
byte offset, as the C reader does.
"""
import json
import math
import struct
import sys
import zlib
from collections import namedtuple

MAGIC = b"MOERTRC1"
VERSION = 1
HDR_FIXED = 112
REC_HDR = 12
NO_EXPERT = 0xFFFF
F_LOSS = 1
F_WEIGHTS = 2
REC_STEP = 1
REC_TAG = 2

Step = namedtuple("Step", "step tokens tags loss ids weights")


class TraceError(Exception):
    """A file that is not a routing trace, or a corrupt or truncated one."""


def _f16(h):
    return struct.unpack("<e", struct.pack("<H", h))[0]


class RoutingTrace:
    def __init__(self, path):
        self.path = path
        self.f = open(path, "rb")
        self.f.seek(0, 2)
        self.size = self.f.tell()
        self.f.seek(0)
        self.tags = {}
        self.info = self._header()
        self.data_start = self.f.tell()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.f.close()

    def _err(self, off, what):
        return TraceError("%s: offset %d: %s" % (self.path, off, what))

    def _header(self):
        fixed = self.f.read(HDR_FIXED)
        if len(fixed) < HDR_FIXED:
            raise self._err(0, "truncated header (not a routing trace?)")
        if fixed[:8] != MAGIC:
            raise self._err(0, "not a routing trace (bad magic)")
        (version, hb, L, E, K, d_model, n_group, flags, model_n_layer, _r) = struct.unpack_from(
            "<10I", fixed, 8)
        if version != VERSION:
            raise self._err(8, "trace version %d, this reader reads %d" % (version, VERSION))
        if not (1 <= L <= 100000 and 1 <= E <= 65535 and 1 <= K <= E and
                hb == HDR_FIXED + 8 * E + 4 * L + 4):
            raise self._err(12, "corrupt header (layer, expert or top-k counts)")
        rest = self.f.read(hb - HDR_FIXED)
        if len(rest) < hb - HDR_FIXED:
            raise self._err(HDR_FIXED, "truncated header")
        h = fixed + rest
        if struct.unpack_from("<I", h, hb - 4)[0] != zlib.crc32(h[:hb - 4]):
            raise self._err(hb - 4, "header CRC mismatch (corrupt header)")
        arr = struct.unpack_from("<%dI" % (2 * E + L), h, HDR_FIXED)
        return {
            "n_layer": L, "n_expert": E, "top_k": K, "d_model": d_model, "n_group": n_group,
            "flags": flags, "model_n_layer": model_n_layer,
            "model": h[48:112].split(b"\0", 1)[0].decode("utf-8", "replace"),
            "expert_width": list(arr[:E]), "expert_group": list(arr[E:2 * E]),
            "layer_index": list(arr[2 * E:]),
        }

    def _step_bytes(self, n):
        i = self.info
        cells = i["n_layer"] * n * i["top_k"]
        return (16 + 8 * n + (4 * n if i["flags"] & F_LOSS else 0) + 2 * cells +
                (2 * cells if i["flags"] & F_WEIGHTS else 0))

    def steps(self):
        """Yields every step from the first (tags are read on the way into self.tags)."""
        self.f.seek(self.data_start)
        off = self.data_start
        i = self.info
        L, K = i["n_layer"], i["top_k"]
        while True:
            rh = self.f.read(REC_HDR)
            if not rh:
                return
            if len(rh) < REC_HDR:
                raise self._err(off, "truncated record header")
            rtype, ln, crc = struct.unpack("<3I", rh)
            if ln > REC_HDR + self._step_bytes(1 << 24):
                raise self._err(off, "record length out of range")
            if off + REC_HDR + ln > self.size:
                raise self._err(off, "truncated record (file ends inside it)")
            p = self.f.read(ln)
            if zlib.crc32(p) != crc:
                raise self._err(off, "record CRC mismatch (corrupt data)")
            here, off = off, off + REC_HDR + ln
            if rtype == REC_TAG:
                if ln < 4 or struct.unpack_from("<H", p, 2)[0] != ln - 4:
                    raise self._err(here, "bad tag record")
                self.tags[struct.unpack_from("<H", p, 0)[0]] = p[4:].decode("utf-8", "replace")
                continue
            if rtype != REC_STEP:
                continue
            if ln < 16:
                raise self._err(here, "step record too short")
            step, n = struct.unpack_from("<QI", p, 0)
            if n > (1 << 24) or self._step_bytes(n) != ln:
                raise self._err(here, "step record size does not match its token count")
            pos = 16
            tokens, tags = [], []
            for t in range(n):
                tok, tag, _ = struct.unpack_from("<iHH", p, pos)
                tokens.append(tok)
                tags.append(tag)
                pos += 8
            loss = None
            if i["flags"] & F_LOSS:
                loss = list(struct.unpack_from("<%df" % n, p, pos))
                pos += 4 * n
            raw = struct.unpack_from("<%dH" % (L * n * K), p, pos)
            pos += 2 * L * n * K
            for x in raw:
                if x != NO_EXPERT and x >= i["n_expert"]:
                    raise self._err(here, "expert id out of range in a step record")
            ids = [[[(-1 if x == NO_EXPERT else x) for x in raw[(l * n + t) * K:(l * n + t + 1) * K]]
                    for t in range(n)] for l in range(L)]
            weights = None
            if i["flags"] & F_WEIGHTS:
                wr = struct.unpack_from("<%dH" % (L * n * K), p, pos)
                weights = [[[_f16(h) for h in wr[(l * n + t) * K:(l * n + t + 1) * K]]
                            for t in range(n)] for l in range(L)]
            yield Step(step, tokens, tags, loss, ids, weights)


def summary(path):
    """The numbers `moeserve trace info --json` prints, computed here."""
    with RoutingTrace(path) as tr:
        i = tr.info
        L, E = i["n_layer"], i["n_expert"]
        width = i["expert_width"]
        load = [[0] * E for _ in range(L)]
        tag_tok, tag_loss, tag_n = {}, {}, {}
        notes = []
        steps = tokens = rows = 0
        width_rows = 0.0
        for st in tr.steps():
            steps += 1
            tokens += len(st.tokens)
            for t in range(len(st.tokens)):
                w, nr = 0.0, 0
                for l in range(L):
                    for x in st.ids[l][t]:
                        if x < 0:
                            continue
                        load[l][x] += 1
                        w += width[x]
                        nr += 1
                rows += nr
                width_rows += w
                g = st.tags[t]
                tag_tok[g] = tag_tok.get(g, 0) + 1
                if st.loss is not None and not math.isnan(st.loss[t]):
                    tag_loss[g] = tag_loss.get(g, 0.0) + st.loss[t]
                    tag_n[g] = tag_n.get(g, 0) + 1
                    if nr:
                        # the C tool keeps the token's mean width as a float
                        notes.append((st.loss[t], struct.unpack("<f", struct.pack("<f", w / nr))[0]))
        difficulty = []
        if notes:
            srt = sorted(n[0] for n in notes)
            cut1, cut2 = srt[len(notes) // 3], srt[2 * len(notes) // 3]
            acc = [[0, 0.0, 0.0] for _ in range(3)]
            for lo, wd in notes:
                b = 0 if lo < cut1 else 1 if lo < cut2 else 2
                acc[b][0] += 1
                acc[b][1] += lo
                acc[b][2] += wd
            for b, name in enumerate(("easy", "medium", "hard")):
                n, sl, sw = acc[b]
                difficulty.append({"third": name, "tokens": n, "mean_loss": sl / n if n else 0.0,
                                   "mean_width": sw / n if n else 0.0})
        return {
            "model": i["model"], "n_layer": L, "n_expert": E, "top_k": i["top_k"],
            "d_model": i["d_model"], "n_group": i["n_group"], "steps": steps, "tokens": tokens,
            "rows": rows, "mean_width": width_rows / rows if rows else 0.0,
            "tags": {tr.tags.get(g, ""): {"tokens": tag_tok[g],
                                          "mean_loss": tag_loss.get(g, 0.0) / tag_n[g]
                                          if tag_n.get(g) else 0.0}
                     for g in sorted(tag_tok) if g < 1024},
            "expert_tokens": load,
            "difficulty": difficulty,
        }


def main(argv):
    if len(argv) < 3 or argv[1] != "info":
        print("usage: routing_trace.py info FILE [--json]", file=sys.stderr)
        return 2
    try:
        s = summary(argv[2])
    except (TraceError, OSError) as e:
        print("routing_trace: %s" % e, file=sys.stderr)
        return 1
    if "--json" in argv[3:]:
        print(json.dumps(s))
        return 0
    print("trace %s: model %s, %d MoE layers, %d experts, top-%d, d_model %d, %d groups" % (
        argv[2], s["model"] or "?", s["n_layer"], s["n_expert"], s["top_k"], s["d_model"],
        s["n_group"]))
    print("%d steps, %d tokens, %d expert rows; mean routed width %.1f" % (
        s["steps"], s["tokens"], s["rows"], s["mean_width"]))
    for name, t in s["tags"].items():
        print("  %-14s %8d tokens  mean loss %.4f" % (name, t["tokens"], t["mean_loss"]))
    if s["difficulty"]:
        print("| tokens by loss | tokens | mean loss | mean routed width |\n|---|---|---|---|")
        for d in s["difficulty"]:
            print("| %s | %d | %.4f | %.1f |" % (d["third"], d["tokens"], d["mean_loss"],
                                                 d["mean_width"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
