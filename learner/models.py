"""Tiny random-initialised causal LMs built from transformers configs in code, for tests and
benchmarks: one Llama-style dense model and one Qwen3-MoE model. Nothing is downloaded.

Seeding forks the global RNG, so building a model neither depends on nor disturbs it.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM


def tiny_llama(*, vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int = 2, max_positions: int = 256,
               seed: int = 0) -> LlamaForCausalLM:
    """A dense Llama with grouped-query attention, random weights from `seed`."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=max_positions, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def tiny_qwen3_moe(*, vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, num_experts: int = 4,
                   experts_per_token: int = 2, max_positions: int = 256,
                   seed: int = 0) -> Qwen3MoeForCausalLM:
    """A Qwen3-MoE (q/k norms, top-k routed experts in every layer), random weights from `seed`."""
    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                            intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size,
                            num_hidden_layers=num_layers, num_attention_heads=num_heads,
                            num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
                            num_experts=num_experts, num_experts_per_tok=experts_per_token,
                            decoder_sparse_step=1, max_position_embeddings=max_positions,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None,
                            attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(config)


TINY_MODELS = {"llama": tiny_llama, "qwen3_moe": tiny_qwen3_moe}
