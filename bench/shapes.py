"""What the learner benchmarks train on: model shapes (random weights, nothing downloaded) and
synthetic trajectories shaped like real ones. Imports nothing Kafka-related, so GPU machines
without the broker's client can run `bench/gpu_learner.py`."""

from __future__ import annotations

import numpy as np
from transformers import LlamaConfig

from schemas.messages import Trajectory

SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                           max_position_embeddings=8192)
"""SmolLM2-135M's architecture (HuggingFaceTB/SmolLM2-135M config.json)."""
LLAMA_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                       max_position_embeddings=8192, rope_theta=500000.0)
"""Llama-3.2-1B's architecture (1.24B parameters)."""


def synthetic(n: int, length: int, vocab: int, seed: int = 0, spread: float = 0.0) -> list[Trajectory]:
    """Trajectories shaped like real ones (prompt, actions, one observation span) at version 0;
    lengths uniform in [(1 − spread)·length, length]."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = int(rng.integers(int(length * (1 - spread)), length + 1)) if spread else length
        prompt = size // 8
        mask = np.ones(size, np.uint8)
        mask[:prompt] = 0
        mask[size // 2: size // 2 + size // 16] = 0  # an observation span
        out.append(Trajectory(
            id=f"b{i}", prompt_id=f"p{i}", env="bench", producer_id="bench",
            tokens=rng.integers(0, vocab, size, dtype=np.int32), action_mask=mask,
            rollout_logprobs=np.where(mask == 1, -np.log(vocab) + rng.normal(0, 0.01, size), 0).astype(np.float32),
            versions=np.where(mask == 1, 0, -1).astype(np.int32), prompt_len=prompt,
            reward=float(rng.random())))
    return out
