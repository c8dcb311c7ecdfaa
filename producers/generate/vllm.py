"""The `vllm` generator backend: an in-process `AsyncLLM` engine (VLLM.md §1-§2).

NOT RUN in this repository's CI or on its development machine (no GPU, vLLM not installed); only
the pure helpers below are tested, against stand-ins for vLLM's own output objects and engine.
vLLM is imported lazily, inside `VLLMGenerator`, so nothing else pays for it.

Log-probs: the engine starts with `logprobs_mode="processed_logprobs"` and
`generation_config="vllm"`, and every request samples with no truncation or penalties and
`logprobs=0`, so the returned number is `log_softmax(logits / T)` of the sampled token, the
distribution actually sampled from (VLLM.md §1.3, pitfalls 1, 2, 7, 8).

Weight swaps (VLLM.md §2.3 variant (a)): `pause_generation(mode="keep", clear_cache=True)` →
`collective_rpc("load_safetensors", path)` on every worker (`WorkerExtension`) →
`reset_prefix_cache(reset_running_requests=True)` → `resume_generation()`, resumed in `finally`.
In-flight requests stay frozen, are re-prefilled under the new weights and continue. Per-token
versions come from `CompletionOutput.weight_versions` where the engine has it (vLLM main), else
from marks recorded at each resume: the number of tokens each in-flight request had streamed
when the new version went live. UNVERIFIED: whether every token sampled before a pause has been
streamed to us by the time we resume (we record marks after the load, to give it time).

A vLLM without `pause_generation(mode="keep")` is refused (TypeError) rather than fall back to the
default `mode="abort"`, which would abort every rollout in flight (VLLM.md pitfall 5).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np

from producers.generate.base import Generation, SamplingParams
from producers.generate.http import InvalidGeneration, versions_from


def sampling_kwargs(params: SamplingParams) -> dict:
    """Keyword arguments of `vllm.SamplingParams` for an exact-log-prob RL request."""
    kw = {"temperature": params.temperature, "top_p": params.top_p,
          "top_k": params.top_k if params.top_k > 0 else -1, "min_p": 0.0,
          "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
          "max_tokens": params.max_tokens, "logprobs": 0, "stop_token_ids": list(params.stop_token_ids),
          "skip_special_tokens": False, "detokenize": False}
    if params.seed is not None:
        kw["seed"] = params.seed
    return kw


def extract(output) -> tuple[np.ndarray, np.ndarray, list | None, str]:
    """Token ids, sampled-token log-probs, native `weight_versions` (or None) and finish reason of
    a finished `RequestOutput` (VLLM.md §1.1)."""
    c = output.outputs[0]
    tokens = [int(t) for t in c.token_ids]
    if c.logprobs is None or len(c.logprobs) != len(tokens):
        raise InvalidGeneration("no log-prob per token: the request must set logprobs=0")
    logprobs = [c.logprobs[i][t].logprob for i, t in enumerate(tokens)]
    for i, x in enumerate(logprobs):
        if not math.isfinite(x) or x > 0:
            raise InvalidGeneration(f"token {i}: log-prob {x}")
    if c.finish_reason not in ("stop", "length"):
        raise InvalidGeneration(f"finish_reason {c.finish_reason!r}")
    return (np.array(tokens, np.int32), np.array(logprobs, np.float32),
            getattr(c, "weight_versions", None), c.finish_reason)


def versions_from_marks(n: int, start_version: int, marks: Sequence[tuple[int, int]]) -> np.ndarray:
    """(n,) versions: `start_version`, then from each `(token index, version)` mark onwards that version."""
    out = np.full(n, start_version, np.int32)
    for index, version in marks:
        out[index:] = version
    return out


async def swap(engine, path: str, version: int, on_live: Callable[[], None] = lambda: None) -> None:
    """Pause (keep) → load on every worker → reset the prefix cache → label the version →
    `on_live()` → resume."""
    await engine.pause_generation(mode="keep", clear_cache=True)  # TypeError on a vLLM without keep
    try:
        await engine.collective_rpc("load_safetensors", args=(path,))
        try:
            await engine.reset_prefix_cache(reset_running_requests=True)
        except TypeError:  # older signature; there clear_cache is ignored in keep mode (VLLM.md §2.3)
            await engine.reset_prefix_cache()
        if hasattr(engine, "update_weight_version"):  # main: labels CompletionOutput.weight_versions
            await engine.update_weight_version(str(version))
        on_live()
    finally:
        await engine.resume_generation()  # never leave the engine paused


class WorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); called through `collective_rpc`."""

    def load_safetensors(self, path: str) -> int:
        import torch
        from safetensors.torch import load_file

        state = load_file(path, device=str(self.device))
        self.model_runner.model.load_weights(weights=list(state.items()))  # HF names; fuses, shards
        torch.cuda.synchronize()
        return len(state)


class VLLMGenerator:
    """Implements producers.generate.base.Generator over an `AsyncLLM` run on its own event loop
    (its own, not the producer's, so that `load_weights` from the weights thread can drive it)."""

    def __init__(self, model: str, *, seed: int = 0, **engine_args):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._version = 0
        self._inflight: dict[str, dict] = {}  # request id -> {"seen": tokens streamed, "marks": [...]}
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True).start()
        args = AsyncEngineArgs(model=model, seed=seed, logprobs_mode="processed_logprobs",
                               generation_config="vllm", enable_prefix_caching=True,
                               worker_extension_cls=f"{__name__}.WorkerExtension", **engine_args)

        async def start():
            return AsyncLLM.from_engine_args(args)

        self.engine = self._call(start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, path: str, version: int) -> None:
        if version < self._version:
            raise ValueError(f"version {version} is older than {self._version}")

        def mark():  # on the loop thread, while paused: later tokens are the new version's
            for req in self._inflight.values():
                req["marks"].append((req["seen"], version))
            self._version = version

        self._call(swap(self.engine, path, version, mark))

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        start = time.perf_counter()
        sp = VSamplingParams(**sampling_kwargs(params), output_kind=RequestOutputKind.CUMULATIVE)
        rid, start_version = uuid.uuid4().hex, self._version
        req = self._inflight[rid] = {"seen": 0, "marks": []}
        final = None
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, sp, rid):
                req["seen"], final = len(out.outputs[0].token_ids), out
        finally:
            del self._inflight[rid]
        tokens, logprobs, native, finish = extract(final)
        versions = (versions_from(native, len(tokens)) if native is not None
                    else versions_from_marks(len(tokens), start_version, req["marks"]))
        return Generation(token_ids=tokens, logprobs=logprobs, versions=versions, finish_reason=finish,
                          timing={"generate_s": time.perf_counter() - start})

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Runs on the engine's own loop (AsyncLLM batches every request in flight there); the
        caller's loop awaits it."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            self._generate([int(t) for t in prompt_ids], params), self._loop))
