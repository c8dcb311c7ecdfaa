"""`sao reward serve`: `POST /rewards` (JSON) onto `sao.rewards`, for systems that do not speak Kafka.

A reward decides what the model learns, so the endpoint requires `Authorization: Bearer <token>`
(it refuses to start without a token when bound beyond loopback) and accepts rewards only for
trajectory ids it has seen on `sao.trajectories.pending` (read by a background consumer that waits
for the topic if it does not exist yet; a reward racing its trajectory, or arriving before the
reader reads, waits up to `--seen-wait` seconds). Body:
`{"trajectory_id": str, "reward": number, "token_index": int|null, "source": str, "criterion": str}`,
only the first two required. Answers: 202 once the broker has the reward; 400 naming the field for
malformed JSON, unknown fields, wrong types, non-finite numbers or a token_index outside [0, 2**31);
401 for a missing or wrong token; 404 for a trajectory id never seen pending; 503 if the broker did
not acknowledge in time; the other guards of schemas/http.py (411, 413, 415, 408) and its error
body. `GET /health` says whether the pending-id reader is reading; `GET /metrics` is Prometheus.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumers.rewards import RewardPublisher
from schemas import topics as T
from schemas.http import Guard, HttpConfig, RequestError, Server, check_exposure
from schemas.kafka import KafkaConfig, acknowledged, consumer_error, make_consumer
from schemas.messages import Reward, SchemaError
from schemas.process import stop_on_signals
from schemas.retry import transient

log = logging.getLogger(__name__)

MAX_BODY = 1 << 16
PUBLISH_TIMEOUT_S = 10.0
FIELDS = {"trajectory_id": str, "reward": (int, float), "token_index": (int, type(None)), "source": str,
          "criterion": str}
_GONE = {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC}  # the topic is not there (yet, or any more)


@dataclass(kw_only=True)
class RewardServeConfig:
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
    http: HttpConfig = field(default_factory=HttpConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        check_exposure(self.host, self.reward_token, "--reward-token")


class SeenIds:
    """Trajectory ids seen on the pending topic (message keys: no payload is decoded), most recent
    kept. The reader waits for the topic to exist, and goes back to waiting if it is deleted, so a
    server started before its topics reads them once they are created; an error no retry fixes
    ends it with `error` set (the service then exits)."""

    def __init__(self, kafka: KafkaConfig, limit: int):
        self.limit, self.topic = limit, kafka.topic(T.PENDING)
        self.reading = False  # partitions assigned
        self.error: BaseException | None = None
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # a group of its own: every endpoint instance must see every pending id
        self._consumer = make_consumer(kafka, f"{kafka.topic_prefix}.reward-serve-{uuid.uuid4().hex[:8]}")
        self._thread = threading.Thread(target=self._read, name="pending-ids", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                if self._topic_exists():
                    self._follow()
                self._stop.wait(0.5)
        except Exception as e:
            log.exception("the pending-id reader stopped")
            self.error = e

    def _topic_exists(self) -> bool:
        try:  # every topic's metadata: asking for one by name may create it on brokers that auto-create
            md = self._consumer.list_topics(timeout=5).topics.get(self.topic)
        except KafkaException as e:
            if not transient(e.args[0]):
                raise
            return False
        return md is not None and md.error is None and bool(md.partitions)

    def _follow(self) -> None:
        """Read the topic until it is gone (back to waiting for it) or the reader stops."""
        self._consumer.subscribe([self.topic], on_assign=self._assigned)
        try:
            while not self._stop.is_set():
                msg = self._consumer.poll(0.5)
                if msg is not None and msg.error() is not None and msg.error().code() in _GONE:
                    log.warning("%s is gone (%s); waiting for it", self.topic, msg.error().str())
                    return
                if msg is None or consumer_error(msg) or not msg.key():
                    continue
                with self._lock:
                    self._ids[msg.key().decode(errors="replace")] = None
                    while len(self._ids) > self.limit:
                        self._ids.popitem(last=False)
        finally:
            self.reading = False
            self._consumer.unsubscribe()

    def _assigned(self, consumer, partitions) -> None:
        self.reading = True

    async def wait_for(self, trajectory_id: str, timeout: float) -> bool:
        """Whether the id is seen within `timeout`. Polled, not signalled, from the event loop: the
        reader is a thread, and a reward racing its trajectory is the rare case."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if trajectory_id in self._ids:
                    return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._consumer.close()


def parse_reward(m: dict) -> Reward:
    """The reward in a request's JSON object; SchemaError naming the field at fault."""
    unknown = sorted(m.keys() - FIELDS.keys())
    if unknown:
        raise SchemaError(unknown[0], "unknown field")
    for name in ("trajectory_id", "reward"):
        if name not in m:
            raise SchemaError(name, "missing field")
    for name, value in m.items():
        if not isinstance(value, FIELDS[name]) or isinstance(value, bool):
            raise SchemaError(name, f"wrong type {type(value).__name__}")
    if m.get("token_index") is not None and not 0 <= m["token_index"] < 1 << 31:
        raise SchemaError("token_index", f"must be a token index in [0, 2**31), got {m['token_index']}")
    reward = Reward(**{"source": "http", **m})
    return Reward.decode(reward.encode())  # the codec's checks: finite reward, lengths


class RewardServer:
    """The HTTP server, its pending-id reader and its publisher; `serve_forever` until `close`."""

    def __init__(self, cfg: RewardServeConfig):
        self.cfg = cfg
        self.seen = SeenIds(cfg.kafka, cfg.max_seen)
        self.publisher = RewardPublisher(cfg.kafka)
        self.guard = Guard(token=cfg.reward_token, max_body=MAX_BODY, read_timeout_s=cfg.http.read_timeout_s)
        self._stop = threading.Event()
        # delivery callbacks are served here, so a request awaits its ack without holding a thread
        self._acks = threading.Thread(target=self._serve_acks, name="reward-acks", daemon=True)
        self._acks.start()
        self.httpd = Server([Route("/rewards", self.rewards, methods=["POST"]), Route("/health", self.health)],
                            metrics_prefix="sao_reward_serve", cfg=cfg.http, host=cfg.host, port=cfg.port)
        self.port = self.httpd.server_address[1]

    def _serve_acks(self) -> None:
        while not self._stop.is_set():
            self.publisher.producer.poll(0.1)

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "pending_ids": "reading" if self.seen.reading else "waiting"})

    async def rewards(self, request: Request) -> JSONResponse:
        body = await self.guard.body(request)
        try:
            reward = parse_reward(body)
        except SchemaError as e:
            raise RequestError(str(e), param=e.field) from None
        if not await self.seen.wait_for(reward.trajectory_id, self.cfg.seen_wait):
            raise RequestError(f"trajectory_id: {reward.trajectory_id!r} was never seen pending", 404,
                               reason="unknown_trajectory")
        error = await self._publish(reward)
        if error is not None:
            raise RequestError(f"the broker did not take the reward: {error}", 503, reason="broker")
        return JSONResponse({"trajectory_id": reward.trajectory_id, "status": "published"}, 202)

    async def _publish(self, reward: Reward):
        """None once the broker has `reward`, else why not (its error, or a timeout)."""
        acked = acknowledged(self.publisher.producer, self.publisher.topic, reward.encode(), reward.key)
        try:  # settled by the acks thread
            return await asyncio.wait_for(acked, PUBLISH_TIMEOUT_S)
        except TimeoutError:
            return f"no acknowledgement within {PUBLISH_TIMEOUT_S:g} s"

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.seen.close()
        self._stop.set()
        self._acks.join()
        self.publisher.producer.flush(10)


def run(cfg: RewardServeConfig) -> None:
    server = RewardServer(cfg)
    log.info("reward endpoint on http://%s:%d/rewards (token %s)", cfg.host, server.port,
             "required" if cfg.reward_token else "not required: loopback only")

    def check() -> None:
        if server.seen.error is not None:
            raise RuntimeError("the pending-id reader stopped") from server.seen.error

    try:
        server.httpd.serve_until(stop_on_signals(), check)  # returns within --http.shutdown-s of SIGTERM
    finally:
        server.close()
