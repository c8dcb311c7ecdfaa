"""The `hf` generator backend: a transformers causal LM in-process, CPU or CUDA.

Decoding runs one token per model forward over a `DynamicCache` (no `model.generate`), so weights
can change between any two tokens. Each decode step holds `_step_lock`; `load_weights` reads and
checks the file without it, queues the swap, and the swap happens at the next step boundary, by
whichever thread gets the lock first. Every token records the version that sampled it. The KV
cache built under the old weights is kept across a swap, as asynchronous engines do.

Log-probs are `log_softmax(logits / T)` of the sampled token in float32, after top-k / top-p
truncation when enabled (then of the renormalised truncated distribution).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from producers.generate.base import Generation, SamplingParams


def truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the top_k largest logits (0 = all), then the smallest most-likely set whose
    probability reaches top_p (1.0 = all); the rest become −inf. logits: (V,)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, -torch.inf))
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 rng: torch.Generator) -> tuple[int, float]:
    """a ~ softmax(truncate(logits / T)); returns a and log_softmax(truncate(logits / T))[a]."""
    logp = torch.log_softmax(truncate(logits.float() / params.temperature, params.top_k,
                                      params.top_p), dim=-1)
    token = int(torch.multinomial(logp.exp(), 1, generator=rng))
    return token, float(logp[token])


class HFGenerator:
    """Implements producers.generate.base.Generator over a transformers causal LM."""

    def __init__(self, model: torch.nn.Module, *, version: int = 0, seed: int = 0):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self._version = version
        self._step_lock = threading.Lock()  # held for one decode step, or one weight swap
        self._pending_lock = threading.Lock()  # guards _pending only; never waits on a step
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._rng = torch.Generator(device=self.device).manual_seed(seed)

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, path: str, version: int) -> None:
        """Queue a safetensors state dict as `version`; returns once it is live. Raises
        ValueError, keeping the old weights, on an older version or a mismatching file."""
        state = load_file(path, device=str(self.device))
        expected = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in state.items()}
        if got != expected:
            diff = sorted(set(got.items()) ^ set(expected.items()))[:3]
            raise ValueError(f"{path}: state dict does not match the model, e.g. {diff}")
        with self._pending_lock:
            newest = max(self._version, self._pending[1] if self._pending else -1)
            if version < newest:
                raise ValueError(f"version {version} is older than {newest}")
            self._pending = (state, version)
        with self._step_lock:  # the next step boundary; a decoding thread may get there first
            self._apply_pending()

    def _apply_pending(self) -> None:
        """Swap in a queued state dict; the caller holds `_step_lock`."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            state, version = pending
            self.model.load_state_dict(state, strict=True)
            self._version = version

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if params.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {params.temperature}): the log-prob "
                             "contract needs a distribution")
        if not prompt_ids:
            raise ValueError("empty prompt")
        rng = self._rng if params.seed is None else torch.Generator(self.device).manual_seed(params.seed)
        cache = DynamicCache(config=self.model.config)
        step_input = torch.tensor([list(prompt_ids)], device=self.device)  # the prefill, then 1 token
        tokens, logprobs, versions, finish = [], [], [], "length"
        start = time.perf_counter()
        for _ in range(params.max_tokens):
            with self._step_lock, torch.inference_mode():
                self._apply_pending()
                logits = self.model(input_ids=step_input, past_key_values=cache,
                                    use_cache=True).logits[0, -1]
                token, logp = sample_token(logits, params, rng)
                versions.append(self._version)
            tokens.append(token)
            logprobs.append(logp)
            if token in params.stop_token_ids:
                finish = "stop"
                break
            step_input = torch.tensor([[token]], device=self.device)
        return Generation(token_ids=np.array(tokens, dtype=np.int32),
                          logprobs=np.array(logprobs, dtype=np.float32),
                          versions=np.array(versions, dtype=np.int32), finish_reason=finish,
                          timing={"generate_s": time.perf_counter() - start})
