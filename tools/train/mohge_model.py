"""Reference PyTorch implementation of the `mohge` causal LM (Mixture of Heterogeneous Grouped
Experts), the architecture of moeserve's bundled default model.

A Llama-style decoder (RMSNorm, grouped-query attention with rotate-half RoPE, SwiGLU FFNs)
whose every FFN is an MoE block: G groups of routed experts whose FFN width differs by group,
plus always-on shared experts added with weight 1. Routing is the two-level rule of
DESIGN.md (MoHGE): a sigmoid group router keeps the top-kg groups and renormalizes their
scores; the expert router's logits, viewed as [G, E/G], are softmaxed inside each group,
scaled by the group score and the 0/1 mask of kept groups, flattened and renormalized; the
top-k experts overall are kept and weighted by a softmax over their k probabilities. Expert e
belongs to group e // experts_per_group.

Training adds two auxiliary losses: the size-weighted group loss (w_g = (W_g - W_min + delta)
/ delta, so routing tokens to wide groups costs more) and a Switch-style balance loss inside
each group. With group_loss_difficulty = beta > 0 a third term adds each token's expected
relative group width weighted by beta (1 + g - 2 r), r the token's loss rank in its batch and
g = group_loss_difficulty_offset (0 by default; see MohgeForCausalLM.loss), so that easy tokens
are pushed to narrow groups and hard ones to wide. The model is saved and loaded as a Hugging Face-style folder (config.json +
model.safetensors); tensor names follow Llama / Qwen-MoE conventions (see README, "The mohge
config.json"). This file is the golden reference for the C engine's `mohge` support.
"""

import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG_DEFAULTS = {
    "model_type": "mohge",
    "architectures": ["MohgeForCausalLM"],
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
    "num_expert_groups": 4,
    "experts_per_group": 2,
    "group_intermediate_sizes": [16, 24, 32, 40],
    "num_experts_per_tok": 2,
    "num_groups_per_tok": 2,
    "num_shared_experts": 1,
    "shared_intermediate_size": 32,
    "group_loss_coef": 0.01,
    "group_loss_delta": 16.0,
    "balance_loss_coef": 0.01,
    "group_loss_difficulty": 0.0,
    "group_loss_difficulty_offset": 0.0,
    "bos_token_id": None,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}


def full_config(cfg):
    out = dict(CONFIG_DEFAULTS)
    out.update(cfg)
    G = out["num_expert_groups"]
    if len(out["group_intermediate_sizes"]) != G:
        raise ValueError("group_intermediate_sizes needs num_expert_groups entries")
    if out["num_groups_per_tok"] > G:
        raise ValueError("num_groups_per_tok > num_expert_groups")
    if out["num_experts_per_tok"] > out["num_groups_per_tok"] * out["experts_per_group"]:
        raise ValueError("num_experts_per_tok larger than the experts of the kept groups")
    return out


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def rope_cos_sin(positions, head_dim, theta):
    """positions: (T,) -> cos, sin: (T, head_dim), Llama rotate-half layout."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        D, H, KV, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.H, self.KV, self.hd = H, KV, hd
        self.q_proj = nn.Linear(D, H * hd, bias=False)
        self.k_proj = nn.Linear(D, KV * hd, bias=False)
        self.v_proj = nn.Linear(D, KV * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hd).transpose(1, 2)   # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.H // self.KV
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)      # (B, H, T, hd)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.H * self.hd))


class SwiGLU(nn.Module):
    def __init__(self, D, d_ff):
        super().__init__()
        self.gate_proj = nn.Linear(D, d_ff, bias=False)
        self.up_proj = nn.Linear(D, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def mohge_route(x, group_w, expert_w, G, kg, k):
    """The two-level router of DESIGN.md.

    x: (N, D); group_w: (G, D); expert_w: (E, D).
    Returns idx (N, k) expert ids, weights (N, k), and the intermediates the losses need:
    group scores s (N, G) after sigmoid, the kept-group mask (N, G), the in-group softmax
    p (N, G, E/G)."""
    N = x.shape[0]
    E = expert_w.shape[0]
    s = torch.sigmoid(x @ group_w.t())                                  # (N, G)
    top_g = torch.topk(s, kg, dim=-1).indices                           # (N, kg)
    mask = torch.zeros_like(s).scatter_(1, top_g, 1.0)                  # (N, G)
    sg = s * mask
    sg = sg / sg.sum(-1, keepdim=True)                                  # renormalized kept scores
    p = torch.softmax((x @ expert_w.t()).view(N, G, E // G), dim=-1)    # (N, G, E/G)
    q = (p * sg[:, :, None] * mask[:, :, None]).reshape(N, E)           # (N, E)
    q = q / q.sum(-1, keepdim=True)
    topv, idx = torch.topk(q, k, dim=-1)                                # (N, k)
    weights = torch.softmax(topv, dim=-1)
    return idx, weights, s, mask, p


class MohgeMoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        D = c["hidden_size"]
        self.G = c["num_expert_groups"]
        self.epg = c["experts_per_group"]
        self.E = self.G * self.epg
        self.kg = c["num_groups_per_tok"]
        self.k = c["num_experts_per_tok"]
        self.widths = [c["group_intermediate_sizes"][e // self.epg] for e in range(self.E)]
        self.group_gate = nn.Linear(D, self.G, bias=False)
        self.gate = nn.Linear(D, self.E, bias=False)
        self.experts = nn.ModuleList(SwiGLU(D, w) for w in self.widths)
        self.n_shared = c["num_shared_experts"]
        shared = [SwiGLU(D, c["shared_intermediate_size"]) for _ in range(self.n_shared)]
        if self.n_shared == 1:
            self.shared_expert = shared[0]
        else:
            self.shared_experts = nn.ModuleList(shared)
        gw = torch.tensor([float(w) for w in c["group_intermediate_sizes"]])
        delta = float(c["group_loss_delta"])
        self.register_buffer("group_size_w", (gw - gw.min() + delta) / delta, persistent=False)
        self.difficulty = float(c.get("group_loss_difficulty", 0.0))
        self.balance_per_sequence = c.get("balance_loss_scope", "batch") == "sequence"
        self.register_buffer("group_widths", gw, persistent=False)

    def shared_list(self):
        return [self.shared_expert] if self.n_shared == 1 else list(self.shared_experts)

    def forward(self, x, stats=None):
        B, T, D = x.shape
        h = x.reshape(-1, D)                                                 # (N, D)
        idx, w, s, mask, p = mohge_route(h, self.group_gate.weight, self.gate.weight,
                                         self.G, self.kg, self.k)
        out = torch.zeros_like(h)
        for sh in self.shared_list():
            out = out + sh(h)
        flat_idx = idx.reshape(-1)
        flat_w = w.reshape(-1)
        tok = torch.arange(h.shape[0], device=h.device).repeat_interleave(self.k)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.E).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            t = tok[sel]
            y = self.experts[e](h[t]) * flat_w[sel, None]
            out = out.index_add(0, t, y)
        aux = None
        if self.training:
            aux = self.aux_losses(s, mask, p, idx, B)
        if stats is not None:
            stats.append(idx.detach())
        return out.view(B, T, D), aux

    def aux_losses(self, s, mask, p, idx, rows=1):
        N = s.shape[0]
        G, epg = self.G, self.epg
        # Size-weighted group loss: f_g = share of tokens keeping group g, P_g = mean
        # normalized sigmoid score of g; wide groups weigh more, pushing easy tokens narrow.
        f_g = mask.mean(0) / self.kg                                          # (G,)
        P_g = (s / s.sum(-1, keepdim=True)).mean(0)                           # (G,)
        l_group = G * (self.group_size_w * f_g.detach() * P_g).sum() / self.group_size_w.mean()
        if self.difficulty > 0:
            # and each token's expected relative width (N,), which the caller weights by the
            # token's difficulty (MohgeForCausalLM.loss): a width cost without f_g, which would
            # make it a balance term (a popular narrow group pushed away from)
            q = s / s.sum(-1, keepdim=True)                                   # (N, G)
            width = (q * (self.group_widths / self.group_widths.mean())).sum(-1)
            # and the width the tokens were routed to (mean over their k expert rows,
            # detached): what a width target (MohgeForCausalLM.loss) steers
            routed = self.group_widths[idx // epg].mean().detach()
            l_group = (l_group, width, routed)
        # Switch-style balance inside each group, over the tokens that kept the group: over
        # the batch, or (balance_loss_scope "sequence", DeepSeek-V3's sequence-wise form) over
        # each sequence apart and averaged, so that the experts of a group stay balanced
        # within every domain (a row is one domain) and not only over the batch's mix.
        R = rows if self.balance_per_sequence else 1
        sel = torch.zeros(N, self.E, device=s.device).scatter_(1, idx, 1.0).view(R, -1, G, epg)
        m = mask.view(R, -1, G)
        denom = m.sum(1).clamp(min=1.0)                                       # (R, G)
        f_e = (sel.sum(1) / self.k) / denom[..., None]                        # (R, G, epg)
        P_e = (p.view(R, -1, G, epg) * m[..., None]).sum(1) / denom[..., None]
        l_bal = epg * (f_e.detach() * P_e).sum(-1).mean()
        return l_group, l_bal


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MohgeMoE(c)

    def forward(self, x, cos, sin, stats=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        m, aux = self.mlp(self.post_attention_layernorm(x), stats)
        return x + m, aux


class MtpHeadNorm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class MohgeMTP(nn.Module):
    """A multi-token-prediction module in DeepSeek-V3's layout (model.layers.{num_hidden_layers}.):
    index i fuses the trunk's hidden state h_i (after its final norm) with token i + 1,
    x = eh_proj [enorm(embed(t_{i+1})) ; hnorm(h_i)], runs one decoder block at RoPE position i
    whose FFN is a dense SwiGLU of mtp_intermediate_size, and predicts token i + 2 through
    shared_head.norm and the model's (tied) head."""

    def __init__(self, c):
        super().__init__()
        D = c["hidden_size"]
        self.enorm = RMSNorm(D, c["rms_norm_eps"])
        self.hnorm = RMSNorm(D, c["rms_norm_eps"])
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.input_layernorm = RMSNorm(D, c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(D, c["rms_norm_eps"])
        self.mlp = SwiGLU(D, c["mtp_intermediate_size"])
        self.shared_head = MtpHeadNorm(c)

    def forward(self, emb_next, h, cos, sin):
        """emb_next: (B, T, D) embeddings of tokens 1..T; h: (B, T, D) the hidden states at
        0..T-1 (or chained outputs) -> the block's output before shared_head.norm."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        # MTP modules follow the decoder layers, as DeepSeek-V3 stores them
        for _ in range(c.get("num_nextn_predict_layers", 0)):
            self.layers.append(MohgeMTP(c))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class HFFolder:
    """save / load as a Hugging Face folder (config.json, model.safetensors,
    generation_config.json), shared by the causal-LM classes (self.config, self.tied)."""

    def save(self, folder, dtype=torch.float32):
        from safetensors.torch import save_file
        os.makedirs(folder, exist_ok=True)
        cfg = dict(self.config)
        cfg["torch_dtype"] = "bfloat16" if dtype == torch.bfloat16 else "float32"
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        sd = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()
              if not (self.tied and k == "lm_head.weight")}
        save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        gen = {"eos_token_id": cfg["eos_token_id"]}
        if cfg.get("bos_token_id") is not None:
            gen["bos_token_id"] = cfg["bos_token_id"]
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, folder):
        """Loads a saved folder; weights are upcast to float32 (bf16 values stay exact)."""
        from safetensors.torch import load_file
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        m = cls(cfg)
        sd = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
        m.load_state_dict(sd, strict=True)
        m.eval()
        return m


class MohgeForCausalLM(HFFolder, nn.Module):
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
            s = std
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                s = std / math.sqrt(2 * n_layer)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * s)

    def head_weight(self):
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(self, ids, stats=None, hidden=None):
        """ids: (B, T) -> logits (B, T, V), aux losses summed over layers (or None). hidden: a
        list that receives the hidden states after the final norm (B, T, D), what an MTP
        module reads."""
        c = self.config
        x = self.model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1], device=ids.device)
        cos, sin = rope_cos_sin(pos, c["head_dim"], c["rope_theta"])
        cos, sin = cos.to(x.device), sin.to(x.device)
        l_group = l_bal = None
        for layer in self.model.layers[:c["num_hidden_layers"]]:
            x, aux = layer(x, cos, sin, stats)
            if aux is not None:
                g = aux[0]
                if isinstance(g, tuple):  # (group loss, per-token relative width, routed
                    # width): summed apiece
                    g = g if l_group is None else tuple(a + b for a, b in zip(l_group, g))
                else:
                    g = g if l_group is None else l_group + g
                l_group = g
                l_bal = aux[1] if l_bal is None else l_bal + aux[1]
        x = self.model.norm(x)
        if hidden is not None:
            hidden.append(x)
        logits = x @ self.head_weight().t()
        if l_group is None:
            return logits, None
        n = c["num_hidden_layers"]
        if isinstance(l_group, tuple):
            return logits, (tuple(v / n for v in l_group), l_bal / n)
        return logits, (l_group / n, l_bal / n)

    def mtp(self):
        """The first MTP module (config num_nextn_predict_layers > 0)."""
        return self.model.layers[self.config["num_hidden_layers"]]

    def mtp_forward(self, ids, h):
        """ids: (B, T), h: (B, T - 1, D) the trunk's normed hidden states at 0..T-2 (or chained
        outputs) -> the module's logits (B, T - 1, V) at indices 0..T-2 (index i predicts token
        i + 2) and its outputs before shared_head.norm (what a chained index reads)."""
        c, mod = self.config, self.mtp()
        pos = torch.arange(ids.shape[1] - 1, device=ids.device)
        cos, sin = rope_cos_sin(pos, c["head_dim"], c["rope_theta"])
        out = mod(self.model.embed_tokens(ids[:, 1:]), h, cos, sin)
        return mod.shared_head.norm(out) @ self.head_weight().t(), out

    def loss(self, ids, targets):
        logits, aux = self(ids)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                             reduction="none")
        lm = ce.mean()
        c = self.config
        total = lm
        beta = float(c.get("group_loss_difficulty", 0.0))
        if aux is not None and beta > 0:
            # Difficulty-steered routing: today's group loss, plus each token's expected relative
            # width weighted by beta (1 - 2 r), r its loss's rank in the batch (0 the easiest, 1
            # the hardest; detached). The weights average 0, so the overall pressure toward
            # narrow groups stays the group loss's, but easy tokens are pushed narrow and hard
            # ones wide.
            # group_loss_difficulty_offset = g > 0 makes the weights 1 + g - 2 r: a net push of
            # every token toward narrow groups on top of the easy/hard split.
            # group_loss_difficulty_rank "row" ranks each token among its own sequence's
            # tokens instead of the batch's: the batch mixes domains, and a hard token of an
            # easy domain would otherwise count as easy.
            # group_loss_width_target = T > 0 makes g a controller's output instead of a
            # constant: after each step g moves by group_loss_width_gain x (routed width / T -
            # 1), so the mean routed width settles at T whatever the split costs; g is kept in
            # the config, so it is saved with the checkpoint and carried into the next phase.
            rows = ids.shape[0] if c.get("group_loss_difficulty_rank", "batch") == "row" else 1
            e = ce.detach().view(rows, -1)
            r = torch.argsort(torch.argsort(e, dim=1), dim=1).to(ce.dtype)
            r = (r / max(1, e.shape[1] - 1)).reshape(-1)
            g = float(c.get("group_loss_difficulty_offset", 0.0))
            l_group, width, routed = aux[0]
            aux = (l_group + beta * (width * (1.0 + g - 2.0 * r)).mean(), aux[1])
            target = float(c.get("group_loss_width_target", 0.0))
            if target > 0 and self.training:
                gain = float(c.get("group_loss_width_gain", 0.01))
                c["group_loss_difficulty_offset"] = min(
                    2.0, max(-1.0, g + gain * (routed.item() / target - 1.0)))
        if aux is not None:
            total = lm + c["group_loss_coef"] * aux[0] + c["balance_loss_coef"] * aux[1]
        return total, lm, aux

    @torch.no_grad()
    def greedy(self, ids, n):
        """ids: list of ints -> n greedy continuation tokens (full recompute, no cache)."""
        seq = list(ids)
        out = []
        for _ in range(n):
            logits, _ = self(torch.tensor([seq]))
            t = int(logits[0, -1].argmax())
            out.append(t)
            seq.append(t)
        return out

