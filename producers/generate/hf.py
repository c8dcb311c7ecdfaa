"""The `hf` generator backend: a transformers causal LM in-process, CPU or CUDA, with dynamic batching.

One engine thread decodes every request in flight as one batch, one token per model forward (no
`model.generate`). Requests join and leave the running batch between decode steps: a joining
request is prefilled alone, then its KV cache is left-padded to the batch's length and stacked
onto it; a finished request's row is dropped. Padding is masked out of attention and every row
gets its own position ids, so a row's logits are those of its own sequence alone (the property
the importance ratio depends on, tested against a full forward). On CPU, where a forward of
B rows costs far less than B forwards, throughput rises with the number of requests in flight.

Weights may change between any two decode steps: each step holds `_step_lock`; `load_state`
checks the tensors without it (`load_weights` reads a file first), queues the swap, and the swap
happens at the next step boundary, in place (`load_state_dict` copies into the live parameters).
What the engine is paused for is that copy alone (`last_pause_s`), not the read. Every token
records the version that sampled it. The KV cache built under the old weights is kept across a
swap, as asynchronous engines do.

Log-probs are `log_softmax(logits / T)` of the sampled token in float32, after top-k / top-p
truncation when enabled (then of the renormalised truncated distribution).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from producers.generate.base import Generation, SamplingParams, check_request
from schemas.weights.engine import ArchitectureMismatch


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
    """a ~ softmax(truncate(logits / T)), or its most likely token when `params.greedy`; returns a
    and log_softmax(truncate(logits / T))[a]."""
    logp = torch.log_softmax(truncate(logits.float() / params.temperature, params.top_k,
                                      params.top_p), dim=-1)
    token = int(logp.argmax()) if params.greedy else int(torch.multinomial(logp.exp(), 1, generator=rng))
    return token, float(logp[token])


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    rng: torch.Generator
    future: Future
    on_token: Callable[[int], None] | None = None  # called in the engine thread: keep it cheap
    start: float = field(default_factory=time.perf_counter)
    cached: int = 0  # tokens of this sequence in the KV cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def sample(self, logits: torch.Tensor, version: int) -> bool:
        """Sample the next token from (V,) logits; True when the request is finished."""
        token, logp = sample_token(logits, self.params, self.rng)
        self.tokens.append(token)
        self.logprobs.append(logp)
        self.versions.append(version)
        if self.on_token is not None:
            self.on_token(token)
        return token in self.params.stop_token_ids or len(self.tokens) >= self.params.max_tokens

    def fail(self, error: BaseException) -> None:
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)

    def finish(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # its episode was cancelled (partition revoked, shutdown)
        stopped = self.tokens[-1] in self.params.stop_token_ids
        self.future.set_result(Generation(
            token_ids=np.array(self.tokens, np.int32), logprobs=np.array(self.logprobs, np.float32),
            versions=np.array(self.versions, np.int32), finish_reason="stop" if stopped else "length",
            timing={"generate_s": time.perf_counter() - self.start}))


class HFGenerator:
    """Implements producers.generate.base.Generator over a transformers causal LM."""

    def __init__(self, model: torch.nn.Module, *, version: int = 0, seed: int = 0, max_batch: int = 64):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        # what a request's ids and length must fit (the producer bounds its env's results by them)
        self.vocab_size = model.config.vocab_size
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.max_batch = max_batch
        self._version = version
        self.last_pause_s = float("nan")  # decoding stopped for the last swap
        self._step_lock = threading.Lock()  # held for one engine step, or one weight swap
        self._pending_lock = threading.Lock()  # guards _pending only; never waits on a step
        self._pending: tuple[Mapping[str, torch.Tensor], int] | None = None
        self._rng = torch.Generator(device=self.device).manual_seed(seed)
        self._waiting: list[_Request] = []
        self._wake = threading.Condition()
        self._rows: list[_Request] = []  # the running batch, one row each
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, (B, H, P, D) left-padded
        self._closed = False
        self._thread = threading.Thread(target=self._engine, name="hf-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    def load_state(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Queue a full state dict as `version` (schemas.weights.engine.Engine); returns once it is
        live. Raises, keeping the old weights, on an older version or another model's tensors."""
        self.check_shapes({k: tuple(v.shape) for k, v in tensors.items()})
        with self._pending_lock:
            newest = max(self._version, self._pending[1] if self._pending else -1)
            if version < newest:
                raise ValueError(f"version {version} is older than {newest}")
            self._pending = (tensors, version)
        with self._step_lock:  # the next step boundary; the engine may get there first
            self._apply_pending()

    def load_weights(self, path: str, version: int) -> None:
        """`load_state` of a safetensors file."""
        self.load_state(load_file(path, device=str(self.device)), version)

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise ArchitectureMismatch unless these are this model's tensor names and shapes."""
        expected = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        if dict(shapes) != expected:
            diff = sorted(set(shapes.items()) ^ set(expected.items()))[:3]
            raise ArchitectureMismatch(f"the state dict does not match the model, e.g. {diff}")

    def _apply_pending(self) -> None:
        """Swap in a queued state dict; the caller holds `_step_lock`."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            state, version = pending
            t0 = time.perf_counter()
            self.model.load_state_dict(state, strict=True)  # names and shapes checked before queuing
            self._version, self.last_pause_s = version, time.perf_counter() - t0

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               on_token: Callable[[int], None] | None = None) -> Future:
        """Queue a request for the running batch; the future resolves to its Generation.
        `on_token(id)` sees each token as it is sampled (streaming), from the engine thread."""
        check_request(prompt_ids, self.vocab_size)  # a bad id fails here, not its batch
        rng = self._rng if params.seed is None else torch.Generator(self.device).manual_seed(params.seed)
        req = _Request([int(t) for t in prompt_ids], params, rng, Future(), on_token)
        with self._wake:
            self._waiting.append(req)
            self._wake.notify()
        return req.future

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return await asyncio.wrap_future(self.submit(prompt_ids, params))

    def close(self) -> None:
        """Stop the engine after its current step (requests still waiting are never answered)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _engine(self) -> None:
        while True:
            with self._wake:
                while not (self._waiting or self._rows or self._closed):
                    self._wake.wait()
                if self._closed:
                    return
                room = self.max_batch - len(self._rows)
                joining, self._waiting = self._waiting[:room], self._waiting[room:]
            with self._step_lock, torch.inference_mode():
                try:
                    self._apply_pending()
                    self._step(joining)
                except Exception as e:  # a batched forward failed: its requests fail, the engine lives on
                    for req in [*joining, *self._rows]:
                        req.fail(e)
                    self._rows, self._kv = [], []

    def _step(self, joining: list[_Request]) -> None:
        """Prefill the joining requests, then one decode step of the whole batch."""
        by_length: dict[int, list[_Request]] = {}
        for req in joining:
            if not req.future.cancelled():
                by_length.setdefault(len(req.prompt_ids), []).append(req)
        for group in by_length.values():
            self._prefill_apart(group)
        self._keep([r for r in self._rows if not r.future.cancelled()])
        if not self._rows:
            return
        pads = [self._kv[0][0].shape[2] - r.cached for r in self._rows]
        mask = torch.ones(len(self._rows), self._kv[0][0].shape[2] + 1, dtype=torch.long, device=self.device)
        for i, pad in enumerate(pads):
            mask[i, :pad] = 0  # left padding of rows shorter than the batch
        out = self.model(input_ids=torch.tensor([[r.tokens[-1]] for r in self._rows], device=self.device),
                         attention_mask=mask,
                         position_ids=torch.tensor([[r.cached] for r in self._rows], device=self.device),
                         past_key_values=DynamicCache(self._kv), use_cache=True)
        self._kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        logits = out.logits[:, -1]  # (B, V)
        finished = []
        for i, req in enumerate(self._rows):
            req.cached += 1
            if _sampled(req, logits[i], self._version):
                finished.append(req)
        for req in finished:
            if not req.future.done():
                req.finish()
        self._keep([r for r in self._rows if r not in finished])

    def _prefill_apart(self, group: list[_Request]) -> None:
        """`_prefill`, and if the group's forward fails, each request alone: a request that
        fails by itself fails alone, the others of its group go on."""
        try:
            self._prefill(group)
        except Exception as e:
            if len(group) == 1:
                group[0].fail(ValueError(f"prefill failed for this request: {type(e).__name__}: {e}"))
                return
            for req in group:
                self._prefill_apart([req])

    def _prefill(self, group: list[_Request]) -> None:
        """Run prompts of one length together (no padding: each row exactly as alone), sample their
        first tokens, and stack the caches of those not finished onto the batch."""
        out = self.model(input_ids=torch.tensor([r.prompt_ids for r in group], device=self.device),
                         past_key_values=DynamicCache(config=self.model.config), use_cache=True)
        going = []
        for i, req in enumerate(group):
            req.cached = len(req.prompt_ids)
            if not _sampled(req, out.logits[i, -1], self._version):
                going.append(i)
            elif not req.future.done():
                req.finish()
        if not going:
            return
        index = torch.tensor(going, device=self.device)
        new = [(layer.keys.index_select(0, index), layer.values.index_select(0, index))
               for layer in out.past_key_values.layers]  # (G, H, L, D)
        rows = [group[i] for i in going]
        if not self._rows:
            self._rows, self._kv = rows, new
            return
        width = max(self._kv[0][0].shape[2], rows[0].cached)
        self._kv = [(torch.cat([_left_pad(k, width), _left_pad(nk, width)]),
                     torch.cat([_left_pad(v, width), _left_pad(nv, width)]))
                    for (k, v), (nk, nv) in zip(self._kv, new)]  # a copy of the batch's cache
        self._rows += rows

    def _keep(self, rows: list[_Request]) -> None:
        """Narrow the batch to `rows` (a subset, in order) and drop padding no row needs."""
        if len(rows) == len(self._rows):
            return
        if not rows:
            self._rows, self._kv = [], []
            return
        index = torch.tensor([self._rows.index(r) for r in rows], device=self.device)
        trim = self._kv[0][0].shape[2] - max(r.cached for r in rows)
        self._kv = [(k.index_select(0, index)[:, :, trim:], v.index_select(0, index)[:, :, trim:])
                    for k, v in self._kv]
        self._rows = rows


def _sampled(req: _Request, logits: torch.Tensor, version: int) -> bool:
    """`req.sample`, True (leave the batch) when finished or when sampling failed for this request
    alone (non-finite logits of its row): that request fails, the rest of the batch does not."""
    try:
        return req.sample(logits, version)
    except Exception as e:  # a ValueError: the request's own fault, not the engine's
        req.fail(ValueError(f"sampling failed for this request: {type(e).__name__}: {e}"))
        return True


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, L, D) → (B, H, width, D) with zeros in front (masked out of attention)."""
    return torch.nn.functional.pad(x, (0, 0, width - x.shape[2], 0))
