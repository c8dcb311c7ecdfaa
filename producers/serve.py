"""`sao serve`: an OpenAI-compatible endpoint over the `hf` backend, for `--backend http` producers
and, as a rollout proxy, for external agents.

- `POST /v1/completions`: token ids in, token ids, log-probs and weight versions out (producers).
- `POST /v1/chat/completions`: chat messages and tools through the model's chat template, streamed
  (SSE) or not. With a session (`X-SAO-Session: new` or `"session": "new"`, then the receipt id
  that comes back in the header and the body's `session`), the turns of an external agent become
  one trajectory, assembled from the exact token ids sampled (producers/proxy.py).
- `POST /v1/sessions/{id}/close` with an optional `{"reward": number}`: publishes the session's
  trajectory to `sao.trajectories`, or without a reward to `sao.trajectories.pending`, where a
  reward sent later for the receipt on `sao.rewards` is joined by `sao reward-join`.
- `GET /health`, `GET /weight_info` (the live version), `GET /v1/models`.

The server follows `sao.weights` itself (same subscription as a producer) and may swap weights in
the middle of a request, hence per-token versions. Each request has its own thread (standard
library HTTP server) that submits to the hf backend's running batch and waits, so concurrent
requests share decode steps exactly as a producer's episodes in flight do.

Guards, all answered before any generation: a bearer token on every POST when `--serve-token` is
set (required beyond loopback: they decide what is trained); a body of at most 1 MiB + 64 bytes per
context position; a prompt plus max_tokens within the model's context window (400); at most
`--max-concurrent` generating requests (429 with Retry-After past it).
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from producers.api import (RequestError, assistant_reply, chat_chunk, chat_logprobs, chat_response,
                           check_context, completion_response, finish_reason, parse_chat, parse_request, streamable,
                           usage, version_spans)
from producers.envs.chat import Chat
from producers.generate.base import Generation, SamplingParams
from producers.generate.hf import HFGenerator
from producers.models import load_model
from producers.proxy import Sessions, kafka_publisher
from producers.weights import WeightSubscriber
from schemas import topics as T
from schemas.config import ConfigError, is_loopback
from schemas.kafka import KafkaConfig, ensure_topics, make_producer
from schemas.models import check_model
from schemas.process import stop_on_signals
from schemas.tokenizers import load_tokenizer

log = logging.getLogger(__name__)

_CLOSE = re.compile(r"/v1/sessions/([^/]+)/close")


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
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        check_model(self.model)
        if not self.serve_token and not is_loopback(self.host):
            raise ConfigError(f"--host {self.host} is beyond loopback: set --serve-token (SAO_SERVE_TOKEN)")
        if self.max_concurrent < 1 or self.max_sessions < 1 or self.session_idle_s <= 0:
            raise ConfigError("--max-concurrent and --max-sessions must be >= 1, --session-idle-s > 0")


def make_server(gen: HFGenerator, tokenizer, *, host: str = "127.0.0.1", port: int = 0,
                model_name: str = "default", max_tokens: int = 4096, token: str = "",
                max_concurrent: int = 64, sessions: Sessions | None = None) -> ThreadingHTTPServer:
    """The HTTP server (not yet serving); `server.server_address` has the bound port. Chat needs
    `sessions` (built on the model's chat template)."""
    vocab, context = gen.model.config.vocab_size, gen.model.config.max_position_embeddings
    max_body = (1 << 20) + 64 * context  # room for any prompt that fits, JSON-escaped
    slots = threading.BoundedSemaphore(max_concurrent)
    expected = f"Bearer {token}".encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _head(self, status: int, headers: dict) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()

        def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
            data = json.dumps(payload).encode()
            self._head(status, {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                **(headers or {})})
            self.wfile.write(data)

        def do_GET(self):
            routes = {"/health": lambda: {"status": "ok"},
                      "/weight_info": lambda: {"weight_version": gen.version},
                      "/v1/models": lambda: {"object": "list", "data": [{"id": model_name, "object": "model"}]}}
            route = routes.get(self.path)
            self._send(200, route()) if route else self._send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            close = _CLOSE.fullmatch(self.path)
            route = {"/v1/completions": self._completions, "/v1/chat/completions": self._chat}.get(self.path)
            if route is None and close is None:
                return self._send(404, {"error": {"message": "not found"}})
            try:
                body = self._body()
                if token and not hmac.compare_digest(self.headers.get("Authorization", "").encode(), expected):
                    raise RequestError("missing or wrong bearer token (Authorization: Bearer <--serve-token>)", 401)
                if close is not None:
                    return self._close(close.group(1), body)
                if not slots.acquire(blocking=False):
                    raise RequestError(f"{max_concurrent} requests are in flight (--max-concurrent); retry", 429)
                try:
                    route(body)
                finally:
                    slots.release()
            except RequestError as e:
                headers = {"Retry-After": "1"} if e.status == 429 else {}
                if e.status == 401:
                    headers["WWW-Authenticate"] = "Bearer"
                self._send(e.status, {"error": {"message": str(e), "type": "invalid_request_error", "code": e.status}},
                           headers)

        def _body(self) -> dict:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= max_body:
                self.close_connection = True  # the body is never read
                raise RequestError(f"request body of {length} bytes: must be at most {max_body} (1 MiB + 64 "
                                   f"bytes per position of the model's {context}-token context window)")
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except (ValueError, RecursionError) as e:  # also bad UTF-8, and nesting beyond Python's stack
                raise RequestError(f"body: not valid JSON ({type(e).__name__}: {e})") from None
            if not isinstance(body, dict):
                raise RequestError("body: expected a JSON object")
            return body

        def _generate(self, prompt: list[int], params: SamplingParams) -> Generation:
            try:
                return gen.submit(prompt, params).result()
            except Exception as e:  # answer 500 rather than drop the connection; the client retries
                log.exception("generation failed")
                raise RequestError(f"generation failed: {e}", 500) from e

        def _completions(self, body: dict) -> None:
            prompt, params = parse_request(body, max_tokens)
            check_context(len(prompt), params.max_tokens, context)
            if max(prompt) >= vocab:
                raise RequestError(f"prompt: token id {max(prompt)} outside the vocabulary ({vocab})")
            out = self._generate(prompt, params)
            text = tokenizer.decode(out.token_ids.tolist()) if tokenizer is not None else ""
            self._send(200, completion_response(out, prompt, model_name, text))

        def _chat(self, body: dict) -> None:
            if sessions is None:
                raise RequestError("chat: this model has no usable chat template (see the server's log); "
                                   "use /v1/completions")
            req = parse_chat(body, max_tokens, self.headers.get("X-SAO-Session"))
            s, prompt, params = sessions.begin(req.session, req.messages, req.tools, req.params, req.max_tokens,
                                               req.prompt_id)
            receipt = {"X-SAO-Session": s.id} if s.id else {}
            try:
                if req.stream:
                    return self._stream(req, s, prompt, params)
                out = self._generate(prompt, params)
                reply = assistant_reply(sessions.chat.decode(out.token_ids), req.parse_tools)
                # recorded before the answer goes out: the agent's next turn may follow at once
                sessions.finish(s, req.messages, prompt, out, reply)
            finally:
                sessions.release(s)
            self._send(200, chat_response(out, len(prompt), model_name, reply, session=s.id or None,
                                          logprobs=req.logprobs), receipt)

        def _stream(self, req, s, prompt: list[int], params: SamplingParams) -> None:
            """SSE: a chunk per decodable piece of text, the tool calls and finish reason last, then [DONE]."""
            head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": model_name, "session": s.id or None}
            self._head(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "close",
                             **({"X-SAO-Session": s.id} if s.id else {})})
            self.close_connection = True  # the stream ends when the connection does
            tokens: queue.SimpleQueue = queue.SimpleQueue()
            future = gen.submit(prompt, params, tokens.put)
            future.add_done_callback(lambda f: tokens.put(None))
            sampled, sent, text = [], 0, ""
            try:
                self._event(chat_chunk(head, {"role": "assistant", "content": ""}))
                while (t := tokens.get()) is not None:
                    sampled.append(t)
                    text = sessions.chat.decode(sampled)
                    n = streamable(text, req.parse_tools)
                    if n > sent:
                        self._event(chat_chunk(head, {"content": text[sent:n]}))
                        sent = n
                out: Generation = future.result()
            except OSError as e:  # the client is gone: its turn is not recorded
                future.cancel()
                log.info("stream ended by the client: %s", e)
                return
            except Exception as e:  # the generation failed after the 200 was sent
                log.exception("generation failed")
                return self._event({"error": {"message": f"generation failed: {e}", "code": 500}})
            reply = assistant_reply(text, req.parse_tools)
            sessions.finish(s, req.messages, prompt, out, reply)
            delta = {"content": reply["content"][sent:]} if reply["content"][sent:] else {}
            if reply.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(reply["tool_calls"])]
            self._event(chat_chunk(head, delta, finish_reason=finish_reason(out, reply),
                                   logprobs=chat_logprobs(out) if req.logprobs else None,
                                   token_ids=out.token_ids.tolist(), weight_versions=version_spans(out.versions)))
            if req.usage_chunk:
                self._event({**head, "choices": [], "usage": usage(len(prompt), out)})
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, payload: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        def _close(self, receipt: str, body: dict) -> None:
            if sessions is None:
                raise RequestError("sessions: this model has no usable chat template", 404)
            traj, topic = sessions.close(receipt, body.get("reward"))
            self._send(200, {"session": receipt, "trajectory_id": traj.id, "topic": topic, "reward": traj.reward,
                             "num_turns": traj.num_turns, "num_tokens": traj.num_tokens})

        def log_message(self, fmt, *args):
            log.debug("%s " + fmt, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


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
                         sessions=sessions)
    stop = stop_on_signals()
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    sub = None
    try:
        if cfg.follow_weights:
            sub = WeightSubscriber(cfg.kafka, gen).start()
        log.info("serving %s on http://%s:%d (weights version %d; bearer token %s)", cfg.model,
                 *server.server_address[:2], gen.version, "required" if cfg.serve_token else "not required")
        while not stop.wait(1.0):
            if sub is not None and sub.error is not None:
                raise RuntimeError("weights subscription died") from sub.error
    finally:
        server.shutdown()
        server.server_close()
        if sessions is not None:
            sessions.close_all()  # open sessions are published, truncated
        if sub is not None:
            sub.close()
        producer.flush(30)
