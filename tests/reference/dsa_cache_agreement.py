#!/usr/bin/env python3
"""Does transformers' cached generation of a DeepSeek-sparse-attention model agree with its
uncached forward? For each checkpoint given (the deepseek_v32 and glm_moe_dsa fixtures), in f32
and in bf16: three random prompts of 20 tokens, 40 greedy tokens by `generate` with the cache,
then one uncached forward over the prompt and those tokens; prints the largest relative
difference of the per-step logits and where the greedy tokens first differ (None: never).
The README ("Model families", deepseek_v32) reports the result and why it is so; give other
fixtures (deepseek_v3, mixtral) to compare with models without sparse attention. CI does not
run this (no torch).

    python3 tests/reference/dsa_cache_agreement.py tests/fixtures/models/deepseek_v32 \\
        tests/fixtures/models/glm_moe_dsa
"""
import sys

import torch
from transformers import AutoModelForCausalLM

PROMPT, NEW = 20, 40


def main():
    torch.set_num_threads(1)
    for path in sys.argv[1:]:
        for dtype in (torch.float32, torch.bfloat16):
            m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            worst, first = 0.0, []
            for seed in range(3):
                torch.manual_seed(seed)
                ids = torch.randint(3, m.config.vocab_size, (1, PROMPT))
                with torch.no_grad():
                    out = m.generate(ids, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                     output_logits=True, return_dict_in_generate=True)
                    greedy = out.sequences[0, PROMPT:].tolist()
                    full = m(out.sequences[:, :-1]).logits[0, PROMPT - 1:].float()
                cached = torch.stack([step[0] for step in out.logits]).float()
                rel = ((full - cached).norm(dim=-1) / full.norm(dim=-1)).max().item()
                worst = max(worst, rel)
                argmax = full.argmax(-1).tolist()
                first.append(next((i for i, (a, b) in enumerate(zip(argmax, greedy)) if a != b),
                                  None))
            print(f"{path.rstrip('/').split('/')[-1]} {str(dtype).split('.')[-1]}: cached vs "
                  f"uncached logits {worst:.2e} relative at most; first greedy difference "
                  f"{first}")


if __name__ == "__main__":
    main()
