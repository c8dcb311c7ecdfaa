"""The `sim` generator backend: rollouts without model compute, for load and systems tests.

Tokens are drawn from one fixed distribution over `vocab_size` ids (Zipf-like, stop tokens
excluded), and each carries its exact log-prob under it at the request's temperature, so every
trajectory is valid for the codec and the learner. Output lengths are lognormal with a
configurable median and spread (σ = 1 is the heavy tail of reasoning rollouts) and are drawn up
front, so the stop decision is not part of any token's log-prob. Each request takes `token_s` per
token on the event loop's clock and requests do not slow each other (an engine with unbounded
batch room): the producer, Kafka and the learner are what is measured. `ToolLatency` makes
each environment step that continues an episode take `tool_s`, a stand-in for a tool call.

Weight swaps are exact per token: a load records when each version went live, and token i
of a request, sampled at `start + (i + 1) · token_s`, carries the version live at that moment.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from producers.envs.base import Episode, Step
from producers.generate.base import Generation, SamplingParams, check_request


@dataclass(kw_only=True)
class SimConfig:
    median_tokens: float = 64.0
    """Median output tokens per model turn (lognormal; capped by --max-tokens)."""
    sigma: float = 1.0
    """Lognormal spread of output lengths (log-space standard deviation)."""
    token_s: float = 0.002
    """Seconds per generated token of one request."""
    tool_s: float = 0.0
    """Seconds of each environment step that continues an episode (a simulated tool call)."""
    vocab_size: int = 64
    """Token ids are drawn from [0, vocab_size); must fit the learner's model."""


def output_length(rng: np.random.Generator, cfg: SimConfig, max_tokens: int) -> int:
    """One turn's length: lognormal(log median, sigma), rounded, in [1, max_tokens]."""
    return int(min(max(round(rng.lognormal(math.log(cfg.median_tokens), cfg.sigma)), 1), max_tokens))


def sim_logprobs(vocab_size: int, temperature: float, stop_token_ids: Sequence[int]) -> np.ndarray:
    """(V,) log-probs of the fixed distribution: log p_i ∝ −log(i + 2) / T, stop tokens removed."""
    logits = -np.log(np.arange(vocab_size) + 2.0) / temperature
    logits[[t for t in stop_token_ids if t < vocab_size]] = -np.inf
    return logits - np.logaddexp.reduce(logits[np.isfinite(logits)])


class SimGenerator:
    """Implements producers.generate.base.Generator with sampled lengths and timed tokens."""

    def __init__(self, cfg: SimConfig, *, seed: int = 0, version: int = 0):
        self.cfg = cfg
        self.vocab_size, self.context = cfg.vocab_size, None  # what a request's ids must fit
        self._rng = np.random.default_rng(seed)
        self._swaps: list[tuple[float, int]] = [(-math.inf, version)]  # (monotonic time live, version)
        self._lock = threading.Lock()  # loads come from the weights thread

    @property
    def version(self) -> int:
        return self._swaps[-1][1]

    def check_shapes(self, shapes) -> None:
        """No model: any state fits."""

    def load_weights(self, path: str, version: int) -> None:
        """No weights to read: record when `version` went live."""
        self.load_state({}, version)

    def load_state(self, tensors, version: int) -> None:
        """No weights to load: record when `version` went live."""
        with self._lock:
            if version < self.version:
                raise ValueError(f"version {version} is older than {self.version}")
            self._swaps.append((time.monotonic(), version))

    def _version_at(self, t: float) -> int:
        swaps = self._swaps
        return swaps[bisect.bisect_right(swaps, (t, math.inf)) - 1][1]

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        check_request(prompt_ids, self.vocab_size)
        rng = self._rng if params.seed is None else np.random.default_rng(params.seed)
        n = output_length(rng, self.cfg, params.max_tokens)
        logp = sim_logprobs(self.cfg.vocab_size, params.temperature, params.stop_token_ids)
        tokens = np.full(n, logp.argmax()) if params.greedy else rng.choice(self.cfg.vocab_size, size=n, p=np.exp(logp))
        start = time.monotonic()
        await asyncio.sleep(n * self.cfg.token_s)
        versions = [self._version_at(start + (i + 1) * self.cfg.token_s) for i in range(n)]
        return Generation(token_ids=tokens.astype(np.int32), logprobs=logp[tokens].astype(np.float32),
                          versions=np.array(versions, np.int32),
                          finish_reason="length" if n == params.max_tokens else "stop",
                          timing={"generate_s": time.monotonic() - start})


@dataclass
class ToolLatency:
    """An episode whose every continuing step also takes `tool_s` (the step runs off the loop)."""

    inner: Episode
    tool_s: float

    @property
    def prompt_ids(self) -> list[int]:
        return self.inner.prompt_ids

    @property
    def max_turns(self) -> int:
        return self.inner.max_turns

    def step(self, action_ids: list[int]) -> Step:
        step = self.inner.step(action_ids)
        if not step.done:
            time.sleep(self.tool_s)
        return step

    def close(self) -> None:
        if callable(getattr(self.inner, "close", None)):
            self.inner.close()
