"""`sao serve`: an OpenAI-compatible endpoint over the `hf` backend, for `--backend http` producers
and, as a rollout proxy, for external agents.

- `POST /v1/completions`: token ids in, token ids, log-probs and weight versions out (producers).
- `POST /v1/chat/completions`: chat messages and tools through the model's chat template, streamed
  (SSE) or not. With a session (`X-SAO-Session: new` or `"session": "new"`, then the receipt id
  that comes back in the header and the body's `session`), the turns of an external agent become
  one trajectory, assembled from the exact token ids sampled (producers/serve/proxy.py).
- `POST /v1/sessions/{id}/close` with an optional `{"reward": number}`: publishes the session's
  trajectory to `sao.trajectories`, or without a reward to `sao.trajectories.pending`, where a
  reward sent later for the receipt on `sao.rewards` is joined by `sao reward-join`.
- `GET /health`, `GET /weight_info` (the live version), `GET /v1/models`, `GET /metrics` (Prometheus,
  with each weight update's fetch, load and engine-pause seconds: producers/metrics.py).

The server follows `sao.weights` itself (same subscription as a producer) and may swap weights in
the middle of a request, hence per-token versions. It runs on uvicorn (schemas/http.py): each
request is a coroutine that submits to the hf backend's running batch and awaits it, holding no
thread, so concurrent requests share decode steps exactly as a producer's episodes in flight do.

Guards, all answered before any generation, each refusal a 4xx naming the field: those of
schemas/http.py (a bearer token on every POST when `--serve-token` is set, required beyond
loopback since they decide what is trained, checked before the body is read; a body of at most
1 MiB + 64 bytes per context position; JSON only, bounded; slow clients timed out); sampling
params that `SamplingParams` accepts and that leave the distribution `softmax(logits / T)`
(producers/serve/api.py); a prompt plus max_tokens within the model's context window (400); at most
`--max-concurrent` generating requests (429 with Retry-After past it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from producers.serve.api import (RequestError, assistant_reply, chat_chunk, chat_logprobs, chat_response,
                           check_context, completion_response, finish_reason, parse_chat, parse_request, streamable,
                           usage, version_spans)
from producers.envs.chat import Chat
from producers.generate.base import Generation, SamplingParams
from producers.generate.hf import HFGenerator
from producers.metrics import weight_update_gauges
from producers.models import load_model
from producers.serve.proxy import Sessions, kafka_publisher
from schemas import topics as T
from schemas.config import ConfigError
from schemas.http import Guard, HttpConfig, Server, check_exposure
from schemas.kafka import KafkaConfig, ensure_topics, make_producer
from schemas.models import check_model
from schemas.process import stop_on_signals, threadsafe
from schemas.tokenizers import load_tokenizer
from schemas.weights.follow import FollowConfig, WeightSubscriber

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServeConfig:
    model: str = "tiny-llama-bytes"
    """Policy: smollm2 | tiny-llama | tiny-llama-bytes | a local HF directory."""
    seed: int = 0
    """Seed of tiny random models and of sampling."""
    device: str = "cpu"
    """torch device of the model."""
    host: str = "127.0.0.1"
    """Address to bind; anything beyond loopback needs `--serve-token`."""
    port: int = 8000
    """Port to bind (0 picks a free one and logs it)."""
    serve_token: str = ""
    """Bearer token every POST must carry (`SAO_SERVE_TOKEN`); empty allows none, on loopback only."""
    max_tokens: int = 4096
    """Largest max_tokens a request may ask for."""
    max_concurrent: int = 64
    """Most requests generating at once; past it the answer is 429 with Retry-After."""
    session_idle_s: float = 600.0
    """Seconds a rollout-proxy session may stay idle before it is published, truncated, to pending."""
    max_sessions: int = 1024
    """Most rollout-proxy sessions open at once; opening one more is answered 429."""
    sessions_dir: str = ""
    """Folder where open rollout-proxy sessions are written after each turn, so a restarted
    `sao serve` (SIGKILL included) takes them up; one folder per server. "": in memory only
    (published truncated on SIGTERM, lost on SIGKILL)."""
    producer_id: str = ""
    """`producer_id` of the proxy's trajectories ("" → serve-<hostname>)."""
    follow_weights: bool = True
    """Subscribe to sao.weights and swap in new versions."""
    weights: FollowConfig = field(default_factory=FollowConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        check_model(self.model)
        check_exposure(self.host, self.serve_token, "--serve-token")
        if self.max_concurrent < 1 or self.max_sessions < 1 or self.session_idle_s <= 0:
            raise ConfigError("--max-concurrent and --max-sessions must be >= 1, --session-idle-s > 0")


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class _Stream(StreamingResponse):
    """Server-sent events that run `cleanup` however they end (done, the client gone, shutdown),
    even if their iterator never started."""

    def __init__(self, events, cleanup: Callable[[], None], headers: dict):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cleanup()


class Api:
    """The routes of `sao serve` over one hf generator. Handlers run on uvicorn's event loop and
    await the engine thread, so `in_flight` needs no lock. Chat needs `sessions` (built on the
    model's chat template)."""

    def __init__(self, gen: HFGenerator, tokenizer, *, model_name: str, max_tokens: int, token: str,
                 max_concurrent: int, sessions: Sessions | None, read_timeout_s: float):
        self.gen, self.tokenizer, self.sessions = gen, tokenizer, sessions
        self.model_name, self.max_tokens, self.max_concurrent = model_name, max_tokens, max_concurrent
        self.vocab, self.context = gen.model.config.vocab_size, gen.model.config.max_position_embeddings
        self.guard = Guard(token=token, max_body=(1 << 20) + 64 * self.context, read_timeout_s=read_timeout_s,
                           limit_note=f" (1 MiB + 64 bytes per position of the model's {self.context}-token "
                                      "context window, room for any prompt that fits, JSON-escaped)")
        self.in_flight = 0

    def routes(self) -> list[Route]:
        return [Route("/health", self.health), Route("/weight_info", self.weight_info), Route("/v1/models", self.models),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/sessions/{receipt}/close", self.close, methods=["POST"])]

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def weight_info(self, request: Request) -> JSONResponse:
        return JSONResponse({"weight_version": self.gen.version})

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    def _enter(self, held: contextlib.ExitStack) -> None:
        """Count a generating request in until `held` closes; 429 past --max-concurrent."""
        if self.in_flight >= self.max_concurrent:
            raise RequestError(f"{self.max_concurrent} requests are in flight (--max-concurrent); retry", 429,
                               reason="busy")
        self.in_flight += 1
        held.callback(self._leave)

    def _leave(self) -> None:
        self.in_flight -= 1

    async def _generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        try:
            return await asyncio.wrap_future(self.gen.submit(prompt, params))
        except Exception as e:  # answer 500 rather than drop the connection; the client retries
            log.exception("generation failed")
            raise RequestError(f"generation failed: {e}", 500, reason="generation") from e

    async def completions(self, request: Request) -> JSONResponse:
        prompt, params = parse_request(await self.guard.body(request), self.max_tokens)
        check_context(len(prompt), params.max_tokens, self.context)
        if max(prompt) >= self.vocab:
            raise RequestError(f"prompt: token id {max(prompt)} outside the vocabulary ({self.vocab})")
        with contextlib.ExitStack() as held:
            self._enter(held)
            out = await self._generate(prompt, params)
        text = self.tokenizer.decode(out.token_ids.tolist()) if self.tokenizer is not None else ""
        return JSONResponse(completion_response(out, prompt, self.model_name, text))

    async def chat(self, request: Request):
        body = await self.guard.body(request)
        if self.sessions is None:
            raise RequestError("chat: this model has no usable chat template (see the server's log); "
                               "use /v1/completions")
        req = parse_chat(body, self.max_tokens, request.headers.get("X-SAO-Session"))
        with contextlib.ExitStack() as held:
            self._enter(held)
            s, prompt, params = self.sessions.begin(req.session, req.messages, req.tools, req.params, req.max_tokens,
                                                    req.prompt_id)
            held.callback(self.sessions.release, s)
            receipt = {"X-SAO-Session": s.id} if s.id else {}
            if req.stream:  # the slot and the session stay held until the stream ends
                return _Stream(self._events(req, s, prompt, params), held.pop_all().close, receipt)
            out = await self._generate(prompt, params)
            reply = assistant_reply(self.sessions.chat.decode(out.token_ids), req.parse_tools)
            # recorded before the answer goes out: the agent's next turn may follow at once
            self.sessions.finish(s, req.messages, prompt, out, reply)
        return JSONResponse(chat_response(out, len(prompt), self.model_name, reply, session=s.id or None,
                                          logprobs=req.logprobs), headers=receipt)

    async def _events(self, req, s, prompt: list[int], params: SamplingParams):
        """SSE: a chunk per decodable piece of text, the tool calls and finish reason last, then
        [DONE]. Tokens come from the engine thread through a queue on this loop."""
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model_name, "session": s.id or None}
        tokens: asyncio.Queue = asyncio.Queue()
        put = threadsafe(asyncio.get_running_loop(), tokens.put_nowait)  # the engine thread's callback
        future = self.gen.submit(prompt, params, put)
        future.add_done_callback(lambda f: put(None))
        sampled, sent, text = [], 0, ""
        try:
            yield _event(chat_chunk(head, {"role": "assistant", "content": ""}))
            while (t := await tokens.get()) is not None:
                sampled.append(t)
                text = self.sessions.chat.decode(sampled)
                n = streamable(text, req.parse_tools)
                if n > sent:
                    yield _event(chat_chunk(head, {"content": text[sent:n]}))
                    sent = n
            out: Generation = future.result()
        except Exception as e:  # the generation failed after the 200 was sent
            log.exception("generation failed")
            yield _event({"error": {"message": f"generation failed: {e}", "code": 500}})
            return
        finally:
            future.cancel()  # the client is gone (its turn is not recorded), or a no-op once done
        reply = assistant_reply(text, req.parse_tools)
        self.sessions.finish(s, req.messages, prompt, out, reply)
        delta = {"content": reply["content"][sent:]} if reply["content"][sent:] else {}
        if reply.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(reply["tool_calls"])]
        yield _event(chat_chunk(head, delta, finish_reason=finish_reason(out, reply),
                                logprobs=chat_logprobs(out) if req.logprobs else None,
                                token_ids=out.token_ids.tolist(), weight_versions=version_spans(out.versions)))
        if req.usage_chunk:
            yield _event({**head, "choices": [], "usage": usage(len(prompt), out)})
        yield b"data: [DONE]\n\n"

    async def close(self, request: Request) -> JSONResponse:
        body = await self.guard.body(request)
        if self.sessions is None:
            raise RequestError("sessions: this model has no usable chat template", 404)
        receipt = request.path_params["receipt"]
        # off the event loop: publishing waits for the broker's acknowledgement
        traj, topic = await asyncio.to_thread(self.sessions.close, receipt, body.get("reward"))
        return JSONResponse({"session": receipt, "trajectory_id": traj.id, "topic": topic, "reward": traj.reward,
                             "num_turns": traj.num_turns, "num_tokens": traj.num_tokens})


def make_server(gen: HFGenerator, tokenizer, *, host: str = "127.0.0.1", port: int = 0,
                model_name: str = "default", max_tokens: int = 4096, token: str = "",
                max_concurrent: int = 64, sessions: Sessions | None = None,
                http: HttpConfig | None = None) -> Server:
    """The HTTP server (not yet serving); `server.server_address` has the bound port."""
    http = http or HttpConfig()
    api = Api(gen, tokenizer, model_name=model_name, max_tokens=max_tokens, token=token,
              max_concurrent=max_concurrent, sessions=sessions, read_timeout_s=http.read_timeout_s)
    return Server(api.routes(), metrics_prefix="sao_serve", cfg=http, host=host, port=port)


def chat_template(tokenizer) -> Chat | None:
    """The chat endpoint's template; None (completions only) for a model without a tokenizer, without
    a chat template, or with one whose turns cannot be appended to the ids already sampled."""
    if tokenizer is None:
        return None
    try:
        return Chat(tokenizer)
    except ValueError as e:  # transformers' "no chat_template", or Chat's prefix-stability check
        log.warning("no /v1/chat/completions for this model: %s", e)
        return None


def run(cfg: ServeConfig) -> None:
    gen = HFGenerator(load_model(cfg.model, seed=cfg.seed, device=cfg.device), seed=cfg.seed)
    tokenizer = load_tokenizer(cfg.model)
    ensure_topics(cfg.kafka, [T.TRAJECTORIES, T.PENDING] + ([T.WEIGHTS] if cfg.follow_weights else []))
    producer = make_producer(cfg.kafka)
    chat = chat_template(tokenizer)
    sessions = None if chat is None else Sessions(
        chat, kafka_publisher(producer, cfg.kafka), context=gen.model.config.max_position_embeddings,
        idle_s=cfg.session_idle_s, max_open=cfg.max_sessions, producer_id=cfg.producer_id or f"serve-{socket.gethostname()}",
        journal=Path(cfg.sessions_dir) if cfg.sessions_dir else None)
    server = make_server(gen, tokenizer, host=cfg.host, port=cfg.port, model_name=cfg.model,
                         max_tokens=cfg.max_tokens, token=cfg.serve_token, max_concurrent=cfg.max_concurrent,
                         sessions=sessions, http=cfg.http)
    sub = WeightSubscriber(cfg.kafka, gen, follow=cfg.weights).start() if cfg.follow_weights else None
    if sub is not None:
        weight_update_gauges(server.metrics.registry, "sao_serve", sub)

    def check() -> None:
        if sub is not None and sub.error is not None:
            raise RuntimeError("weights subscription died") from sub.error

    try:
        log.info("serving %s on http://%s:%d (weights version %d; bearer token %s)", cfg.model,
                 *server.server_address[:2], gen.version, "required" if cfg.serve_token else "not required")
        server.serve_until(stop_on_signals(), check)  # returns within --http.shutdown-s of SIGTERM
    finally:
        if sessions is not None:
            sessions.close_all()  # open sessions are published, truncated
        if sub is not None:
            sub.close()
        producer.flush(30)
