"""The generator interface every backend (hf, vllm, http, sim) implements.

prompt token ids + sampling params → sampled token ids, their log-probs under the distribution
actually sampled from (`log_softmax(logits / T)` of the sampled token, after any truncation), and
the weight version that sampled each token. Weights may change between two decode steps of one
call; `versions` records where.

`generate` is a coroutine: a producer keeps many episodes in flight on one event loop, and every
backend serves concurrent calls together (vLLM's AsyncLLM natively, the http backend through an
async client, the hf backend by batching the decode steps of the calls in flight). `load_weights`
is a plain call, made from the weights thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    """Sampling temperature T; the learner recomputes log-probs at the same T."""
    max_tokens: int = 64
    """Most tokens generated in one call."""
    top_p: float = 1.0
    """Nucleus truncation; off (1.0) by default because the learner does not mirror it."""
    top_k: int = 0
    """Top-k truncation; off (0) by default for the same reason."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after emitting any of these (it is kept in the output)."""
    seed: int | None = None
    """Per-call sampling seed, for reproducible tests."""


@dataclass(kw_only=True)
class Generation:
    token_ids: np.ndarray  # (n,) int32
    logprobs: np.ndarray  # (n,) float32, of the distribution sampled from
    versions: np.ndarray  # (n,) int32, weight version that sampled each token
    finish_reason: str  # "stop" | "length"
    timing: dict[str, float] = field(default_factory=dict)


class ArchitectureMismatch(ValueError):
    """A weights file that is not this generator's model (other names or shapes): no later version
    will fit either, so the producer must stop rather than sample forever with stale weights."""


class Generator(Protocol):
    @property
    def version(self) -> int:
        """Weight version currently loaded (0 = the initial checkpoint)."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation: ...

    def load_weights(self, path: str, version: int) -> None:
        """Swap in a safetensors file of the policy's full state dict, between decode steps."""


def check_request(prompt_ids: Sequence[int], params: SamplingParams) -> None:
    """ValueError for a request no backend can serve with exact log-probs."""
    if params.temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {params.temperature}): the log-prob "
                         "contract needs a distribution")
    if not prompt_ids:
        raise ValueError("empty prompt")
