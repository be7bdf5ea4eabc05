"""Reference PyTorch implementation of the `infmoe` causal LM (continuous experts, after
∞-MoE, EACL 2026; DESIGN.md), moeserve's second in-house architecture.

The transformer skeleton is the bundled mohge model's (mohge_model.py: RMSNorm, grouped-query
attention with rotate-half RoPE); only the FFN differs. Every layer's FFN is one large SwiGLU
of F = intermediate_size neurons, and a token runs a different slice of it per sample:

  router      r = W_r x + b_r (2Z): mu = r[:Z], logvar = clamp(r[Z:], -10, 10)
  samples     z_s = mu + exp(logvar / 2) * eps_s                       s = 0 .. K-1
  selection   score_s = keys . (z_s / sqrt(Z))  (F)    sel_s = the N highest scores
  neuron      h_j = silu(gate_j . x) * (up_j . x)
  output      y = 1/K * sum_s sum_{j in sel_s} sigmoid(score_s,j) * h_j * down_t[j]

with N = max(1, floor(neuron_fraction * F + 1/2)). The sigmoid of a kept neuron's score is
what carries gradient back to the router and the keys (the top-N choice itself has none).
Because h_j does not depend on the sample, the K samples share their neurons: a token computes
each neuron of the union of its K slices once, weighted by sum_s [j in sel_s]
sigmoid(score_s,j) / K. The engine does exactly that, so its work per token is the size of
that union (N for K = 1, at most K * N).

Samples (eps_s). Training: eps_0 = 0 (the mean) and eps_1.. drawn from N(0, I)
(reparameterised). Inference: eps_0 = 0 and eps_s (s >= 1) the s-th point of a fixed
quasi-random sequence mapped through the normal quantile function (`quasi_offsets`): the
additive R_d sequence u_s,j = frac(1/2 + s * alpha_j), alpha_j = phi^-(j+1) with phi the
positive root of x^(Z+1) = x + 1 (its s = 0 point is u = 1/2, i.e. eps = 0, the mean). Why
this rather than random draws: the output is then a deterministic function of the request
(no seed, the same logits in every batch, prefix caching stays exact), the sets are nested
(K = 2 is the first two of K = 4), and for the small K a server runs (1..8) a low-discrepancy
set covers the Gaussian far more evenly than K random draws, so the average over K samples has
less variance at equal compute. The engine computes the same offsets in double precision.

Adaptive budget (`adaptive_samples`): with a calibration of the router's predicted
log-variance in the config (`calibrate`), a request may give K as an average and let each
token take 1 .. 2K - 1 samples by its rank in that calibration: the router's own uncertainty
decides which tokens get more.

Training losses besides cross-entropy: a Switch-style neuron balance loss (F * sum_j f_j P_j,
f_j the detached share of selections neuron j got, P_j its mean normalised sigmoid score, 1 when
uniform), and a KL(N(mu, sigma) || N(0, I)) term per latent dimension that keeps the predicted
variance from collapsing to zero (which would make every sample the mean and K meaningless).

Tensor names (per layer l, prefix model.layers.l.mlp.): router.weight (2Z, D), router.bias
(2Z), neuron_keys.weight (F, Z), gate_proj.weight (F, D), up_proj.weight (F, D), and
down_t.weight (F, D): the down projection stored neuron-major (the transpose of Llama's
down_proj), so that a neuron's output weights are one contiguous row the engine can gather.
This file is the golden reference for the C engine's `infmoe` support.
"""

import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from mohge_model import Attention, HFFolder, RMSNorm, rope_cos_sin

LOGVAR_MIN, LOGVAR_MAX = -10.0, 10.0

CONFIG_DEFAULTS = {
    "model_type": "infmoe",
    "architectures": ["InfmoeForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "intermediate_size": 256,
    "latent_dim": 8,
    "neuron_fraction": 0.125,
    "num_samples": 2,
    "max_samples": 8,
    "balance_loss_coef": 0.01,
    "kl_loss_coef": 0.001,
    "bos_token_id": None,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}


def full_config(cfg):
    out = dict(CONFIG_DEFAULTS)
    out.update(cfg)
    if not 0.0 < out["neuron_fraction"] <= 1.0:
        raise ValueError("neuron_fraction must be in (0, 1]")
    if not 1 <= out["num_samples"] <= out["max_samples"]:
        raise ValueError("num_samples must be in 1..max_samples")
    return out


def neurons_kept(fraction, F):
    """Neurons one sample keeps: max(1, floor(fraction * F + 1/2)), at most F."""
    return max(1, min(F, int(math.floor(fraction * F + 0.5))))


def _ndtri(p):
    """The standard normal quantile in double precision: Acklam's rational approximation and
    one Halley step on erfc (the engine's infmoe_ndtri is the same computation)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
         1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
         6.680131188771972e+01, -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
         -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
         3.754408661907416e+00)
    p = min(max(p, 1e-12), 1.0 - 1e-12)
    if p < 0.02425 or p > 1.0 - 0.02425:
        q = math.sqrt(-2.0 * math.log(p if p < 0.5 else 1.0 - p))
        x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1.0)
        if p > 0.5:
            x = -x
    else:
        q = p - 0.5
        r = q * q
        x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / \
            (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1.0)
    e = 0.5 * math.erfc(-x / math.sqrt(2.0)) - p
    u = e * math.sqrt(2.0 * math.pi) * math.exp(x * x / 2.0)
    return x - u / (1.0 + x * u / 2.0)


def quasi_offsets(K, Z):
    """(K, Z) float32: row 0 zeros (the mean), row s the s-th R_d point through the normal
    quantile. See the module comment."""
    x = 2.0
    for _ in range(100):  # Newton on x^(Z+1) - x - 1, from above: monotone convergence
        x = x - (x ** (Z + 1) - x - 1.0) / ((Z + 1) * x ** Z - 1.0)
    alpha = [x ** -(j + 1) for j in range(Z)]
    rows = []
    for s in range(K):
        rows.append([0.0 if s == 0 else _ndtri(math.fmod(0.5 + s * alpha[j], 1.0))
                     for j in range(Z)])
    return torch.tensor(rows, dtype=torch.float64).float()


def adaptive_samples(u, quantiles, k_avg, k_max):
    """The adaptive budget ("by difficulty"): per token, K from u, the mean over the latent of
    the router's predicted log-variance (its own uncertainty), computed in double. r = the
    position of u among the layer's calibration quantiles (quantiles[0..Q] ascending, measured
    on held-out text by `calibrate`; piecewise linear, 0 below the first, 1 above the last),
    K = clamp(1 + floor(2 (k_avg - 1) r + 1/2), 1, k_max): linear in the rank, so over text
    like the calibration text the mean K is k_avg, and uncertain tokens get more samples.
    u: list of floats -> list of ints (the engine's infmoe_adaptive_k)."""
    Q = len(quantiles) - 1
    out = []
    for x in u:
        if x <= quantiles[0]:
            r = 0.0
        elif x >= quantiles[Q]:
            r = 1.0
        else:
            i = 0
            while i + 1 < Q and x >= quantiles[i + 1]:
                i += 1
            span = quantiles[i + 1] - quantiles[i]
            r = (i + ((x - quantiles[i]) / span if span > 0 else 0.0)) / Q
        k = 1 + int(math.floor(2.0 * (k_avg - 1) * r + 0.5))
        out.append(max(1, min(k_max, k)))
    return out


class NeuronRows(nn.Module):
    """A (rows, cols) matrix stored as `weight`, read row by row (the neuron-major down
    projection)."""

    def __init__(self, rows, cols):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


class InfmoeFFN(nn.Module):
    def __init__(self, c, layer=0):
        super().__init__()
        cal = c.get("adaptive_logvar_quantiles")
        self.quantiles = cal[layer] if cal else None
        self.max_samples = c["max_samples"]
        D, Fn, Z = c["hidden_size"], c["intermediate_size"], c["latent_dim"]
        self.F, self.Z = Fn, Z
        self.fraction = c["neuron_fraction"]
        self.K = c["num_samples"]
        self.router = nn.Linear(D, 2 * Z, bias=True)
        self.neuron_keys = nn.Linear(Z, Fn, bias=False)       # weight (F, Z)
        self.gate_proj = nn.Linear(D, Fn, bias=False)         # weight (F, D)
        self.up_proj = nn.Linear(D, Fn, bias=False)           # weight (F, D)
        self.down_t = NeuronRows(Fn, D)                       # weight (F, D) neuron-major

    def mean_logvar(self, h):
        """(N,) double: each token's mean predicted log-variance (the adaptive budget's u)."""
        r = self.router(h)
        return r[:, self.Z:].clamp(LOGVAR_MIN, LOGVAR_MAX).double().mean(-1)

    def forward(self, x, samples=None, fraction=None, stats=None, adaptive=False):
        """x: (B, T, D) -> (B, T, D), aux losses (training) or None. samples / fraction
        override num_samples / neuron_fraction (inference budget); adaptive: samples is the
        average and each token's K comes from adaptive_samples (inference only)."""
        B, T, D = x.shape
        K = samples if samples is not None else self.K
        frac = fraction if fraction is not None else self.fraction
        n_sel = neurons_kept(frac, self.F)
        h = x.reshape(-1, D)                                              # (N, D)
        N = h.shape[0]
        r = self.router(h)
        mu = r[:, :self.Z]
        logvar = r[:, self.Z:].clamp(LOGVAR_MIN, LOGVAR_MAX)
        sigma = torch.exp(0.5 * logvar)
        k_tok = None
        if adaptive and not self.training:
            if self.quantiles is None:
                raise ValueError("the config has no adaptive_logvar_quantiles")
            k_tok = torch.tensor(adaptive_samples(self.mean_logvar(h).tolist(), self.quantiles,
                                                  K, self.max_samples))
            K = int(k_tok.max())
        if self.training:
            eps = torch.randn(N, K, self.Z, device=h.device)
            eps[:, 0] = 0.0
        else:
            eps = quasi_offsets(K, self.Z).to(h.device)[None].expand(N, K, self.Z)
        z = mu[:, None, :] + sigma[:, None, :] * eps                       # (N, K, Z)
        scores = (z * self.Z ** -0.5) @ self.neuron_keys.weight.t()        # (N, K, F)
        top = torch.topk(scores, n_sel, dim=-1).indices                    # (N, K, n_sel)
        mask = torch.zeros_like(scores).scatter_(-1, top, 1.0)             # (N, K, F)
        sig = torch.sigmoid(scores)
        if k_tok is not None:  # token t uses its first k_tok[t] samples
            mask = mask * (torch.arange(K)[None, :] < k_tok[:, None]).float()[:, :, None]
            coef = (mask * sig).sum(1) / k_tok[:, None].float()
        else:
            coef = (mask * sig).sum(1) / K                                 # (N, F)
        act = F.silu(h @ self.gate_proj.weight.t()) * (h @ self.up_proj.weight.t())
        y = (act * coef) @ self.down_t.weight                              # (N, D)
        if stats is not None:
            stats.append(int((mask.sum(1) > 0).sum()))                     # neurons computed
        aux = None
        if self.training:
            f = mask.sum((0, 1)) / (N * K * n_sel)                         # (F,) sums to 1
            p = (sig / sig.sum(-1, keepdim=True)).mean((0, 1))             # (F,)
            l_bal = self.F * (f.detach() * p).sum()
            l_kl = 0.5 * (mu.pow(2) + logvar.exp() - 1.0 - logvar).mean()
            aux = (l_bal, l_kl)
        return y.view(B, T, D), aux


class Block(nn.Module):
    def __init__(self, c, layer):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = InfmoeFFN(c, layer)

    def forward(self, x, cos, sin, samples, fraction, stats, adaptive=False):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        m, aux = self.mlp(self.post_attention_layernorm(x), samples, fraction, stats, adaptive)
        return x + m, aux


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c, l) for l in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class InfmoeForCausalLM(HFFolder, nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = full_config(cfg)
        c = self.config
        self.model = Inner(c)
        self.tied = bool(c["tie_word_embeddings"])
        if not self.tied:
            self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def init_weights(self, std=0.02, seed=None):
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        n_layer = self.config["num_hidden_layers"]
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                continue
            with torch.no_grad():
                if name.endswith("router.bias"):
                    p.zero_()
                    continue
                s = std
                if name.endswith("o_proj.weight") or name.endswith("down_t.weight"):
                    s = std / math.sqrt(2 * n_layer)
                if name.endswith("neuron_keys.weight") or name.endswith("router.weight"):
                    s = 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=g) * s)

    def head_weight(self):
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(self, ids, samples=None, fraction=None, stats=None, adaptive=False):
        """ids: (B, T) -> logits (B, T, V), aux losses averaged over layers (or None)."""
        c = self.config
        x = self.model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1], device=ids.device)
        cos, sin = rope_cos_sin(pos, c["head_dim"], c["rope_theta"])
        cos, sin = cos.to(x.device), sin.to(x.device)
        l_bal = l_kl = None
        for layer in self.model.layers:
            x, aux = layer(x, cos, sin, samples, fraction, stats, adaptive)
            if aux is not None:
                l_bal = aux[0] if l_bal is None else l_bal + aux[0]
                l_kl = aux[1] if l_kl is None else l_kl + aux[1]
        x = self.model.norm(x)
        logits = x @ self.head_weight().t()
        if l_bal is None:
            return logits, None
        n = len(self.model.layers)
        return logits, (l_bal / n, l_kl / n)

    def loss(self, ids, targets):
        logits, aux = self(ids)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        c = self.config
        total = lm
        if aux is not None:
            total = lm + c["balance_loss_coef"] * aux[0] + c["kl_loss_coef"] * aux[1]
        return total, lm, aux

    @torch.no_grad()
    def calibrate(self, seqs, n_quantiles=16):
        """Sets config adaptive_logvar_quantiles: per layer, the 0, 1/Q, .., 1 quantiles of the
        tokens' mean predicted log-variance over the id lists seqs (held-out text)."""
        u = [[] for _ in self.model.layers]
        hooks = [layer.mlp.register_forward_hook(
            lambda mod, inp, out, l=l: u[l].append(mod.mean_logvar(inp[0].reshape(-1, inp[0].shape[-1]))))
            for l, layer in enumerate(self.model.layers)]
        for ids in seqs:
            self(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        qs = torch.linspace(0, 1, n_quantiles + 1, dtype=torch.float64)
        cal = [[float(v) for v in torch.quantile(torch.cat(x), qs)] for x in u]
        self.config["adaptive_logvar_quantiles"] = cal
        for layer, q in zip(self.model.layers, cal):
            layer.mlp.quantiles = q

    @torch.no_grad()
    def greedy(self, ids, n, samples=None, fraction=None):
        """ids: list of ints -> n greedy continuation tokens (full recompute, no cache)."""
        seq = list(ids)
        out = []
        for _ in range(n):
            logits, _ = self(torch.tensor([seq]), samples, fraction)
            t = int(logits[0, -1].argmax())
            out.append(t)
            seq.append(t)
        return out

