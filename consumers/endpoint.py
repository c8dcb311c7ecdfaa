"""`sao reward serve`: `POST /rewards` (JSON) onto `sao.rewards`, for systems that do not speak Kafka.

A reward decides what the model learns, so the endpoint requires `Authorization: Bearer <token>`
(it refuses to start without a token when bound beyond loopback) and accepts rewards only for
trajectory ids it has seen on `sao.trajectories.pending` (read by a background consumer; a reward
racing its trajectory waits up to `--seen-wait` seconds). Body:
`{"trajectory_id": str, "reward": number, "token_index": int|null, "source": str, "criterion": str}`,
only the first two required. Answers: 202 once the broker has the reward; 400 with the reason for
malformed JSON, unknown fields, wrong types or non-finite numbers; 401 for a missing or wrong token;
404 for a trajectory id never seen pending; 503 if the broker did not acknowledge in time.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from consumers.rewards import RewardPublisher
from schemas import topics as T
from schemas.config import ConfigError, is_loopback
from schemas.kafka import KafkaConfig, consumer_error, make_consumer
from schemas.messages import Reward, SchemaError
from schemas.process import stop_on_signals

log = logging.getLogger(__name__)

MAX_BODY = 1 << 16
FIELDS = {"trajectory_id": str, "reward": (int, float), "token_index": (int, type(None)), "source": str,
          "criterion": str}


@dataclass(kw_only=True)
class ServeConfig:
    host: str = "127.0.0.1"
    """Address to bind; anything beyond loopback needs `--reward-token`."""
    port: int = 8089
    """Port to bind (0 picks a free one)."""
    reward_token: str = ""
    """Bearer token clients must send (`SAO_REWARD_TOKEN`); empty allows none, on loopback only."""
    seen_wait: float = 2.0
    """Seconds a reward for a trajectory id not seen yet waits for it to show up on the pending topic."""
    max_seen: int = 1_000_000
    """Most trajectory ids remembered (the oldest are forgotten first)."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        if not self.reward_token and not is_loopback(self.host):
            raise ConfigError(f"--host {self.host} is beyond loopback: set --reward-token (SAO_REWARD_TOKEN)")


class SeenIds:
    """Trajectory ids seen on the pending topic (message keys: no payload is decoded), most recent kept."""

    def __init__(self, kafka: KafkaConfig, limit: int):
        self.limit = limit
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._changed = threading.Condition()
        self._stop = threading.Event()
        # a group of its own: every endpoint instance must see every pending id
        self._consumer = make_consumer(kafka, f"{kafka.topic_prefix}.reward-serve-{uuid.uuid4().hex[:8]}")
        self._consumer.subscribe([kafka.topic(T.PENDING)])
        self._thread = threading.Thread(target=self._read, name="pending-ids", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.poll(0.5)
            if msg is None or consumer_error(msg) or not msg.key():
                continue
            with self._changed:
                self._ids[msg.key().decode(errors="replace")] = None
                while len(self._ids) > self.limit:
                    self._ids.popitem(last=False)
                self._changed.notify_all()

    def wait_for(self, trajectory_id: str, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: trajectory_id in self._ids, timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._consumer.close()


def parse_reward(body: bytes) -> Reward:
    """The reward in a request body; SchemaError naming the field at fault."""
    def no_constants(name):
        raise SchemaError("<body>", f"{name} is not a number JSON allows")
    try:
        m = json.loads(body, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise SchemaError("<body>", f"not valid JSON ({e})") from None
    if not isinstance(m, dict):
        raise SchemaError("<body>", "expected a JSON object")
    unknown = sorted(m.keys() - FIELDS.keys())
    if unknown:
        raise SchemaError(unknown[0], "unknown field")
    for name in ("trajectory_id", "reward"):
        if name not in m:
            raise SchemaError(name, "missing field")
    for name, value in m.items():
        if not isinstance(value, FIELDS[name]) or isinstance(value, bool):
            raise SchemaError(name, f"wrong type {type(value).__name__}")
    reward = Reward(**{"source": "http", **m})
    return Reward.decode(reward.encode())  # the codec's checks: finite reward, index >= 0, lengths


class RewardServer:
    """The HTTP server, its pending-id reader and its publisher; `serve_forever` until `close`."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.seen = SeenIds(cfg.kafka, cfg.max_seen)
        self.publisher = RewardPublisher(cfg.kafka)
        self.httpd = ThreadingHTTPServer((cfg.host, cfg.port), self._handler())
        self.port = self.httpd.server_address[1]

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                code, body = server.handle(self.path, self.headers, self.rfile)
                self.send_response(code)
                if code == 401:
                    self.send_header("WWW-Authenticate", "Bearer")
                data = json.dumps(body).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt, *args):
                log.debug("%s " + fmt, self.address_string(), *args)

        return Handler

    def handle(self, path: str, headers, rfile) -> tuple[int, dict]:
        if path != "/rewards":
            return 404, {"error": f"no such endpoint {path}; POST /rewards"}
        token = self.cfg.reward_token
        given = headers.get("Authorization", "")
        if token and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return 401, {"error": "missing or wrong bearer token"}
        n = int(headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            return 413, {"error": f"body larger than {MAX_BODY} bytes"}
        try:
            reward = parse_reward(rfile.read(n))
        except SchemaError as e:
            return 400, {"error": str(e)}
        if not self.seen.wait_for(reward.trajectory_id, self.cfg.seen_wait):
            return 404, {"error": f"trajectory {reward.trajectory_id!r} was never seen pending"}
        delivered = threading.Event()
        errors = []
        self.publisher.send(reward, on_delivery=lambda err, msg: (errors.append(err), delivered.set()))
        self.publisher.producer.flush(10)
        if not delivered.is_set() or errors[0] is not None:
            return 503, {"error": f"the broker did not take the reward: {errors[0] if errors else 'timeout'}"}
        return 202, {"trajectory_id": reward.trajectory_id, "status": "published"}

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.seen.close()
        self.publisher.producer.flush(10)


def run(cfg: ServeConfig) -> None:
    server = RewardServer(cfg)
    stop = stop_on_signals()
    threading.Thread(target=lambda: (stop.wait(), server.httpd.shutdown()), daemon=True).start()
    log.info("reward endpoint on http://%s:%d/rewards (token %s)", cfg.host, server.port,
             "required" if cfg.reward_token else "not required: loopback only")
    try:
        server.serve_forever()
    finally:
        server.close()
