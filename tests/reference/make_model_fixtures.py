#!/usr/bin/env python3
"""Builds moeserve's golden model fixtures from Hugging Face transformers.

The C engine is correct when it reproduces what `transformers` computes, so this script makes
tiny random checkpoints of every MoE architecture we load (mixtral, qwen2_moe, qwen3_moe, olmoe,
deepseek_v2/v3, glm4_moe, minimax_m2, gpt_oss, and the hybrid qwen3_next and qwen3_5_moe)
with transformers' own model classes, saves them with save_pretrained exactly as users have
them (f32, bf16, and one sharded f32 copy), trains one tiny byte-level BPE tokenizer that every
folder shares, and records reference outputs (ids, full-forward logits, greedy continuations)
in reference.safetensors next to each checkpoint. It also writes tests/reference/TENSORS.md,
the tensor-name/shape listing the loader is written against. Output is deterministic: run it
twice and the files are byte-identical. CI does not run it (no torch there); the generated
files under tests/fixtures/models/ are committed. See tests/reference/README.md.
"""

import argparse
import copy
import hashlib
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.utils import logging as hf_logging
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    GenerationConfig,
    GraniteMoeHybridConfig,
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    Llama4Config,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
    GraniteMoeHybridForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MiniMaxM2Config,
    MiniMaxM2ForCausalLM,
    Mxfp4Config,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
DEFAULT_OUT = REPO / "tests" / "fixtures" / "models"
TENSORS_MD = REPO / "tests" / "reference" / "TENSORS.md"

SEED = 1234
VOCAB = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Prompt 3 is a single token (see prompt_ids); the others are ~5, ~17 and ~40 tokens.
PROMPT_TEXTS = [
    "First Citizen:\n",  # 5 tokens
    "ROMEO:\nBut soft, what light?",  # 17 tokens
    # 41 tokens; digits and a 2-byte UTF-8 character split over two byte-level tokens
    "Now is the winter of our discontent\nMade glorious summer by this sun; caf\u00e9 42!",
]
GREEDY_TOKENS = 32
# Attention/expert kernels used for every reference: the plain PyTorch paths, whose math is
# the easiest to follow and which agree with sdpa to ~1e-6 in f32.
IMPL = {"attn_implementation": "eager", "experts_implementation": "eager"}

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=None,
    eos_token_id=0,  # id of <|endoftext|>, asserted after tokenizer training
    pad_token_id=None,
    tie_word_embeddings=False,
)

# name -> (model class, config). Widths: experts 32, dense/shared FFNs 64-128.
ARCHS = {
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(
            **COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "qwen2_moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig(
            **COMMON,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            intermediate_size=128,  # dense MLP of layer 1
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            qkv_bias=True,
        ),
    ),
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            head_dim=32,  # != hidden/heads = 16
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    "olmoe": (
        OlmoeForCausalLM,
        OlmoeConfig(
            **{**COMMON, "num_key_value_heads": 4},  # MHA
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
}


# DeepSeek (multi-head latent attention): 4 heads whose q/k width (nope 16 + rope 16) differs from
# the value width (32) and from the latent (32 or 48), all multiples of 16 so int8/int4 tiles
# fall on head boundaries. MLA keeps one latent "KV head": num_key_value_heads = heads.
MLA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=None,
    tie_word_embeddings=False,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=32,
    moe_intermediate_size=32,
    intermediate_size=128,  # the dense first layers
    n_routed_experts=8,
    num_experts_per_tok=2,
)
ARCHS["deepseek_v2"] = (
    DeepseekV2ForCausalLM,
    DeepseekV2Config(
        **MLA,
        num_hidden_layers=3,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        q_lora_rank=None,  # q_proj straight from the hidden state
        kv_lora_rank=32,
        first_k_dense_replace=1,
        n_shared_experts=2,
        topk_method="greedy",
        routed_scaling_factor=1.5,
    ),
)
ARCHS["deepseek_v2_group"] = (
    DeepseekV2ForCausalLM,
    DeepseekV2Config(
        **MLA,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        q_lora_rank=32,
        kv_lora_rank=48,
        first_k_dense_replace=0,
        n_shared_experts=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
    ),
)
# What V3 and V3.2 share: latent ranks, layer 0 dense, noaux_tc over 4 groups keeping 2.
V3_SHAPE = dict(q_lora_rank=32, kv_lora_rank=48, first_k_dense_replace=1, n_shared_experts=1,
                n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
# V3: noaux_tc with a non-zero correction bias, YaRN past a 64-position original context (the
# prompts plus continuations reach 73), mscale != mscale_all_dim so that both the cos/sin
# attention factor and the softmax scale's mscale^2 are exercised.
ARCHS["deepseek_v3"] = (
    DeepseekV3ForCausalLM,
    DeepseekV3Config(
        **MLA,
        num_hidden_layers=3,
        max_position_embeddings=256,  # = factor x original, as DeepSeek-V3's config
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
        **V3_SHAPE,
        num_nextn_predict_layers=1,  # an MTP module (MtpModule) with its reference logits
    ),
)

# What V3.2 and GLM-5 share: the V3 shape with plain RoPE and the indexer.
DSA_SHAPE = dict(**MLA, max_position_embeddings=512,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **V3_SHAPE,
                 index_topk=8, index_n_heads=8, index_head_dim=32)

# V3.2: V3 plus DeepSeek Sparse Attention. index_topk 8 is far below the prompts plus their
# continuations (up to 73 positions), so most queries attend to a selection; 8 indexer heads
# keep exact zero scores (every head's relu at 0) rare, and min_dsa_gap checks that no k-th and
# (k+1)-th index score are near a tie. Plain RoPE (V3's YaRN is covered by deepseek_v3). An MTP
# module whose block, like V3.2's, has an indexer of its own.
ARCHS["deepseek_v32"] = (
    DeepseekV32ForCausalLM,
    DeepseekV32Config(**DSA_SHAPE, num_hidden_layers=3, num_nextn_predict_layers=1),
)

# GLM-5 (glm_moe_dsa): V3.2's sparse attention with the indexer's RoPE interleaved and layer 1
# "shared" (no indexer: it attends to what layer 0 selected); 4 layers so that a full layer
# follows a shared one.
ARCHS["glm_moe_dsa"] = (
    GlmMoeDsaForCausalLM,
    GlmMoeDsaConfig(**DSA_SHAPE, num_hidden_layers=4,
                    indexer_types=["full", "shared", "full", "shared"]),
)

# DeepSeek-V4: hyper-connections (4 streams, 20 Sinkhorn steps), one shared key/value head with a
# query LoRA, sinks, partial interleaved RoPE (8 of 32), the grouped output projection, hash
# routing on the first layer and sqrtsoftplus top-k + bias on the others, SwiGLU clamped at 1.0
# (so that random activations reach the clamp). A sliding window of 8 is far below the prompts.
V4_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                head_dim=32, partial_rotary_factor=0.25, q_lora_rank=48, o_groups=2,
                o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, swiglu_limit=1.0,
                max_position_embeddings=512, sliding_window=8, bos_token_id=None,
                eos_token_id=0, pad_token_id=None, tie_word_embeddings=False,
                num_nextn_predict_layers=0, rope_theta=10000.0, compress_rope_theta=160000.0,
                index_n_heads=8, index_head_dim=16, index_topk=3,
                compress_rates={"compressed_sparse_attention": 4,
                                "heavily_compressed_attention": 8})
# Every layer sliding-window: the hyper-connections, routing and output projection alone.
ARCHS["deepseek_v4_sliding"] = (
    DeepseekV4ForCausalLM,
    DeepseekV4Config(**V4_SHAPE, num_hidden_layers=2,
                     layer_types=["sliding_attention"] * 2,
                     mlp_layer_types=["hash_moe", "moe"]),
)
# Compressed attention: CSA entries every 4 tokens (overlapping windows of 8) of which the
# indexer keeps 3, HCA entries every 8; the prompts plus continuations reach 73 positions, so
# most queries select. The compressed layers' rope is YaRN (factor 4 over 64 original
# positions, as V4 publishes it: attention factor 1), the sliding layer's plain.
ARCHS["deepseek_v4"] = (
    DeepseekV4ForCausalLM,
    DeepseekV4Config(**dict(V4_SHAPE, max_position_embeddings=256), num_hidden_layers=4,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 64,
                                      "beta_fast": 32, "beta_slow": 1},
                     layer_types=["sliding_attention", "compressed_sparse_attention",
                                  "heavily_compressed_attention", "compressed_sparse_attention"],
                     mlp_layer_types=["hash_moe", "moe", "moe", "moe"]),
)

# GLM-4.5/4.6/4.7: GQA with q/k/v biases and per-head q/k RMSNorm, rotary on the first half of
# each head (partial_rotary_factor 0.5, head_dim 32 != hidden/heads so the rotated width 16 is
# neither), layer 0 dense, then DeepSeek-V3's noaux_tc routing over 8 experts in 2 groups of
# which 1 is kept, a non-zero correction bias, norm_topk_prob and scale 2.5, one shared expert.
# num_nextn_predict_layers 1: GLM checkpoints carry one multi-token-prediction layer after the
# decoder layers, which transformers does not build; add_mtp_layer writes its tensors (a module
# built from transformers' own classes, MtpModule) and write_mtp_reference its logits.
ARCHS["glm4_moe"] = (
    Glm4MoeForCausalLM,
    Glm4MoeConfig(
        **{k: v for k, v in COMMON.items() if k != "rope_parameters"},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        num_hidden_layers=3,
        head_dim=32,
        attention_bias=True,
        use_qk_norm=True,
        intermediate_size=128,  # the dense layer 0
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
    ),
)

# MiniMax-M2: GQA (head_dim 32 != hidden/heads) whose q/k RMSNorm spans the whole projection
# (weights of n_heads*head_dim and n_kv_heads*head_dim, olmoe's placement: before the head
# split), rotate-half RoPE on the first rotary_dim = head_dim/2 dims of each head, every layer
# MoE (experts of width intermediate_size) routed by sigmoid + a non-zero
# e_score_correction_bias, top-2 of 8 without groups, weights renormalised; no shared expert.
ARCHS["minimax_m2"] = (
    MiniMaxM2ForCausalLM,
    MiniMaxM2Config(
        **{k: v for k, v in COMMON.items() if k != "rope_parameters"},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        num_hidden_layers=3,
        head_dim=32,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
)

# gpt-oss: GQA with sinks and q/k/v/o biases, a sliding window (8) shorter than the longer
# prompts on layers 0 and 2 and full attention on layer 1, YaRN past a 64-position original
# context (truncate false, as gpt-oss ships), and a swiglu_limit low enough that both clamps of
# the experts' activation bind on these activations. Its experts are stored as gpt-oss publishes
# them, MXFP4 (see make_gptoss), so hidden and expert widths are multiples of 32.
GPTOSS = GptOssConfig(
    **{k: v for k, v in COMMON.items() if k not in ("rope_parameters", "max_position_embeddings")},
    max_position_embeddings=256,  # = factor x original, as gpt-oss's config
    head_dim=16,
    num_hidden_layers=3,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 64, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False},
    swiglu_limit=1.2,
    attention_bias=True,
)
GPTOSS_FOLDERS = ["gpt_oss", "gpt_oss_bf16", "gpt_oss_dense"]

# The hybrid Qwen models: Gated DeltaNet on 3 of 4 layers and gated full attention (q/k norm per
# head, partial rotary of a head_dim 16: 4 dims for qwen3_next's 0.25, 8 for qwen3_5_moe's 0.5)
# on the 4th; 2 key heads serving 4 value heads (grouped value attention), key heads 16 wide and
# value heads 8 (so a transposed state shows), a 4-tap conv; every RMSNorm zero-centred. The MoE
# blocks: top-2 of 8 renormalised plus the sigmoid-gated shared expert; qwen3_next's layer 1 is
# dense (mlp_only_layers) and its DeltaNet projections are fused per key head (in_proj_qkvz,
# in_proj_ba), qwen3_5_moe's apart (in_proj_qkv/_z/_b/_a). Their prompts add one of 85 tokens,
# past the 64-token chunk of transformers' chunked delta rule, so the recurrence is compared
# across a chunk boundary.
HYBRID = dict(
    **{k: v for k, v in COMMON.items() if k != "rope_parameters"},
    num_hidden_layers=4,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
ARCHS["qwen3_next"] = (
    Qwen3NextForCausalLM,
    Qwen3NextConfig(
        **HYBRID,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        intermediate_size=128,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
)
ARCHS["qwen3_5_moe"] = (
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig(
        **HYBRID,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True},
    ),
)
# Granite 4.0-H: Mamba2 on 3 of 4 layers (4 heads of 32 in 2 groups with states of 16, a 4-tap
# conv with bias) and NoPE GQA attention on the 4th, as IBM publishes it; every FFN the shared
# MLP (64 wide) plus top-2 of 8 experts (top-k logits softmaxed); Granite's multipliers all away
# from 1 so that a missing one shows (embedding x4, residual x0.5, softmax scale 0.3,
# logits / 1.25).
GRANITE_HYBRID = dict(
    **{k: v for k, v in COMMON.items() if k != "rope_parameters"},
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    num_hidden_layers=4,
    intermediate_size=32,
    shared_intermediate_size=64,
    mamba_n_heads=4,
    mamba_d_head=32,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_expand=2,
    embedding_multiplier=4.0,
    residual_multiplier=0.5,
    attention_multiplier=0.3,
    logits_scaling=1.25,
)
ARCHS["granitemoehybrid"] = (
    GraniteMoeHybridForCausalLM,
    GraniteMoeHybridConfig(
        **GRANITE_HYBRID,
        num_local_experts=8,
        num_experts_per_tok=2,
        position_embedding_type="nope",
        layer_types=["mamba", "mamba", "mamba", "attention"],
    ),
)
# A dense Granite 4.0 hybrid (Granite-4.0-H-Micro's kind: num_local_experts 0, so every FFN is
# the shared MLP alone), with RoPE on its attention layers (position_embedding_type "rope", as
# the attention-only Granite 4.0 models use) and Mamba2 and attention alternating.
ARCHS["granitemoehybrid_dense"] = (
    GraniteMoeHybridForCausalLM,
    GraniteMoeHybridConfig(
        **GRANITE_HYBRID,
        num_local_experts=0,
        num_experts_per_tok=0,
        position_embedding_type="rope",
        layer_types=["mamba", "attention", "mamba", "attention"],
    ),
)
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe", "granitemoehybrid", "granitemoehybrid_dense")

# Llama 4: RoPE (interleaved pairs, Llama 3 scaling across all three bands of its rule: head_dim
# 16 against an original context of 64) with the weightless per-head q/k norm after it and
# chunked local attention in chunks of 8 (the prompts cross several) on layers 0 and 2; NoPE
# layers 1 and 3 attending globally with temperature tuning from position 3 (floor_scale 4);
# MoE on layers 1 and 3, top-1 of 8 by logit with its sigmoid scaling the expert's input, plus
# the shared expert; layers 0 and 2 dense (intermediate_size_mlp).
ARCHS["llama4_text"] = (
    Llama4ForCausalLM,
    Llama4TextConfig(
        **{k: v for k, v in COMMON.items() if k != "rope_parameters"},
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size=32,
        intermediate_size_mlp=128,
        num_local_experts=8,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
        attention_chunk_size=8,
        floor_scale=4,
        attn_scale=0.5,
    ),
)
LONG_PROMPT = ("KING RICHARD III:\nNow is the winter of our discontent made glorious summer by "
               "this sun of York; and all the clouds that lour'd upon our house in the deep "
               "bosom of the ocean buried.")

# Per-architecture weight seed offsets, picked (by trying a few) so that no token's k-th and
# (k+1)-th router logits are within ROUTER_GAP_MIN of each other on the reference sequences:
# a near tie would make expert choice, and so the expected logits, hinge on rounding.
SEED_OFFSET = {"deepseek_v4": 6,
               "minimax_m2": 14, "qwen3_next": 9, "qwen3_5_moe": 11, "granitemoehybrid": 2,
               "glm4_moe": 3, "qwen3_moe": 1, "deepseek_v2": 4, "deepseek_v2_group": 5,
               "deepseek_v3": 11, "deepseek_v32": 2, "glm_moe_dsa": 9, "gpt_oss": 1}
ROUTER_GAP_MIN = 1e-3
# DeepSeek-V2 ranks softmax probabilities (~1/8 each here), whose gaps are ~100x smaller than
# logit gaps for the same routing margin; still ~1000x above f32 rounding of a probability.
ROUTER_GAP_MIN_PROB = 2e-5
# MiniMax-M2 ranks sigmoid(logit) + bias with no groups to absorb near ties; the sigmoid's slope
# is at most 1/4, so a 1e-3 logit margin is >= 2.5e-4 here (still ~100x f32 rounding of a score).
ROUTER_GAP_MIN_SIGMOID = 2.5e-4


def train_tokenizer(data_path):
    """Byte-level BPE, vocab 512, on the first 200 KB of tinyshakespeare (deterministic)."""
    raw = Path(data_path).read_bytes()[:200_000]
    text = raw.decode("utf-8", errors="strict")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One sequence in, one thread's worth of counting: the merge order cannot depend on
    # how the input was split into batches.
    tok.train_from_iterator([text], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    assert tok.token_to_id(EOS) == COMMON["eos_token_id"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token=EOS, chat_template=CHAT_TEMPLATE
    )


def prompt_ids(tokenizer):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPT_TEXTS]
    ids.append(tokenizer("The", add_special_tokens=False)["input_ids"][:1])
    return ids


def make_kimi_k25(out_root, tokenizer, text_model, text_dir):
    """kimi_k25 (Kimi-K2.5/K2.6): the deepseek_v3 fixture's text model inside
    Kimi_K25ForConditionalGeneration (config with text_config and vision_config, a tiny vision
    tower), saved by transformers (kimi_k25: model.language_model.*, lm_head) and with the
    tensor names Moonshot publishes (kimi_k25_published). transformers 5.25 writes the text
    model as language_model.model.blocks.N (its save mapping renames the vision tower's
    "layers" back to "blocks" everywhere) and Moonshot as language_model.model.layers.N; both
    load in transformers (checked here) and their text-only forward must give the deepseek_v3
    fixture's logits (checked, both in f32), so the reference is a copy of that one."""
    tc = text_model.config.to_dict()
    vision = dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2,
                  num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
                  intermediate_size=64)
    cfg = Kimi_K25Config(text_config=tc, vision_config=vision, projection_hidden_size=32,
                         tie_word_embeddings=False)
    torch.manual_seed(SEED)
    vl = Kimi_K25ForConditionalGeneration(cfg).eval()
    src = text_model.state_dict()
    with torch.no_grad():
        for k, v in vl.state_dict().items():
            if k.startswith("model.language_model."):
                v.copy_(src["model." + k[len("model.language_model."):]])
            elif k == "lm_head.weight":
                v.copy_(src["lm_head.weight"])
    d, dp = out_root / "kimi_k25", out_root / "kimi_k25_published"
    for x in (d, dp):  # built with deepseek_v3: --only deepseek_v3 rebuilds them too
        if x.exists():
            shutil.rmtree(x)
    save_checkpoint(vl, tokenizer, d)
    back = Kimi_K25ForConditionalGeneration.from_pretrained(d, dtype=torch.float32, **IMPL).eval()
    with safe_open(str(text_dir / "reference.safetensors"), "pt") as ref:
        for k in ref.keys():
            if k.endswith(".ids"):
                ids = ref.get_tensor(k).tolist()
                want, got = full_logits(text_model, ids), full_logits(back, ids)
                err = float((got - want).abs().max() / want.abs().max())
                assert err < 1e-5, f"kimi_k25 {k}: text path differs by {err} (relative)"
    shutil.copyfile(text_dir / "reference.safetensors", d / "reference.safetensors")
    # the published spelling: the same tensors renamed, everything else as saved
    shutil.copytree(d, dp)
    with safe_open(str(d / "model.safetensors"), "pt") as sf:
        sd = {k: sf.get_tensor(k) for k in sf.keys()}
    ren = {}
    for k, v in sd.items():
        if k.startswith("language_model.model.blocks."):
            k = "language_model.model.layers." + k[len("language_model.model.blocks."):]
        ren[k] = v
    assert any(k.startswith("language_model.model.layers.") for k in ren), sorted(sd)[:4]
    save_file(dict(sorted(ren.items())), str(dp / "model.safetensors"), metadata={"format": "pt"})
    pub = Kimi_K25ForConditionalGeneration.from_pretrained(dp, dtype=torch.float32, **IMPL).eval()
    ids = list(range(1, 20))
    err = float((full_logits(pub, ids) - full_logits(text_model, ids)).abs().max())
    assert err < 1e-4, f"kimi_k25_published: transformers reads it differently ({err})"
    n = sum(p.numel() for p in vl.parameters())
    return [("kimi_k25", n, dir_size(d), None, 0.0, ["text path = deepseek_v3"]),
            ("kimi_k25_published", n, dir_size(dp), None, 0.0, ["Moonshot's tensor names"])]


def long_prompt_ids(tokenizer):
    ids = tokenizer(LONG_PROMPT, add_special_tokens=False)["input_ids"]
    assert 64 < len(ids) <= 96, len(ids)  # past one delta-rule chunk, + 32 greedy within 128
    return ids


def make_qwen3_5_vl(out_root, tokenizer, text_model, text_dir):
    """qwen3_5_moe as Qwen publishes it: a Qwen3_5MoeForConditionalGeneration folder (config
    with text_config and vision_config, text weights under model.language_model., a vision tower
    under model.visual.) holding the same text weights as the qwen3_5_moe fixture. Its text-only
    forward (interleaved mRoPE with equal positions in all three sections) must give that
    fixture's logits (checked here, both in f32), so its reference is a copy of that one."""
    tc = text_model.config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                  num_position_embeddings=16, in_channels=3)
    cfg = Qwen3_5MoeConfig(text_config=tc, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    vl = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    src = text_model.state_dict()
    with torch.no_grad():
        for k, v in vl.state_dict().items():
            if k.startswith("model.language_model."):
                v.copy_(src["model." + k[len("model.language_model."):]])
            elif k == "lm_head.weight":
                v.copy_(src["lm_head.weight"])
    d = out_root / "qwen3_5_moe_vl"
    save_checkpoint(vl, tokenizer, d)
    back = Qwen3_5MoeForConditionalGeneration.from_pretrained(d, dtype=torch.float32, **IMPL).eval()
    with safe_open(str(text_dir / "reference.safetensors"), "pt") as ref:
        for k in ref.keys():
            if k.endswith(".ids"):
                ids = ref.get_tensor(k).tolist()
                want = full_logits(text_model, ids)  # both in f32, the same arithmetic
                got = full_logits(back, ids)
                err = float((got - want).abs().max() / want.abs().max())
                assert err < 1e-5, f"qwen3_5_moe_vl {k}: text path differs by {err} (relative)"
    shutil.copyfile(text_dir / "reference.safetensors", d / "reference.safetensors")
    return [("qwen3_5_moe_vl", sum(p.numel() for p in vl.parameters()), dir_size(d), None, 0.0,
             ["text path of the multimodal folder = qwen3_5_moe"])]


def make_llama4_vl(out_root, tokenizer, text_model, text_dir):
    """llama4 as Meta publishes it: a Llama4ForConditionalGeneration folder (config with
    text_config and vision_config, text weights under language_model., a tiny vision tower and
    projector) holding the llama4_text fixture's text weights. Its text-only forward must give
    that fixture's logits (checked here, both in f32), so its reference is a copy of that one."""
    tc = text_model.config.to_dict()
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, vision_output_dim=32, image_size=28, patch_size=14,
                  projector_input_dim=32, projector_output_dim=32)
    cfg = Llama4Config(text_config=tc, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    vl = Llama4ForConditionalGeneration(cfg).eval()
    src = text_model.state_dict()
    with torch.no_grad():
        for k, v in vl.state_dict().items():
            if k.startswith("language_model."):
                v.copy_(src[k[len("language_model."):]])
    d = out_root / "llama4_vl"
    if d.exists():  # built with llama4_text: --only llama4_text rebuilds it too
        shutil.rmtree(d)
    save_checkpoint(vl, tokenizer, d)
    back = Llama4ForConditionalGeneration.from_pretrained(d, dtype=torch.float32, **IMPL).eval()
    with safe_open(str(text_dir / "reference.safetensors"), "pt") as ref:
        for k in ref.keys():
            if k.endswith(".ids"):
                ids = ref.get_tensor(k).tolist()
                want, got = full_logits(text_model, ids), full_logits(back, ids)
                err = float((got - want).abs().max() / want.abs().max())
                assert err < 1e-5, f"llama4_vl {k}: text path differs by {err} (relative)"
    shutil.copyfile(text_dir / "reference.safetensors", d / "reference.safetensors")
    return [("llama4_vl", sum(p.numel() for p in vl.parameters()), dir_size(d), None, 0.0,
             ["text path of the multimodal folder = llama4_text"])]


def make_weights_nondegenerate(model, seed):
    """Overwrite transformers' init (std 0.02: flat logits, tied routing) with a scale that
    gives logits spread over several units and clearly separated router scores."""
    g = torch.Generator().manual_seed(seed)
    zero_centred = model.config.model_type in ("qwen3_next", "qwen3_5_moe_text")
    with torch.no_grad():
        params = list(model.named_parameters())
        params += [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, p in params:  # fixed order: deterministic
            r = torch.randn(tuple(p.shape), generator=g, dtype=torch.float32)
            fan_in = p.shape[-1]
            if name.endswith("norm.weight") and zero_centred and "linear_attn" not in name:
                v = 0.1 * r  # Qwen3-Next's RMSNorms scale by 1 + w
            elif name.endswith("norm.weight"):
                v = 1.0 + 0.1 * r  # a wrong or missing norm is visible
            elif name.endswith(".bias"):
                v = 0.2 * r
            elif "embed_tokens" in name:
                v = 0.5 * r
            elif (name.endswith("mlp.gate.weight") or name.endswith("mlp.router.weight")
                  or name.endswith("block_sparse_moe.router.weight")):
                v = 0.4 * r  # router (n_experts, hidden)
            elif name.endswith("self_attn.sinks"):  # gpt-oss: large enough to matter
                v = 1.0 * r
            elif name.endswith("e_score_correction_bias"):  # V3: reorders the choice
                v = 0.3 * r
            elif "shared_expert_gate" in name:
                v = 0.5 * r
            elif name.startswith("lm_head"):
                v = 2.0 * r / math.sqrt(fan_in)
            else:  # projections and stacked experts (..., out, in)
                v = r / math.sqrt(fan_in)
            p.copy_(v.to(p.dtype))
        for name, b in model.named_buffers():  # DeepSeek-V4 hash routing: k distinct experts
            if name.endswith("tid2eid"):
                E = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(E, generator=g)[: b.shape[1]]
                                     for _ in range(b.shape[0])]))


def save_checkpoint(model, tokenizer, out_dir, **save_kwargs):
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=COMMON["eos_token_id"], bos_token_id=None, pad_token_id=None
    )
    model.save_pretrained(out_dir, **save_kwargs)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def eager_config(cfg):
    """The model's config with the eager attention and experts of IMPL (the references' own:
    float64 runs need them)."""
    cfg = copy.deepcopy(cfg)
    cfg._attn_implementation = IMPL["attn_implementation"]
    cfg._experts_implementation = IMPL["experts_implementation"]
    return cfg


class MtpModule(torch.nn.Module):
    """One multi-token-prediction module as DeepSeek-V3 and GLM publish it (there is no class for
    it in transformers): enorm, hnorm, eh_proj (2 hidden -> hidden, embedding half first, as
    vLLM and SGLang read it), one decoder block of the model's own class at index n_layer (MoE
    per the config's first_k_dense_replace), shared_head.norm and shared_head.head."""

    def __init__(self, model):
        super().__init__()
        cfg = eager_config(model.config)
        # per-layer lists (V3.2's) cover the decoder only: the module's block is a sparse-MoE
        # layer with the last layer's attention type (its own indexer)
        for key, extra in (("mlp_layer_types", "sparse"), ("layer_types", None)):
            lst = getattr(cfg, key, None)
            if isinstance(lst, list) and len(lst) == cfg.num_hidden_layers:
                setattr(cfg, key, lst + [lst[-1] if extra is None else extra])
        self.config = cfg
        D, V = cfg.hidden_size, cfg.vocab_size
        norm_cls = type(model.model.norm)
        self.layer = type(model.model.layers[0])(cfg, cfg.num_hidden_layers)
        self.enorm = norm_cls(D, eps=cfg.rms_norm_eps)
        self.hnorm = norm_cls(D, eps=cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = norm_cls(D, eps=cfg.rms_norm_eps)
        self.shared_head.head = torch.nn.Linear(D, V, bias=False)

    def tensors(self, prefix):
        out = {}
        for k, v in self.state_dict().items():
            name = k[len("layer."):] if k.startswith("layer.") else k
            out[prefix + name] = v.detach().clone().contiguous()
        return out


class QwenMtpModule(torch.nn.Module):
    """Qwen3-Next's and Qwen3.5's MTP module as they publish it under mtp. (no class for it in
    transformers either): pre_fc_norm_embedding, pre_fc_norm_hidden, fc (embedding half first),
    layers.0 (a full-attention decoder block of the model's own class) and norm, read by the
    model's lm_head. Presented with MtpModule's names (enorm, hnorm, eh_proj, layer) so that
    mtp_reference runs both; chained drafts read its normed output."""

    def __init__(self, model):
        super().__init__()
        cfg = eager_config(model.config)
        self.config = cfg
        D = cfg.hidden_size
        norm_cls = type(model.model.norm)
        full = cfg.layer_types.index("full_attention")
        self.layers = torch.nn.ModuleList([type(model.model.layers[0])(cfg, full)])
        self.pre_fc_norm_embedding = norm_cls(D, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(D, eps=cfg.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * D, D, bias=False)
        self.norm = norm_cls(D, eps=cfg.rms_norm_eps)
        self.chain_normed = True

    enorm = property(lambda self: self.pre_fc_norm_embedding)
    hnorm = property(lambda self: self.pre_fc_norm_hidden)
    eh_proj = property(lambda self: self.fc)
    layer = property(lambda self: self.layers[0])

    def tensors(self, prefix):
        return {"mtp." + k: v.detach().clone().contiguous() for k, v in self.state_dict().items()}


def make_mtp_module(model, seed):
    qwen = model.config.model_type in ("qwen3_next", "qwen3_5_moe_text")
    mtp = (QwenMtpModule(model) if qwen else MtpModule(model)).eval()
    make_weights_nondegenerate(mtp, seed)
    if not qwen:
        with torch.no_grad():  # spread its logits as the main head's are
            mtp.shared_head.head.weight.mul_(2.0)
    return mtp


def add_mtp_layer(mtp, out_dir, dtype):
    """Appends the MTP module's tensors, in `dtype`, to out_dir/model.safetensors under
    model.layers.{num_hidden_layers}. (with its own embed_tokens copy, as DeepSeek publishes
    it). transformers leaves them unread."""
    cfg = mtp.config
    f = out_dir / "model.safetensors"
    with safe_open(str(f), "pt") as sf:
        sd = {k: sf.get_tensor(k) for k in sf.keys()}
    pre = f"model.layers.{cfg.num_hidden_layers}."
    for k, v in mtp.tensors(pre).items():
        sd[k] = v.to(dtype) if v.is_floating_point() else v
    if not isinstance(mtp, QwenMtpModule):
        sd[pre + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(dict(sorted(sd.items())), str(f), metadata={"format": "pt"})


@torch.no_grad()
def mtp_reference(model, mtp, ids):
    """The module's logits at every index i = 0..n-2 (the main model's last hidden state h_i,
    after its final norm as its LM head reads it, fused with the embedding of token i + 1;
    attention over indices 0..i at positions 0..i), and at index n-2 once more with h_{n-2}
    replaced by the module's own output at n-3 (a chained draft: before its head's norm,
    DeepSeek's layout, or after it, Qwen's)."""
    x_ids = torch.tensor([ids], dtype=torch.long)
    cap = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: cap.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    model(input_ids=x_ids)
    hook.remove()
    h = model.model.norm(cap["h"][0])
    emb = model.model.embed_tokens(x_ids)[0]
    if isinstance(mtp, QwenMtpModule):
        head_norm, head = mtp.norm, model.lm_head
    else:
        head_norm, head = mtp.shared_head.norm, mtp.shared_head.head

    def run(hid):
        x = mtp.eh_proj(torch.cat([mtp.enorm(emb[1:]), mtp.hnorm(hid)], -1))[None]
        L = x.shape[1]
        pos = torch.arange(L)[None]
        pe = model.model.rotary_emb(x, pos)
        mask = torch.full((L, L), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
        y = mtp.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        y = (y[0] if isinstance(y, tuple) else y)[0]
        return y, head(head_norm(y))

    y, lg = run(h[:-1])
    hc = h[:-1].clone()
    hc[-1] = head_norm(y[-2]) if isinstance(mtp, QwenMtpModule) else y[-2]
    _, lgc = run(hc)
    return lg.float().contiguous(), lgc[-1].float().contiguous()


def write_mtp_reference(model_dir, model, mtp, prompts, suffix=""):
    """Adds prompt{i}.mtp_logits{suffix} (n-1, vocab) and prompt{i}.mtp_chain_logits{suffix}
    (vocab) to model_dir/reference.safetensors."""
    f = model_dir / "reference.safetensors"
    with safe_open(str(f), "pt") as sf:
        t = {k: sf.get_tensor(k) for k in sf.keys()}
    if model.config.model_type in ("qwen3_next", "qwen3_5_moe_text"):
        # as write_reference: transformers' chunked delta rule drifts in f32, so float64
        model, mtp = copy.deepcopy(model).double(), copy.deepcopy(mtp).double()
    for i, ids in enumerate(prompts):
        if len(ids) < 3:  # a chained index needs two before it
            continue
        lg, lgc = mtp_reference(model, mtp, ids)
        check_logits(f"{model_dir.name}/prompt{i} mtp", lg)
        t[f"prompt{i}.mtp_logits{suffix}"] = lg
        t[f"prompt{i}.mtp_chain_logits{suffix}"] = lgc
    save_file(t, str(f), metadata={"format": "pt"})


def load(out_dir, dtype):
    m = AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype, **IMPL)
    return m.eval()


@torch.no_grad()
def full_logits(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x).logits[0].to(torch.float32).contiguous()  # (n, vocab)


@torch.no_grad()
def greedy(model, ids):
    """32 greedy tokens and the top1-top2 gap at each step.

    eos_token_id=None makes every step a plain argmax over the raw logits: EOS neither stops
    generation nor is masked out (min_new_tokens would mask it, which an engine's "ignore EOS"
    does not do), so an engine reproduces this with argmax alone."""
    x = torch.tensor([ids], dtype=torch.long)
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=GREEDY_TOKENS,
        min_new_tokens=GREEDY_TOKENS,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=COMMON["eos_token_id"],
        eos_token_id=None,
    )
    new = out.sequences[0, len(ids):]
    assert new.numel() == GREEDY_TOKENS
    margins = torch.empty(GREEDY_TOKENS, dtype=torch.float32)  # top1 - top2 at each step
    eos_top = 0
    for step, (s, raw) in enumerate(zip(out.scores, out.logits)):
        assert torch.equal(s, raw), "a logits processor changed the greedy scores"
        top2 = torch.topk(raw[0].float(), 2).values
        margins[step] = top2[0] - top2[1]
        if int(raw[0].argmax()) == COMMON["eos_token_id"]:
            eos_top += 1
    # The cached decode must agree with one uncached forward over prompt + continuation.
    seq = out.sequences[0].tolist()
    lg = full_logits(model, seq[:-1])
    recomputed = lg[len(ids) - 1:].argmax(-1)
    mismatch = int((recomputed != new).sum())
    return new.to(torch.int32), margins, eos_top, mismatch


def choice_scores(model, layer, rl):
    """The scores a router ranks experts by, and (grouped routers) its group scores; None for
    groups otherwise. DeepSeek V2 group_limited_greedy ranks groups by their best softmax
    probability, V3 by the sum of their two best sigmoid + bias."""
    cfg = model.config
    if cfg.model_type in ("deepseek_v3", "glm4_moe"):
        s = rl.float().sigmoid() + model.model.layers[layer].mlp.gate.e_score_correction_bias
        g = s.view(-1, cfg.n_group, s.shape[-1] // cfg.n_group).topk(2, dim=-1)[0].sum(-1)
        return s, g
    if cfg.model_type == "deepseek_v4":  # sqrt(softplus) + bias, no groups
        return (torch.nn.functional.softplus(rl.float()).sqrt()
                + model.model.layers[layer].mlp.gate.e_score_correction_bias), None
    if cfg.model_type == "minimax_m2":  # sigmoid + bias on the MoE block, no groups
        return rl.float().sigmoid() + model.model.layers[layer].mlp.e_score_correction_bias, None
    if cfg.model_type == "deepseek_v2":
        p = rl.float().softmax(-1)
        if cfg.topk_method == "group_limited_greedy":
            return p, p.view(-1, cfg.n_group, p.shape[-1] // cfg.n_group).max(-1).values
        return p, None
    return rl.float(), None


def moe_layer_ids(model):
    """Layers with a router (gpt-oss names it `router`, the others `gate`; Granite's sits in
    block_sparse_moe)."""
    if model.config.model_type == "granitemoehybrid":
        return [i for i, l in enumerate(model.model.layers) if l.block_sparse_moe is not None]
    if model.config.model_type == "llama4_text":
        return [i for i, l in enumerate(model.model.layers) if l.is_moe_layer]
    if model.config.model_type == "deepseek_v4":  # hash layers record no router logits
        return [i for i, l in enumerate(model.model.layers) if not l.mlp.is_hash]
    return [i for i, l in enumerate(model.model.layers)
            if (hasattr(l.mlp, "gate") or hasattr(l.mlp, "router")) and not hasattr(l.mlp, "gate_proj")]


@torch.no_grad()
def min_router_gap(model, sequences):
    """Smallest gap between the k-th and (k+1)-th score an expert (and a group, for grouped
    routers) is chosen by, over all MoE layers/tokens."""
    k = model.config.num_experts_per_tok
    kg = getattr(model.config, "topk_group", None)
    gap = math.inf
    if not moe_layer_ids(model):  # a dense model (Granite with no experts) routes nothing
        return gap
    for seq in sequences:
        out = model(input_ids=torch.tensor([seq], dtype=torch.long), output_router_logits=True)
        moe_layers = moe_layer_ids(model)
        for li, rl in zip(moe_layers, [r for r in (out.router_logits or ()) if r is not None]):
            s, g = choice_scores(model, li, rl)
            if g is not None:
                gt = torch.topk(g, kg + 1, dim=-1).values if kg < g.shape[-1] else None
                if gt is not None:
                    gap = min(gap, float((gt[:, kg - 1] - gt[:, kg]).min()))
                keep = torch.topk(g, kg, dim=-1).indices
                mask = torch.zeros_like(g).scatter_(1, keep, 1).repeat_interleave(
                    s.shape[-1] // g.shape[-1], dim=-1)
                s = s.masked_fill(mask == 0, -1e9)
            top = torch.topk(s, k + 1, dim=-1).values
            gap = min(gap, float((top[:, k - 1] - top[:, k]).min()))
    return gap


@torch.no_grad()
def route_sets(model, ids):
    """(n_moe_layers, n, k) chosen experts per token, sorted, from the router logits."""
    k = model.config.num_experts_per_tok
    kg = getattr(model.config, "topk_group", None)
    moe_layers = moe_layer_ids(model)
    if not moe_layers:  # dense: no choices, so every position agrees
        return torch.zeros((0, len(ids), 0), dtype=torch.long)
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), output_router_logits=True)
    sets = []
    for li, rl in zip(moe_layers, [r for r in (out.router_logits or ()) if r is not None]):
        s, g = choice_scores(model, li, rl)
        if g is not None:
            keep = torch.topk(g, kg, dim=-1).indices
            mask = torch.zeros_like(g).scatter_(1, keep, 1).repeat_interleave(
                s.shape[-1] // g.shape[-1], dim=-1)
            s = s.masked_fill(mask == 0, -1e9)
        sets.append(torch.topk(s, k, dim=-1).indices.sort(-1).values)
    return torch.stack(sets)


def check_logits(name, lg):
    assert torch.isfinite(lg).all(), f"{name}: non-finite logits"
    spread = (lg.max(-1).values - lg.min(-1).values).min().item()
    assert spread > 1.0, f"{name}: logits nearly flat (min spread {spread:.3f})"
    return spread


def write_reference(model_dir, prompts, f32_model, bf16_model=None):
    """reference.safetensors: see README.md for the tensor list. The hybrid models' f32 logits
    are transformers' forward run in float64 (then rounded to f32): in f32, its chunked delta
    rule (a triangular solve over cumulative decays) drifts ~3e-5 from the exact recurrence,
    more than an exact f32 engine does, so f64 is the reference that measures the engine."""
    tensors = {}
    if f32_model.config.model_type in ("qwen3_next", "qwen3_5_moe_text", "granitemoehybrid"):
        f64_model = copy.deepcopy(f32_model).double()
        def exact_logits(ids):
            return full_logits(f64_model, ids)
    else:
        def exact_logits(ids):
            return full_logits(f32_model, ids)
    margins = []
    notes = []
    spread = math.inf
    worst_bf16 = 0.0
    for i, ids in enumerate(prompts):
        tensors[f"prompt{i}.ids"] = torch.tensor(ids, dtype=torch.int32)
        if bf16_model is None:
            lg = exact_logits(ids)
            spread = min(spread, check_logits(f"{model_dir.name}/prompt{i}", lg))
            tensors[f"prompt{i}.logits"] = lg
            toks, step_margins, eos_top, mismatch = greedy(f32_model, ids)
            tensors[f"prompt{i}.greedy"] = toks
            tensors[f"prompt{i}.greedy_margin"] = step_margins
            margins.append(float(step_margins.min()))
            if eos_top:
                notes.append(f"prompt{i}: greedy emits EOS at {eos_top} step(s) and continues")
            if mismatch:
                notes.append(f"prompt{i}: {mismatch} greedy step(s) differ from uncached argmax")
        else:
            lg = full_logits(bf16_model, ids)
            spread = min(spread, check_logits(f"{model_dir.name}/prompt{i}", lg))
            tensors[f"prompt{i}.logits"] = lg
            lf = exact_logits(ids)
            tensors[f"prompt{i}.logits_f32compute"] = lf
            worst_bf16 = max(worst_bf16, float((lg - lf).abs().max()))
            # Positions where transformers' bf16 run picks the same experts as its f32 run of the
            # same weights in every layer: only there does the bf16 comparison measure precision
            # (a flipped expert is a different computation, not a rounding error).
            agree = (route_sets(bf16_model, ids) == route_sets(f32_model, ids)).all(-1).all(0)
            tensors[f"prompt{i}.bf16_route_agrees"] = agree.to(torch.int32)
            if not bool(agree.all()):
                notes.append(f"prompt{i}: bf16 routes {int((~agree).sum())} position(s) differently")
    if bf16_model is not None:
        notes.append(f"max|bf16 compute - f32 compute| = {worst_bf16:.3f}")
    if margins:
        fragile = sum(int((tensors[f"prompt{i}.greedy_margin"] < 1e-2).sum()) for i in range(len(prompts)))
        notes.append("per-prompt min margin " + " ".join(f"{m:.3g}" for m in margins)
                     + f"; {fragile} step(s) < 0.01")
        tensors["meta.margin"] = torch.tensor(margins, dtype=torch.float32)
    save_file(tensors, str(model_dir / "reference.safetensors"), metadata={"format": "pt"})
    if bf16_model is None:
        seqs = [ids + tensors[f"prompt{i}.greedy"].tolist() for i, ids in enumerate(prompts)]
    else:
        seqs = prompts  # the f32-compute references of the bf16 weights
    gap = min_router_gap(f32_model, seqs)  # f32 compute: what a CPU engine must reproduce
    notes.append(f"min router gap {gap:.2e}")
    if mt_dsa(f32_model):
        dgap = (min_v4_index_gap(f32_model, seqs) if f32_model.config.model_type == "deepseek_v4"
                else min_dsa_gap(f32_model, seqs))
        notes.append(f"min index-score gap {dgap:.2e}")
        if dgap < DSA_GAP_MIN:
            notes.append("WARNING: near-tie sparse-attention selection, change SEED_OFFSET")
    mt = f32_model.config.model_type
    gap_min = {"deepseek_v2": ROUTER_GAP_MIN_PROB, "minimax_m2": ROUTER_GAP_MIN_SIGMOID,
               "deepseek_v4": ROUTER_GAP_MIN_SIGMOID}  # sqrt(softplus)'s slope is below 0.5
    if gap < gap_min.get(mt, ROUTER_GAP_MIN):
        notes.append("WARNING: near-tie routing, change SEED_OFFSET")
    return (min(margins) if margins else None), spread, notes


DSA_GAP_MIN = 1e-4


def mt_dsa(model):
    return model.config.model_type in ("deepseek_v32", "glm_moe_dsa", "deepseek_v4")


@torch.no_grad()
def min_v4_index_gap(model, sequences):
    """DeepSeek-V4's CSA indexer: the smallest gap between the k-th and (k+1)-th score over the
    completed entries of any query that has more than index_topk of them."""
    gap = math.inf
    seen = []
    m, k = model.config.compress_rates["compressed_sparse_attention"], model.config.index_topk
    hooks = [l.self_attn.compressor.indexer.scorer.register_forward_hook(
                 lambda mod, args, out: seen.append(out))
             for l in model.model.layers
             if l.self_attn.compressor is not None and hasattr(l.self_attn.compressor, "indexer")]
    try:
        for seq in sequences:
            seen.clear()
            model(input_ids=torch.tensor([seq], dtype=torch.long), use_cache=False)
            for sc in seen:
                for t in range(sc.shape[1]):
                    valid = (t + 1) // m
                    if valid > k:
                        v = torch.topk(sc[0, t, :valid], k + 1).values
                        gap = min(gap, float(v[k - 1] - v[k]))
    finally:
        for h in hooks:
            h.remove()
    return gap


@torch.no_grad()
def min_dsa_gap(model, sequences):
    """Smallest gap between the k-th and (k+1)-th index score of any query that selects (more
    than index_topk positions before it), over every layer's indexer: the same scores as the
    indexer computes (relu of scaled q.k per head, weighted by weights_proj * heads^-0.5)."""
    gap = math.inf
    seen = []

    def hook(mod, args, kwargs):
        seen.append((mod, args, kwargs))

    handles = [l.self_attn.indexer.register_forward_pre_hook(hook, with_kwargs=True)
               for l in model.model.layers if l.self_attn.indexer is not None]
    try:
        for seq in sequences:
            seen.clear()
            model(input_ids=torch.tensor([seq], dtype=torch.long))
            for mod, args, kwargs in seen:
                x, q_resid, (cos, sin) = args[0], args[1], args[2]
                S = x.shape[1]
                q = mod.wq_b(q_resid).view(1, S, mod.n_heads, mod.head_dim)
                k = mod.k_norm(mod.wk(x)).unsqueeze(2)
                r = mod.qk_rope_head_dim
                from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
                    apply_rotary_pos_emb, apply_rotary_pos_emb_interleave)
                rot = (apply_rotary_pos_emb_interleave if model.config.model_type == "glm_moe_dsa"
                       else apply_rotary_pos_emb)
                qr, kr = rot(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
                q = torch.cat([qr, q[..., r:]], -1)
                k = torch.cat([kr, k[..., r:]], -1).squeeze(2)
                sc = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))
                                * mod.softmax_scale)
                w = mod.weights_proj(x).float() * mod.n_heads ** -0.5
                idx = torch.matmul(w.unsqueeze(-2), sc).squeeze(-2)[0]  # (S, S)
                kk = mod.index_topk
                for t in range(kk, S):  # rows with t + 1 > topk candidates
                    v = torch.topk(idx[t, : t + 1], kk + 1).values
                    gap = min(gap, float(v[kk - 1] - v[kk]))
    finally:
        for h in handles:
            h.remove()
    return gap


def tensor_table(model_dir):
    """(name, dtype, shape) of every tensor in a checkpoint folder, shards included."""
    files = sorted(model_dir.glob("model*.safetensors"))
    rows = []
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                rows.append((k, str(sf.get_slice(k).get_dtype()), sf.get_slice(k).get_shape()))
    return sorted(rows)


def write_tensors_md(out_root, names, merge=False):
    lines = [
        "# Tensor names and shapes of the fixture checkpoints",
        "",
        "Generated by `tests/reference/make_model_fixtures.py` from the saved f32 checkpoints in",
        "`tests/fixtures/models/<arch>/` (do not edit by hand). Shapes are as stored, row-major,",
        "PyTorch `nn.Linear` layout `(out_features, in_features)`. save_pretrained writes the",
        "per-expert legacy names (transformers 5 stacks experts in memory but converts back on",
        "save). The `_bf16` folders hold the same names with dtype BF16; `mixtral_sharded/` the",
        "same tensors as `mixtral/` split over shards listed in `model.safetensors.index.json`.",
        "",
        "Listed: every tensor outside `model.layers.*`, all of layer 0, and every layer whose",
        "MLP differs from layer 0 (the dense layer 1 of qwen2_moe/qwen3_moe).",
        "",
        "Config spellings a loader must accept (these files use the transformers 5.24 ones;",
        "checkpoints on the Hub often use the older ones):",
        "",
        "- RoPE base: `rope_parameters.rope_theta` here; older files have top-level `rope_theta`.",
        "- Expert count: mixtral `num_local_experts`; qwen2_moe and olmoe `num_experts`;",
        "  qwen3_moe is written as `num_local_experts` by 5.24 but Hub Qwen3-MoE files say",
        "  `num_experts` (accept both for every architecture).",
        "- `head_dim`: null for mixtral (= hidden_size / num_attention_heads); absent for",
        "  qwen2_moe and olmoe; explicit 32 for qwen3_moe (q_proj out = heads * head_dim = 128,",
        "  not hidden_size).",
        "- qwen2_moe `qkv_bias` is new in 5.x; when absent the q/k/v biases are present (true).",
        "- Dense layers: a layer is dense (plain `mlp.gate_proj/up_proj/down_proj` of width",
        "  `intermediate_size`) when its index is in `mlp_only_layers` or",
        "  `(i + 1) % decoder_sparse_step != 0`; otherwise MoE with experts of width",
        "  `moe_intermediate_size`.",
        "- Sliding window: off everywhere (`sliding_window` null, or 0 with",
        "  `use_sliding_window: false` for qwen2_moe).",
        "- `dtype` (formerly `torch_dtype`) says float32 or bfloat16; trust the safetensors",
        "  header dtype, not this key.",
        "- olmoe q_norm/k_norm act on the whole projection (width heads*head_dim and",
        "  kv_heads*head_dim), qwen3_moe's on each head (width head_dim).",
        "",
    ]
    sections = {}
    for name in names:
        d = out_root / name
        rows = tensor_table(d)
        cfg = json.loads((d / "config.json").read_text())
        dense = set(cfg.get("mlp_only_layers") or [])
        if cfg.get("model_type") == "glm4_moe":  # its first MoE layer
            dense |= {cfg["first_k_dense_replace"]}
        if cfg.get("num_nextn_predict_layers"):  # the MTP layers after the decoder
            dense |= set(range(cfg["num_hidden_layers"],
                               cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]))
        start = len(lines)
        lines += [f"## {name}", "", "```"]
        for k, dt, shape in rows:
            parts = k.split(".")
            if k.startswith("model.layers."):
                layer = int(parts[2])
                if layer != 0 and layer not in dense:
                    continue
            lines.append(f"{k:60s} {dt:8s} {list(shape)}")
        lines += ["```", "", "config.json:", "", "```json", (d / "config.json").read_text().rstrip(), "```", ""]
        gen = (d / "generation_config.json").read_text().rstrip()
        lines += ["generation_config.json:", "", "```json", gen, "```", ""]
        sections[name] = lines[start:]
        del lines[start:]
    if merge and TENSORS_MD.exists():
        # --only: keep the listing of every other family as it is (it may have been made by
        # another torch version) and replace or append just the rebuilt families' sections.
        old, head, cur = TENSORS_MD.read_text().split("\n"), [], None
        kept = {}
        for ln in old:
            if ln.startswith("## "):
                cur = ln[3:].strip()
                kept[cur] = []
            (kept[cur] if cur is not None else head).append(ln)
        kept.update(sections)
        lines = head
        for name in kept:
            lines += kept[name]
    else:
        for name in names:
            lines += sections[name]
    TENSORS_MD.write_text("\n".join(lines))


def dir_size(d):
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def sha_tree(root):
    h = {}
    for f in sorted(root.rglob("*")):
        if f.is_file():
            h[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return h


def random_mxfp4(g, shape, exps):
    """Random MXFP4 (blocks (..., n/32, 16) uint8, scales (..., n/32) uint8): any nibble, scales
    2^(e - 127) for e drawn from `exps`."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    pick = torch.randint(0, len(exps), shape, generator=g)
    scales = torch.tensor(exps, dtype=torch.int32)[pick].to(torch.uint8)
    return blocks, scales


def make_gptoss(out_root, tokenizer, prompts):
    """gpt-oss as OpenAI publishes it: MXFP4 experts (`*_blocks` + `*_scales`, e8m0 scales,
    32-element blocks, quantization_config mxfp4), everything else f32 (`gpt_oss`) or bf16
    (`gpt_oss_bf16`, the published layout). The expert weights are random MXFP4 data; the
    reference model's experts are those blocks dequantized by transformers' own code, and each
    folder is read back by transformers' MXFP4 loader and checked equal to that model.
    `gpt_oss_dense` is the same model as save_pretrained writes it unquantized ((in, out)
    experts, gate/up interleaved), with gpt_oss's reference."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(SEED)
    model = GptOssForCausalLM(GPTOSS).eval()
    make_weights_nondegenerate(model, SEED + SEED_OFFSET.get("gpt_oss", 0))
    cfg = GPTOSS
    E, D, ff = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(SEED + 100)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            pre = f"model.layers.{i}.mlp.experts."
            # weights ~ e2m1 (rms ~2.9) x 2^(e-127): rms about 1/sqrt(fan_in)
            gb, gs = random_mxfp4(g, (E, 2 * ff, D // 32), [121, 122, 123, 124])
            db, ds = random_mxfp4(g, (E, D, ff // 32), [122, 123, 124, 125])
            packed.update({pre + "gate_up_proj_blocks": gb, pre + "gate_up_proj_scales": gs,
                           pre + "down_proj_blocks": db, pre + "down_proj_scales": ds})
            layer.mlp.experts.gate_up_proj.copy_(convert_moe_packed_tensors(gb, gs, dtype=torch.float32))
            layer.mlp.experts.down_proj.copy_(convert_moe_packed_tensors(db, ds, dtype=torch.float32))
    n_params = sum(p.numel() for p in model.parameters())
    summary = []
    ref32 = None
    for name, dtype in (("gpt_oss", torch.float32), ("gpt_oss_bf16", torch.bfloat16)):
        d = out_root / name
        m = copy.deepcopy(model).to(dtype)  # `model` stays f32
        save_checkpoint(m, tokenizer, d)
        sd = {k: v.contiguous() for k, v in m.state_dict().items()
              if not (k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"))}
        sd.update(packed)
        (d / "model.safetensors").unlink()
        save_file(dict(sorted(sd.items())), str(d / "model.safetensors"), metadata={"format": "pt"})
        conf = json.loads((d / "config.json").read_text())
        conf["quantization_config"] = {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4"}
        (d / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        # transformers' MXFP4 loader (dequantizing, as on a CPU) must read back this model
        mq = {}
        for dt in (torch.float32, torch.bfloat16):
            mq[dt] = AutoModelForCausalLM.from_pretrained(
                d, dtype=dt, quantization_config=Mxfp4Config(dequantize=True), **IMPL).eval()
        ref = model.state_dict()
        if dtype == torch.bfloat16:
            ref = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in ref.items()}
        got = mq[torch.float32].state_dict()
        assert set(got) == set(ref), sorted(set(got) ^ set(ref))
        bad = [k for k in ref if not torch.equal(got[k].float(), ref[k])]
        assert not bad, f"{name}: transformers' MXFP4 load differs in {bad[:4]}"
        if dtype == torch.float32:
            margin, spread, notes = write_reference(d, prompts, mq[torch.float32])
            ref32 = d
        else:
            margin = None
            _, spread, notes = write_reference(d, prompts, mq[torch.float32], bf16_model=mq[torch.bfloat16])
        summary.append((name, n_params, dir_size(d), margin, spread, notes))
    dd = out_root / "gpt_oss_dense"
    save_checkpoint(model, tokenizer, dd)
    md = load(dd, torch.float32)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in md.state_dict().items())
    shutil.copyfile(ref32 / "reference.safetensors", dd / "reference.safetensors")
    summary.append(("gpt_oss_dense", n_params, dir_size(dd), None, 0.0, ["gpt_oss's reference"]))
    return summary


def build(out_root, data_path, write_md, only=None):
    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # reduction order independent of the machine's core count
    tokenizer = train_tokenizer(data_path)
    prompts = prompt_ids(tokenizer)
    print("prompt lengths:", [len(p) for p in prompts])

    summary = []
    for name, (cls, cfg) in ARCHS.items():
        if only and name not in only:
            continue
        torch.manual_seed(SEED)
        model = cls(cfg).eval()
        make_weights_nondegenerate(model, SEED + SEED_OFFSET.get(name, 0))
        n_params = sum(p.numel() for p in model.parameters())

        d32 = out_root / name
        save_checkpoint(model, tokenizer, d32)
        mtp = (make_mtp_module(model, SEED + 200)
               if getattr(cfg, "num_nextn_predict_layers", 0) or name in ("qwen3_next",
                                                                           "qwen3_5_moe")
               else None)
        if mtp is not None:
            add_mtp_layer(mtp, d32, torch.float32)
        m32 = load(d32, torch.float32)
        sd0, sd1 = model.state_dict(), m32.state_dict()
        assert all(torch.equal(sd0[k], sd1[k]) for k in sd0), f"{name}: reload differs"
        arch_prompts = prompts + ([long_prompt_ids(tokenizer)] if name in HYBRID_ARCHS else [])
        margin, spread, notes = write_reference(d32, arch_prompts, m32)
        if mtp is not None:
            write_mtp_reference(d32, m32, mtp, arch_prompts)
            notes.append("MTP module logits")
        summary.append((name, n_params, dir_size(d32), margin, spread, notes))

        if name == "mixtral":
            ds = out_root / "mixtral_sharded"
            save_checkpoint(model, tokenizer, ds, max_shard_size="320KB")
            n_shards = len(list(ds.glob("model-*.safetensors")))
            assert 2 <= n_shards <= 3 and (ds / "model.safetensors.index.json").exists(), n_shards
            ms = load(ds, torch.float32)
            assert all(torch.equal(sd0[k], v) for k, v in ms.state_dict().items())
            # Same weights, same outputs: an identical file (git stores it once).
            shutil.copyfile(d32 / "reference.safetensors", ds / "reference.safetensors")
            summary.append(("mixtral_sharded", n_params, dir_size(ds), margin, spread,
                            [f"{n_shards} shards"]))

        db = out_root / f"{name}_bf16"
        save_checkpoint(model.to(torch.bfloat16), tokenizer, db)
        if mtp is not None:
            add_mtp_layer(mtp, db, torch.bfloat16)
        mb = load(db, torch.bfloat16)
        mbf = load(db, torch.float32)  # the bf16 weights upcast, computed in f32
        _, spread_b, notes_b = write_reference(db, arch_prompts, mbf, bf16_model=mb)
        if mtp is not None:  # the bf16 module's weights upcast, computed in f32
            mtp_b = copy.deepcopy(mtp).to(torch.bfloat16).float()
            write_mtp_reference(db, mbf, mtp_b, arch_prompts, suffix="_f32compute")
        summary.append((f"{name}_bf16", n_params, dir_size(db), None, spread_b, notes_b))
        if name == "qwen3_5_moe":
            summary += make_qwen3_5_vl(out_root, tokenizer, m32, d32)
        if name == "deepseek_v3":
            summary += make_kimi_k25(out_root, tokenizer, m32, d32)
        if name == "llama4_text":
            summary += make_llama4_vl(out_root, tokenizer, m32, d32)

    if not only or "gpt_oss" in only:
        summary += make_gptoss(out_root, tokenizer, prompts)

    if write_md and not only:
        write_tensors_md(out_root, list(ARCHS) + ["gpt_oss", "gpt_oss_dense"])
    elif write_md:
        write_tensors_md(out_root, [a for a in ARCHS if a in only], merge=True)

    print()
    print(f"{'model':18s} {'params':>8s} {'bytes':>9s} {'min margin':>10s} {'min spread':>10s}  notes")
    for name, n, size, margin, spread, notes in summary:
        m = f"{margin:10.3f}" if margin is not None else f"{'-':>10s}"
        print(f"{name:18s} {n:8d} {size:9d} {m} {spread:10.2f}  {'; '.join(notes)}")
    total = sum(f.stat().st_size for f in out_root.rglob("*") if f.is_file())
    uniq = {}
    for f in out_root.rglob("*"):
        if f.is_file():
            uniq[hashlib.sha256(f.read_bytes()).hexdigest()] = f.stat().st_size
    print(f"\ntotal {total} bytes ({total / 2**20:.2f} MiB); distinct file contents "
          f"{sum(uniq.values()) / 2**20:.2f} MiB (what git stores)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="tinyshakespeare.txt")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="fixture root (default: %(default)s)")
    ap.add_argument("--check-determinism", action="store_true",
                    help="also build into a temporary folder and compare every file byte for byte")
    ap.add_argument("--only", nargs="*", help="rebuild only these architectures (e.g. glm4_moe): "
                    "no other folder is touched, and TENSORS.md keeps every other family's "
                    "section as it is (gpt_oss's is then not rewritten)")
    args = ap.parse_args()

    out_root = Path(args.out)
    targets = ([n for a in ARCHS for n in (a, f"{a}_bf16")]
               + ["mixtral_sharded", "qwen3_5_moe_vl", "kimi_k25", "kimi_k25_published",
                  "llama4_vl"]
               + GPTOSS_FOLDERS)
    if args.only:
        targets = [n for n in targets if any(n == a or n.startswith(a + "_") for a in args.only)]
    for n in targets:  # only the folders this script owns
        if (out_root / n).exists():
            shutil.rmtree(out_root / n)
    out_root.mkdir(parents=True, exist_ok=True)
    build(out_root, args.data, write_md=out_root.resolve() == DEFAULT_OUT.resolve(),
          only=args.only)

    if args.check_determinism:
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp), args.data, write_md=False, only=args.only)
            a, b = sha_tree(out_root), sha_tree(Path(tmp))
            a = {k: v for k, v in a.items() if k.split("/")[0] in targets}
            diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            if diff:
                print("NOT deterministic:", diff)
                return 1
            print(f"deterministic: {len(a)} files identical across two runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
