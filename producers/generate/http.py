"""The `http` generator backend: an OpenAI-compatible completions endpoint that takes token ids.

What `vllm serve` offers (docs/vllm.md §3.2) and `sao serve` implements: `prompt` as a list of ids,
`logprobs: 0` (the sampled token's log-prob), `return_token_ids`, `return_tokens_as_token_ids`,
every sampling field sent explicitly (so no server-side generation_config can change the
distribution), no truncation, no penalties. CPU sandbox producers scale apart from GPU inference.

Weight versions, per token, in order of preference:
1. `choices[0].weight_versions` in the response: spans `{"version", "start", "end"}` over output
   token indexes (vLLM main, `sao serve`) or one version per token;
2. the server's `GET /weight_info` (`weight_version`), read after the call;
3. the last version announced on `sao.weights` (`load_weights` records it; the server, not this
   process, owns the weights).
A log-prob ≤ -9999 is vLLM's clamp of -inf/NaN (docs/vllm.md §5): the call fails with
`InvalidGeneration` rather than publish a made-up number.

Calls go through one `httpx.AsyncClient` per event loop (its connection pool belongs to the loop
that opened it), so a producer's episodes in flight are concurrent requests over pooled
connections and the server batches them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Sequence

import httpx
import numpy as np

from producers.generate.base import Generation, SamplingParams, exact_sampling

log = logging.getLogger(__name__)

CLAMPED_LOGPROB = -9999.0


class InvalidGeneration(ValueError):
    """The server answered, but not with something a trajectory can carry."""


def request_body(prompt_ids: Sequence[int], params: SamplingParams, model: str) -> dict:
    """A completions request that samples from exactly `softmax(logits / T)` (docs/vllm.md §3.2)."""
    return {"model": model, "prompt": [int(t) for t in prompt_ids], **exact_sampling(params),
            "return_token_ids": True, "return_tokens_as_token_ids": True, "n": 1}


DEFAULT_LABEL = "default"
"""vLLM's weight-version label until one is set: the weights it started on, version 0 (the
learner's initial checkpoint), since it was started on that checkpoint or has not been updated."""


def as_version(v) -> int:
    """An int version from an int, "8", "v8", or vLLM's "default" (0)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if v == DEFAULT_LABEL:
        return 0
    m = re.fullmatch(r"\D*(\d+)", str(v))
    if m is None:
        raise InvalidGeneration(f"weight version {v!r} is not a number")
    return int(m.group(1))


def _span(s) -> tuple[int, int, object] | None:
    """(start, end, version) of a span: a JSON map, or vLLM's in-process `WeightVersionSpan`."""
    if isinstance(s, dict):
        return int(s["start"]), int(s["end"]), s["version"]
    if hasattr(s, "start") and hasattr(s, "end"):
        return int(s.start), int(s.end), s.version
    return None


def versions_from(spec, n: int) -> np.ndarray | None:
    """(n,) int32 versions from a `weight_versions` field (spans or per-token), or None."""
    if spec is None:
        return None
    spans = [_span(s) for s in spec]
    if len(spec) == n and all(s is None for s in spans):
        return np.array([as_version(v) for v in spec], dtype=np.int32)
    out = np.full(n, -1, dtype=np.int32)
    for span in spans:
        if span is None:
            raise InvalidGeneration(f"weight_versions {spec!r:.80} mix spans and per-token versions")
        start, end, version = span
        out[start:end] = as_version(version)
    if (out < 0).any():
        raise InvalidGeneration(f"weight_versions {spec!r} do not cover all {n} tokens")
    return out


def parse_choice(choice: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, str]:
    """token ids, log-probs, versions (or None) and finish reason of one completion choice."""
    lp = choice.get("logprobs") or {}
    if "token_ids" in choice:
        tokens = [int(t) for t in choice["token_ids"]]
    else:  # older servers: only the "token_id:N" strings of return_tokens_as_token_ids
        tokens = [int(s.split(":", 1)[1]) for s in lp.get("tokens", [])]
    logprobs = lp.get("token_logprobs")
    if logprobs is None or len(logprobs) != len(tokens):
        raise InvalidGeneration(f"{len(tokens)} tokens but log-probs {logprobs!r:.80}")
    for i, (t, x) in enumerate(zip(tokens, logprobs)):
        if x is None or not math.isfinite(x) or x <= CLAMPED_LOGPROB or x > 0:
            raise InvalidGeneration(f"token {i} (id {t}): log-prob {x} is not a valid probability "
                                    "(≤ -9999 is the server's clamp of -inf/NaN)")
    if "token_ids" in choice and lp.get("tokens") and lp["tokens"] != [f"token_id:{t}" for t in tokens]:
        raise InvalidGeneration("logprobs.tokens do not name the returned token_ids")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):  # e.g. "abort": a paused/aborted request, not an episode
        raise InvalidGeneration(f"finish_reason {finish!r}")
    versions = versions_from(choice.get("weight_versions"), len(tokens))
    return (np.array(tokens, dtype=np.int32), np.array(logprobs, dtype=np.float32), versions, finish)


STAGE_POLL_S = 0.02
"""How often a vLLM swap asks the workers whether the staging has finished (an ask waits for a decode step)."""


def rpc(client: httpx.Client, method: str) -> list:
    """Each worker's answer to `method` through vLLM's dev-mode /collective_rpc."""
    r = client.post("/collective_rpc", json={"method": method})
    r.raise_for_status()
    return r.json()["results"]


def swap_server(base_url: str, headers: dict, path: str, version: int) -> float:
    """The in-place swap of producers/generate/vllm.py `swap`, over vLLM's dev-mode HTTP endpoints
    (VLLM_SERVER_DEV_MODE=1); returns the seconds the server was paused. Resumed whatever failed."""
    with httpx.Client(base_url=base_url, headers=headers, timeout=300) as c:
        c.post("/collective_rpc", json={"method": "stage_file", "args": [path]}).raise_for_status()  # decoding on
        while not all(r["done"] for r in rpc(c, "staged")):
            time.sleep(STAGE_POLL_S)
        t0 = time.perf_counter()
        c.post("/pause", params={"mode": "keep", "clear_cache": "true"}).raise_for_status()
        try:
            c.post("/collective_rpc", json={"method": "apply_staged"}).raise_for_status()
            c.post("/reset_prefix_cache", params={"reset_running_requests": "true"}).raise_for_status()
            c.post("/update_weight_version", json={"new_version": str(version)}).raise_for_status()
        finally:
            c.post("/resume").raise_for_status()
        return time.perf_counter() - t0


class HttpGenerator:
    """Implements producers.generate.base.Generator against a completions server."""

    def __init__(self, base_url: str, *, model: str = "default", timeout_s: float = 600.0,
                 retries: int = 30, max_connections: int = 256, token: str = "", swaps: bool = False):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._timeout = timeout_s
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._announced = 0
        self._seen = 0
        self._weight_info = True  # until the server says it has no such endpoint
        self.swaps = swaps
        self.last_pause_s = float("nan")

    @property
    def client(self) -> httpx.AsyncClient:
        """The running loop's client."""
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            self._clients = {lp: c for lp, c in self._clients.items() if not lp.is_closed()}
            self._clients[loop] = httpx.AsyncClient(timeout=self._timeout, limits=self._limits,
                                                   headers=self._headers)
        return self._clients[loop]

    @property
    def version(self) -> int:
        return max(self._announced, self._seen)

    def load_weights(self, path: str, version: int) -> None:
        """Without `swaps` the server loads weights itself: remember the announced version as the
        fallback tag. With `swaps`, load the file into a `vllm serve` (its dev-mode endpoints, and
        producers.generate.vllm.WorkerExtension as its worker extension) in place: pause keeping
        the requests in flight, reload on every worker, re-prefill, label the version, resume; a
        server already on `version` or newer is left alone (several producers may follow one)."""
        if self.swaps and self._server_label() < version:
            self.last_pause_s = swap_server(self.base_url, self._headers, path, version)
        self._announced = max(self._announced, version)

    def _server_label(self) -> int:
        r = httpx.get(f"{self.base_url}/weight_info", headers=self._headers, timeout=30)
        r.raise_for_status()
        return as_version(r.json().get("weight_version", DEFAULT_LABEL))

    async def _post(self, body: dict) -> dict:
        """POST with bounded backoff on transport errors, 429 and 5xx; another 4xx raises InvalidGeneration
        (401/403: PermissionError, a misconfiguration every request would hit)."""
        for attempt in range(self.retries + 1):
            try:
                r = await self.client.post(f"{self.base_url}/v1/completions", json=body)
                if r.status_code in (401, 403):  # every request would be: stop, do not dead-letter them all
                    raise PermissionError(f"server refused the token ({r.status_code}): --serve-token "
                                          "(SAO_SERVE_TOKEN) must be the server's")
                if 400 <= r.status_code < 500 and r.status_code != 429:  # refused: the prompt goes to the DLQ
                    raise InvalidGeneration(f"server refused the request ({r.status_code}): {r.text[:300]}")
                if r.status_code < 400:
                    r.raise_for_status()
                    return r.json()
                err: Exception = httpx.HTTPStatusError(f"({r.status_code}) {r.text[:200]}", request=r.request,
                                                       response=r)
            except httpx.TransportError as e:
                err = e
            if attempt == self.retries:
                raise err
            log.warning("completions call failed (%s); retry %d/%d", err, attempt + 1, self.retries)
            await asyncio.sleep(min(0.2 * 2 ** attempt, 5.0))
        raise AssertionError("unreachable")

    async def _server_version(self) -> int | None:
        if not self._weight_info:
            return None
        r = await self.client.get(f"{self.base_url}/weight_info")
        if r.status_code == 404:
            self._weight_info = False
            return None
        r.raise_for_status()
        label = r.json().get("weight_version")  # vLLM: the label set by update_weight_version, or None
        return None if label is None else as_version(label)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        start = time.perf_counter()
        resp = await self._post(request_body(prompt_ids, params, self.model))
        tokens, logprobs, versions, finish = parse_choice(resp["choices"][0])
        if versions is None:
            server = await self._server_version()
            versions = np.full(len(tokens), self.version if server is None else server, np.int32)
        if len(versions):
            self._seen = max(self._seen, int(versions.max()))
        return Generation(token_ids=tokens, logprobs=logprobs, versions=versions, finish_reason=finish,
                          timing={"generate_s": time.perf_counter() - start})
