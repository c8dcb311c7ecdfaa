"""The generator interface every backend (hf, vllm, http, sim) implements.

prompt token ids + sampling params → sampled token ids, their log-probs under the distribution
actually sampled from (`log_softmax(logits / T)` of the sampled token, after any truncation), and
the weight version that sampled each token. Weights may change between two decode steps of one
call; `versions` records where.

`generate` is a coroutine: a producer keeps many episodes in flight on one event loop, and every
backend serves concurrent calls together (vLLM's AsyncLLM natively, the http backend through an
async client, the hf backend by batching the decode steps of the calls in flight). Loading weights
(`load_state`, `load_weights`) is a plain call, made from the weights thread.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

# Bounds every backend can sample within and still return the log-probs of softmax(logits / T):
# below MIN_TEMPERATURE, logits / T overflows float32 for ordinary logits (and vLLM switches to
# greedy sampling, which has no such distribution); above MAX_TEMPERATURE it is uniform in all but name.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 100.0
MAX_SEED = (1 << 63) - 1  # torch and vLLM seed with a signed 64-bit integer
MAX_TOKENS = 1 << 20


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What one generate call samples with; constructing one out of range raises ValueError naming
    the field, so every boundary (the HTTP API, a producer's flags, a plug-in) refuses it alike."""

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
    greedy: bool = False
    """Take the most likely token at every step (evaluation, `sao eval`): nothing is sampled, so
    such an episode is never trained on and its log-probs are not a sampling distribution's."""

    def __post_init__(self):
        t = self.temperature
        if not (isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t)
                and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise ValueError(f"temperature: must be a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
                             f"(log-probs need a distribution), got {t!r}")
        if not (_integer(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS):
            raise ValueError(f"max_tokens: must be an integer in [1, {MAX_TOKENS}], got {self.max_tokens!r}")
        if not (isinstance(self.top_p, numbers.Real) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not (_integer(self.top_k) and 0 <= self.top_k < 1 << 31):
            raise ValueError(f"top_k: must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not all(_integer(t) and 0 <= t < 1 << 31 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: must be token ids (integers >= 0)")
        if self.seed is not None and not (_integer(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed: must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if not isinstance(self.greedy, bool):
            raise ValueError(f"greedy: must be true or false, got {self.greedy!r}")


NEUTRAL_SAMPLING = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
"""vLLM's settings that reshape the distribution, each at its no-op value: with them, the engine
samples from exactly softmax(logits / T), truncated only by top-p / top-k, which is what the
learner recomputes (docs/vllm.md §3.2)."""


def exact_sampling(params: SamplingParams) -> dict:
    """vLLM's sampling settings for an exact-log-prob RL request: the same names in its
    completions API (the http backend, `vllm serve`) and its `SamplingParams` (the in-process
    backend), so the one rule serves both."""
    kw = {"temperature": 0.0 if params.greedy else params.temperature, "top_p": params.top_p,  # 0: vLLM's greedy
          "top_k": params.top_k if params.top_k > 0 else -1,  # vLLM's off is -1, ours 0
          **NEUTRAL_SAMPLING, "max_tokens": params.max_tokens, "logprobs": 0,
          "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False}
    if params.seed is not None:
        kw["seed"] = params.seed
    return kw


@dataclass(kw_only=True)
class Generation:
    token_ids: np.ndarray  # (n,) int32
    logprobs: np.ndarray  # (n,) float32, of the distribution sampled from
    versions: np.ndarray  # (n,) int32, weight version that sampled each token
    finish_reason: str  # "stop" | "length"
    timing: dict[str, float] = field(default_factory=dict)


class Generator(Protocol):
    """A sampling engine. Its weights follow the learner through the weight protocol: the
    in-process backends (hf, vllm, sim) are `schemas.weights.engine.Engine`s, loaded in memory;
    the http backend is a `RemoteEngine`, whose server reads the learner's store itself."""

    @property
    def version(self) -> int:
        """Weight version currently loaded (0 = the initial checkpoint)."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation: ...


def check_request(prompt_ids: Sequence[int], vocab_size: int | None = None) -> None:
    """ValueError for a prompt no backend can serve: empty, or ids that are not integers in
    [0, vocab_size). Checked per request, before it joins a batch, so it fails alone."""
    if not len(prompt_ids):
        raise ValueError("prompt: empty")
    if not all(_integer(t) and 0 <= t < (vocab_size or 1 << 31) for t in prompt_ids):
        bad = next(t for t in prompt_ids if not (_integer(t) and 0 <= t < (vocab_size or 1 << 31)))
        raise ValueError(f"prompt: token id {bad!r} is not in [0, {vocab_size or 1 << 31})")
