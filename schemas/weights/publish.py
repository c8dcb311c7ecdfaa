"""Weight publication off the training thread: snapshot, then anchors and deltas in the background.

The training thread only snapshots the policy (gathered a bucket at a time, copied to the host in
the published dtype: `snapshot`) and hands it to the `Publisher`, whose own thread encodes it
(schemas/weights/payload.py: an anchor, or a delta against the version it published last), writes it to
the weight store or puts it inline, announces it on `sao.weights`, and, with the collective
transport, broadcasts it to the engines linked to this learner (schemas/weights/collective.py). At most
one publication is in flight and one queued; a newer snapshot supersedes the queued one (versions
only increase, so a producer never misses anything it could still use). An anchor is published
at start, every `--weights.anchor-every` versions, and on request: `request_anchor`, which
`AnchorRequests` calls for every producer asking on `sao.weights.requests` (one that cannot reach
the newest version from what it holds); asks that come before a publication make one anchor.

Crash safety: a payload file is durable before its announcement, and version numbers continue
past both the store's newest file and the newest announcement (`newest_announced`), so a delta
written but never announced is never the base of anything.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from confluent_kafka import TopicPartition

from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, consumer_error, make_consumer
from schemas.messages import AnchorRequest, SchemaError, Weights
from schemas.retry import retrying
from schemas.signing import load_signer
from schemas.weights import payload as W
from schemas.weights.store import WeightStore

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(kw_only=True)
class WeightsConfig:
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the policy is published in, on every device (float32: producers sample the learner's
    exact weights, at twice the bytes and with dense deltas)."""
    anchor_every: int = 20
    """A full anchor every this many versions (and at start); deltas against the previous version between."""
    inline_bytes: int = 8 << 20
    """Updates up to this size travel inside the announcement on sao.weights (no shared volume
    needed); larger ones are files in --weights-dir."""
    bucket_mb: int = 256
    """MiB gathered at a time when snapshotting the policy (host memory above the snapshot itself),
    and staged on the GPU at a time when broadcasting it over NCCL."""
    transport: Literal["files", "collective"] = "files"
    """collective: also broadcast every update to the engines linked to this learner over
    torch.distributed, Kafka still carrying the announcement."""
    collective_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """collective: the links' backend; auto is NCCL where the learner trains on CUDA, gloo otherwise."""
    collective_port: int = 29700
    """collective: the TCP port rank 0 listens on for engines (`--weights.collective-addr` of the
    producers and `sao serve`)."""
    collective_timeout_s: float = 30.0
    """collective: an engine that has not taken a bucket of an update within this many seconds is
    dropped from the broadcast (it catches up from anchors and deltas and links again)."""
    signing_key: str = ""
    """Ed25519 private key (PEM, `sao keys`) that signs every announcement, so that followers
    trusting its public key load only this learner's weights; empty: announcements go unsigned."""

    def __post_init__(self):
        for name in ("anchor_every", "bucket_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--weights.{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.inline_bytes < 0 or self.inline_bytes > T.MAX_MESSAGE_BYTES >> 1:
            raise ConfigError(f"--weights.inline-bytes must be in [0, {T.MAX_MESSAGE_BYTES >> 1}] (half "
                              f"the largest message sao.weights takes), got {self.inline_bytes}")
        if self.collective_timeout_s <= 0:
            raise ConfigError("--weights.collective-timeout-s must be > 0")
        self.signer = load_signer(Path(self.signing_key)) if self.signing_key else None  # a bad key: at start


class Publisher:
    """Encodes, stores or inlines, announces and broadcasts snapshots on its own thread.

    `submit` never blocks on I/O; `wait` returns once everything submitted is announced. A failed
    publication stops the thread and is raised by the next `submit` or `wait` (a learner whose
    producers no longer follow it must not train on silently). `last` holds the figures of the
    last publication; `superseded` counts snapshots replaced before their turn."""

    def __init__(self, cfg: WeightsConfig, store: WeightStore, announce: Callable[[Weights], None],
                 links=None, extra: dict | None = None):
        self.cfg, self.store, self.announce, self.links, self.extra = cfg, store, announce, links, extra or {}
        self.superseded, self.anchor_requests, self.last = 0, 0, {}
        self.error: BaseException | None = None
        self._queued: tuple | None = None
        self._busy = self._closed = False
        self._anchor_due = True
        self._prev: W.State | None = None
        self._prev_version = self._anchor_version = -1
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="weights-publisher", daemon=True)
        self._thread.start()

    def submit(self, state: W.State, version: int, step: int) -> None:
        self._raise()
        with self._cond:
            self.superseded += self._queued is not None
            self._queued = (state, version, step)
            self._cond.notify_all()

    def request_anchor(self) -> None:
        """Make the next publication an anchor (a fresh start of the chain for every producer)."""
        with self._cond:
            self._anchor_due = True
            self.anchor_requests += 1

    def wait(self) -> None:
        with self._cond:
            while (self._queued is not None or self._busy) and self.error is None:
                self._cond.wait()
        self._raise()

    def close(self) -> None:
        """Stop after the publication in flight; a queued one is dropped (`wait` first to keep it)."""
        with self._cond:
            self._closed, self._queued = True, None
            self._cond.notify_all()
        self._thread.join()
        if self.links is not None:
            self.links.close()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError("weight publication failed") from self.error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._queued is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, self._queued, self._busy = self._queued, None, True
            try:
                self._publish(*job)
            except BaseException as e:  # re-raised in the training thread
                log.exception("weight publication failed")
                self.error = e
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            if self.error is not None:
                return

    def _publish(self, state: W.State, version: int, step: int) -> None:
        t0 = time.perf_counter()
        with self._cond:
            anchor = (self._anchor_due or self._prev is None
                      or version - self._anchor_version >= self.cfg.anchor_every)
            self._anchor_due &= not anchor
        if anchor:
            payload, result = W.anchor(state, self.extra), state
        else:
            payload, result = W.delta(state, self._prev, self._prev_version, self.extra)
        digest, encoded = W.digest(result), time.perf_counter()
        inline = payload.num_bytes <= self.cfg.inline_bytes
        uri = "" if inline else self.store.save(version, payload).resolve().as_uri()
        w = Weights(version=version, step=step, base=payload.base, digest=digest,
                    num_bytes=payload.num_bytes, uri=uri, payload=payload.to_bytes() if inline else b"",
                    store=self.store.root.resolve().as_uri(), dtype=self.cfg.dtype)
        if self.cfg.signer is not None:
            w = self.cfg.signer.sign(w)
        written = time.perf_counter()
        self.announce(w)
        announced = time.perf_counter()
        linked = self.links.broadcast(version, result) if self.links is not None else []
        self._prev, self._prev_version = result, version
        if anchor:
            self._anchor_version = version
        full = sum(t.bits.nbytes for t in result.values())
        self.last = {"weights/published_version": version, "weights/anchor": int(anchor),
                     "weights/inline": int(inline), "weights/bytes": payload.num_bytes,
                     "weights/bytes_frac": payload.num_bytes / max(full, 1),
                     "weights/encode_s": encoded - t0, "weights/write_s": written - encoded,
                     "weights/announce_s": announced - written,
                     "weights/broadcast_s": time.perf_counter() - announced, "weights/engines_linked": len(linked),
                     "weights/superseded": self.superseded, "weights/anchor_requests": self.anchor_requests}


class AnchorRequests:
    """Rank 0: reads `sao.weights.requests` from its end as of the start (a start publishes an
    anchor anyway) on its own thread, and calls `publisher.request_anchor()` for each request."""

    def __init__(self, kafka: KafkaConfig, publisher: Publisher, poll_s: float = 0.5):
        self.publisher, self.poll_s = publisher, poll_s
        self.consumer = make_consumer(kafka, f"{kafka.topic_prefix}-anchor-requests-{uuid.uuid4().hex}")
        tp = TopicPartition(kafka.topic(T.WEIGHT_REQUESTS), 0)
        _, high = retrying(lambda: self.consumer.get_watermark_offsets(tp, timeout=5, cached=False))
        self.consumer.assign([TopicPartition(tp.topic, 0, high)])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="anchor-requests", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self.consumer.poll(self.poll_s)
            if msg is None or consumer_error(msg):
                continue
            try:
                ask = AnchorRequest.decode(msg.value() or b"")
            except SchemaError as e:  # nothing to train on or lose: say so and go on
                log.warning("unreadable anchor request at offset %d ignored: %s", msg.offset(), e)
                continue
            log.info("anchor requested by %s (holds v%d, cannot reach v%d: %s)", ask.requester,
                     ask.held_version, ask.wanted_version, ask.reason)
            self.publisher.request_anchor()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.consumer.close()
