#!/usr/bin/env python3
"""Golden fixture for the DeepSeek-V3 router rule (BE_ROUTE_SIGMOID_GROUP in kernels/backend.h).

No checkpoint we load uses this router yet (DeepSeek's MLA attention is not supported), so the
rule is checked on its own: transformers' DeepseekV3TopkRouter routes random hidden states with
a random gate and a random e_score_correction_bias (large enough to reorder experts and groups),
and tests/fixtures/route/deepseek_v3.safetensors records

  logits  (n, E) f32   the router logits (the rule's input)
  bias    (E)    f32   e_score_correction_bias
  idx     (n, k) i32   chosen experts, sorted ascending per token (topk is unsorted)
  weights (n, k) f32   their weights, in the order of idx
  config  (5)    f32   n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor

tests/test_route.c feeds `logits` to the backends' route op and compares. Everything runs in
float32 on one thread with a fixed seed; CI does not run this script (no torch there).

Usage: python3 tests/reference/make_route_fixtures.py
"""

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "route" / "deepseek_v3.safetensors"
SEED = 2468
N_TOKENS = 96
HIDDEN = 32


def main():
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    cfg = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=64, num_experts_per_tok=6,
                           n_group=8, topk_group=3, norm_topk_prob=True,
                           routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.6)
        router.e_score_correction_bias.uniform_(-0.3, 0.3)
        hidden = torch.randn(N_TOKENS, HIDDEN)
        logits, weights, idx = router(hidden)
    order = idx.argsort(dim=-1)
    idx = idx.gather(1, order)
    weights = weights.gather(1, order)
    config = torch.tensor([cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
                           1.0 if cfg.norm_topk_prob else 0.0, cfg.routed_scaling_factor],
                          dtype=torch.float32)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file({"logits": logits.contiguous(), "bias": router.e_score_correction_bias.clone(),
               "idx": idx.to(torch.int32).contiguous(), "weights": weights.contiguous(),
               "config": config}, str(OUT))
    # How close the calls were: the smallest gap between the k-th and (k+1)-th choice score
    # among kept groups, so a fragile fixture is visible.
    s = logits.sigmoid() + router.e_score_correction_bias
    top = s.topk(cfg.num_experts_per_tok + 1, dim=-1)[0]
    print(f"wrote {OUT.relative_to(REPO)}: {N_TOKENS} tokens, {cfg.n_routed_experts} experts, "
          f"top-{cfg.num_experts_per_tok} of {cfg.topk_group}/{cfg.n_group} groups; "
          f"smallest k/k+1 gap over all experts {float((top[:, -2] - top[:, -1]).min()):.2e}")


if __name__ == "__main__":
    main()
