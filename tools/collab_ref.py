#!/usr/bin/env python3
"""Reference for `moeserve analyze` (engine/collab/collab_dict.c), written from the algorithm's
description for checking it: nonnegative online dictionary learning over the tokens' cross-layer
activation rows, then average-linkage merging of the fine atoms into coarse groups.

    python3 tools/collab_ref.py TRACE [--groups 8] [--fine-groups 4xG] [--lambda 0.1]
                                [--epochs 10] [--batch 256] [--seed 1] [--unweighted]

Prints JSON: the relative reconstruction error of each level and each (layer, expert)'s coarse
and fine group (the atom with the largest entry, -1 when none), to compare with the C output
(its "reconstruction_error" and "nodes"). The random draws follow the C code's (splitmix64 +
xoshiro256**, the same order), so a run starts from the same atoms; the arithmetic is float64
here and float32 there, and the codes of a mini-batch are solved together here, so the results
agree closely, not bit for bit. Needs numpy; reads traces with tools/routing_trace.py."""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import routing_trace  # noqa: E402

M64 = (1 << 64) - 1


class Rng:
    """splitmix64-seeded xoshiro256** (engine/rng.h)."""

    def __init__(self, seed):
        x = seed
        self.s = []
        for _ in range(4):
            x = (x + 0x9E3779B97F4A7C15) & M64
            z = x
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
            self.s.append(z ^ (z >> 31))
        if not any(self.s):
            self.s[0] = 1

    def next(self):
        s = self.s
        rotl = lambda v, k: ((v << k) | (v >> (64 - k))) & M64
        out = (rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return out

    def uniform(self):
        return (self.next() >> 11) * 2.0 ** -53


def rows_of(path, weighted):
    """Dense unit-norm activation rows (tokens, layers x experts) of a trace."""
    t = routing_trace.RoutingTrace(path)
    info = t.info
    L, E = info["n_layer"], info["n_expert"]
    rows = []
    for st in t.steps():
        for k in range(len(st.tokens)):
            x = np.zeros(L * E)
            for l in range(L):
                for j, e in enumerate(st.ids[l][k]):
                    if e < 0:
                        continue
                    w = st.weights[l][k][j] if (weighted and st.weights) else 1.0
                    if w > 0:
                        x[l * E + e] += w
            n = np.linalg.norm(x)
            if n > 0:
                rows.append(x / n)
    t.close()
    return np.array(rows), L, E


def encode(D, G, X, lam, sweeps=100, tol=1e-6):
    """Nonnegative lasso codes of the rows X by coordinate descent (all rows at once)."""
    K = D.shape[0]
    A = np.zeros((X.shape[0], K))
    R = X @ D.T  # residual correlations b - A G
    for _ in range(sweeps):
        moved = 0.0
        for j in range(K):
            g = G[j, j]
            if g < 1e-12:
                continue
            new = np.maximum(0.0, (R[:, j] + g * A[:, j] - lam) / g)
            delta = new - A[:, j]
            if not delta.any():
                continue
            A[:, j] = new
            R -= np.outer(delta, G[j])
            moved = max(moved, np.abs(delta).max())
        if moved < tol:
            break
    return A


def learn(X, K, lam, epochs, batch, seed):
    n, F = X.shape
    rng = Rng(seed)
    order = list(range(n))
    D = np.zeros((K, F))
    # k-means++-style initial rows (the C code's init_atoms)
    for i in range(n - 1, 0, -1):
        j = rng.next() % (i + 1)
        order[i], order[j] = order[j], order[i]
    S = min(n, 8192)
    mind = np.full(S, 4.0)
    sample = X[order[:S]]
    pick = rng.next() % S
    for k in range(K):
        D[k] = X[order[pick]]
        dist = 2.0 - 2.0 * (sample @ D[k])
        mind = np.minimum(mind, dist)
        w = np.where(mind > 0, mind * mind, 0.0)
        total = w.sum()
        if not total > 0:
            pick = rng.next() % S
            continue
        u = rng.uniform() * total
        c = np.cumsum(w)
        idx = np.nonzero(c > u)[0]
        pick = int(idx[0]) if len(idx) else S - 1
    bs = min(batch, n)
    beta = 1.0 - bs / n
    A = np.zeros((K, K))
    B = np.zeros((K, F))
    for _ in range(epochs):
        for i in range(n - 1, 0, -1):
            j = rng.next() % (i + 1)
            order[i], order[j] = order[j], order[i]
        for b0 in range(0, n, bs):
            idx = order[b0:b0 + bs]
            m = len(idx)
            A *= beta
            B *= beta
            Xb = X[idx]
            C = encode(D, D @ D.T, Xb, lam)
            A += C.T @ C
            B += C.T @ Xb
            for j in range(K):
                if A[j, j] < 1e-9:
                    D[j] = X[idx[rng.next() % m]]
                    continue
                u = np.maximum(0.0, D[j] + (B[j] - A[:, j] @ D) / A[j, j])
                nu = np.linalg.norm(u)
                D[j] = u / nu if nu > 1.0 else u
    return D


def merge(D, n_coarse):
    K = D.shape[0]
    norms = np.sqrt(np.maximum(np.einsum("ij,ij->i", D, D), 0))
    G = D @ D.T
    sim = np.where(np.outer(norms, norms) > 0, G / np.maximum(np.outer(norms, norms), 1e-300), 0)
    parent = list(range(K))
    size = [1] * K
    for _ in range(K - n_coarse):
        best, bi, bj = -1.0, -1, -1
        for i in range(K):
            if parent[i] != i:
                continue
            for j in range(i + 1, K):
                if parent[j] != j:
                    continue
                avg = sim[i, j] / (size[i] * size[j])
                if avg > best:
                    best, bi, bj = avg, i, j
        for a in range(K):
            if parent[a] == bj:
                parent[a] = bi
        for a in range(K):
            if parent[a] == a and a != bi:
                sim[bi, a] = sim[a, bi] = sim[bi, a] + sim[bj, a]
        size[bi] += size[bj]
    roots = sorted(set(parent))
    num = {r: i for i, r in enumerate(roots)}
    parent = [num[p] for p in parent]
    C = np.zeros((n_coarse, D.shape[1]))
    for i, p in enumerate(parent):
        C[p] += D[i]
    for k in range(n_coarse):
        n = np.linalg.norm(C[k])
        if n > 0:
            C[k] /= n
    return parent, C


def rel_error(D, X, lam):
    A = encode(D, D @ D.T, X, lam)
    return float(((X - A @ D) ** 2).sum() / (X ** 2).sum())


def assign(D):
    best = D.argmax(0)
    return [int(b) if D[b, f] > 0 else -1 for f, b in enumerate(best)]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--fine-groups", type=int, default=0)
    ap.add_argument("--lambda", dest="lam", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--unweighted", action="store_true")
    a = ap.parse_args(argv)
    X, L, E = rows_of(a.trace, not a.unweighted)
    K = min(a.fine_groups or 4 * a.groups, L * E)
    D = learn(X, K, a.lam, a.epochs, a.batch, a.seed)
    parent, C = merge(D, min(a.groups, K))
    fine, coarse = assign(D), assign(C)
    print(json.dumps({"tokens": len(X), "reconstruction_error": {"fine": rel_error(D, X, a.lam),
                                                                   "coarse": rel_error(C, X, a.lam)},
                      "nodes": [{"moe_layer": f // E, "expert": f % E, "group": coarse[f],
                                 "fine_group": fine[f]} for f in range(L * E)]}))


if __name__ == "__main__":
    main(sys.argv[1:])
