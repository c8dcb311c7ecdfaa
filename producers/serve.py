"""`sao serve`: an OpenAI-compatible completions endpoint over the `hf` backend, for `--backend http`.

It speaks the subset of `vllm serve`'s `POST /v1/completions` that producers use (VLLM.md §3.2):
a token-id `prompt`, `logprobs: 0`, `return_token_ids`, explicit sampling fields. Each choice
also carries `weight_versions`, spans `{version, start, end}` over its output tokens, because the
server follows `sao.weights` itself (same subscription as a producer) and may swap weights in the
middle of a request. `GET /weight_info` reports the live version, `GET /health` answers 200.

Requests that would sample from anything but `softmax(logits / T)` (penalties, min_p, logit
bias, logprobs > 0, n > 1, streaming) are refused with 400 rather than silently served: the
returned log-probs must be those of the distribution actually sampled from. Each request has its
own thread (standard library HTTP server) that submits to the hf backend's running batch and
waits, so concurrent requests share decode steps exactly as a producer's episodes in flight do.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from producers.generate.base import Generation, SamplingParams
from producers.generate.hf import HFGenerator
from producers.models import load_model
from schemas.tokenizers import load_tokenizer
from producers.weights import WeightSubscriber
from schemas import topics as T
from schemas.kafka import KafkaConfig, ensure_topics
from schemas.models import check_model
from schemas.process import stop_on_signals

log = logging.getLogger(__name__)

_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}
_UNSUPPORTED = ("logit_bias", "bad_words", "allowed_token_ids", "min_tokens", "stop", "echo",
                "guided_json", "guided_regex", "guided_choice", "structured_outputs", "prompt_logprobs")


@dataclass(kw_only=True)
class ServeConfig:
    model: str = "tiny-llama-bytes"
    """Policy: smollm2 | tiny-llama | tiny-llama-bytes | a local HF directory."""
    seed: int = 0
    """Seed of tiny random models and of sampling."""
    device: str = "cpu"
    """torch device of the model."""
    host: str = "127.0.0.1"
    """Address to bind; the endpoint has no authentication, keep it on a trusted network."""
    port: int = 8000
    """Port to bind (0 picks a free one and logs it)."""
    max_tokens: int = 4096
    """Largest max_tokens a request may ask for."""
    follow_weights: bool = True
    """Subscribe to sao.weights and swap in new versions."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        check_model(self.model)


class BadRequest(ValueError):
    pass


def parse_request(body: dict, max_tokens: int = 4096) -> tuple[list[int], SamplingParams]:
    """Prompt ids and sampling params of a completions request; BadRequest names the bad field."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of one
    if not (isinstance(prompt, list) and prompt and
            all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        raise BadRequest("prompt: expected a non-empty list of token ids (text prompts are not served)")
    if body.get("n", 1) != 1 or body.get("stream"):
        raise BadRequest("n/stream: only n=1 without streaming is served")
    if body.get("logprobs") not in (None, 0):
        raise BadRequest("logprobs: only 0 (the sampled token's log-prob) is served")
    for name, neutral in _NEUTRAL.items():
        if body.get(name, neutral) != neutral:
            raise BadRequest(f"{name}: must be {neutral}; it would change the sampled distribution")
    for name in _UNSUPPORTED:
        if body.get(name):
            raise BadRequest(f"{name}: not supported")
    temperature, top_p, top_k = body.get("temperature", 1.0), body.get("top_p", 1.0), body.get("top_k", -1)
    n_tokens, stop = body.get("max_tokens", 16), body.get("stop_token_ids") or []
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise BadRequest("temperature: must be > 0 (log-probs need a distribution)")
    if not isinstance(n_tokens, int) or not 1 <= n_tokens <= max_tokens:
        raise BadRequest(f"max_tokens: must be an integer in [1, {max_tokens}]")
    if not isinstance(top_k, int) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise BadRequest("top_k/top_p: top_k an integer (-1 or 0: off), top_p in (0, 1]")
    if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
        raise BadRequest("stop_token_ids: expected a list of token ids")
    seed = body.get("seed")
    return prompt, SamplingParams(temperature=float(temperature), max_tokens=n_tokens,
                                  top_p=float(top_p), top_k=max(top_k, 0), stop_token_ids=tuple(stop),
                                  seed=seed if isinstance(seed, int) else None)


def version_spans(versions: np.ndarray) -> list[dict]:
    """[{version, start, end}] runs of equal versions over output-token indexes."""
    spans = []
    for i, v in enumerate(versions.tolist()):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def completion_response(out: Generation, prompt_ids: list[int], model: str, text: str) -> dict:
    tokens, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
    names = [f"token_id:{t}" for t in tokens]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt_ids) + len(tokens)},
            "choices": [{"index": 0, "text": text, "finish_reason": out.finish_reason,
                         "stop_reason": tokens[-1] if out.finish_reason == "stop" else None,
                         "token_ids": tokens, "prompt_token_ids": prompt_ids,
                         "logprobs": {"tokens": names, "token_logprobs": logprobs,
                                      "top_logprobs": [{n: x} for n, x in zip(names, logprobs)],
                                      "text_offset": []},
                         "weight_versions": version_spans(out.versions)}]}


def make_server(gen: HFGenerator, tokenizer, *, host: str = "127.0.0.1", port: int = 0,
                model_name: str = "default", max_tokens: int = 4096) -> ThreadingHTTPServer:
    """The HTTP server (not yet serving); `server.server_address` has the bound port."""
    vocab = gen.model.config.vocab_size

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            routes = {"/health": lambda: {"status": "ok"},
                      "/weight_info": lambda: {"weight_version": gen.version},
                      "/v1/models": lambda: {"object": "list", "data": [{"id": model_name, "object": "model"}]}}
            route = routes.get(self.path)
            self._send(200, route()) if route else self._send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            if self.path != "/v1/completions":
                return self._send(404, {"error": {"message": "not found"}})
            try:
                length = int(self.headers.get("Content-Length", 0))
                if length > 64 << 20:
                    raise BadRequest("body larger than 64 MiB")
                body = json.loads(self.rfile.read(length) or b"null")
                prompt, params = parse_request(body if isinstance(body, dict) else {}, max_tokens)
                if max(prompt) >= vocab:
                    raise BadRequest(f"prompt: token id {max(prompt)} outside the vocabulary ({vocab})")
            except (BadRequest, ValueError) as e:  # json errors are ValueErrors
                return self._send(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
            try:
                out = gen.submit(prompt, params).result()
            except Exception as e:  # answer 500 rather than drop the connection; the client retries
                log.exception("generation failed")
                return self._send(500, {"error": {"message": f"generation failed: {e}"}})
            text = tokenizer.decode(out.token_ids.tolist()) if tokenizer is not None else ""
            self._send(200, completion_response(out, prompt, model_name, text))

        def log_message(self, fmt, *args):
            log.debug("%s " + fmt, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def run(cfg: ServeConfig) -> None:
    gen = HFGenerator(load_model(cfg.model, seed=cfg.seed, device=cfg.device), seed=cfg.seed)
    server = make_server(gen, load_tokenizer(cfg.model), host=cfg.host, port=cfg.port,
                         model_name=cfg.model, max_tokens=cfg.max_tokens)
    stop = stop_on_signals()
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    sub = None
    try:
        if cfg.follow_weights:
            ensure_topics(cfg.kafka, [T.WEIGHTS])
            sub = WeightSubscriber(cfg.kafka, gen).start()
        log.info("serving %s on http://%s:%d (weights version %d)", cfg.model,
                 *server.server_address[:2], gen.version)
        while not stop.wait(1.0):
            if sub is not None and sub.error is not None:
                raise RuntimeError("weights subscription died") from sub.error
    finally:
        server.shutdown()
        server.server_close()
        if sub is not None:
            sub.close()
