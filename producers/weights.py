"""Weight subscription: follow `sao.weights`, verify each newer version, and swap it in.

Every producer and inference server reads the whole (one-partition) topic with its own consumer
and no shared group: partition 0 is assigned from the beginning, the backlog is read to the high
watermark, and the newest announcement that loads wins (falling back to older ones if it does
not). After that each announcement newer than the loaded version is fetched from its `file://`
uri, checked against its `num_bytes` and `sha256`, and handed to `generator.load_weights`, which
swaps between two decode steps: an episode in flight continues on the new weights and its later
tokens carry the new version.

A failed or corrupt load keeps the old weights; it is logged and counted (`rejected`). Older or
equal versions are counted as `ignored`. An undecodable announcement is logged and counted
(`invalid`) but not dead-lettered: every producer reads every announcement, so each would send
its own copy of the same dead letter.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from producers.generate.base import ArchitectureMismatch, Generator
from schemas.retry import retrying
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, consumer_error, make_consumer
from schemas.messages import SchemaError, Weights

log = logging.getLogger(__name__)


class WeightsError(ValueError):
    """An announced weights file that cannot be used (missing, wrong size, wrong sha256)."""


def local_path(uri: str) -> Path:
    """The path of a `file:///abs/path` uri."""
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise WeightsError(f"unsupported weights uri {uri!r}: only file:///abs/path is supported")
    return Path(unquote(parsed.path))


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(w: Weights) -> Path:
    """The local file of announcement `w`, after checking its size and sha256."""
    path = local_path(w.uri)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise WeightsError(f"version {w.version}: cannot read {path}: {e}") from None
    if size != w.num_bytes:
        raise WeightsError(f"version {w.version}: {path} has {size} bytes, announced {w.num_bytes}")
    digest = sha256_file(path)
    if digest != w.sha256:
        raise WeightsError(f"version {w.version}: sha256 {digest} of {path} != announced {w.sha256}")
    return path


def newest_first(announcements: Sequence[Weights], current: int) -> list[Weights]:
    """Candidates to load after reading the backlog: versions above `current`, newest first,
    one per version (the last announcement of a version wins)."""
    by_version = {w.version: w for w in announcements if w.version > current}
    return [by_version[v] for v in sorted(by_version, reverse=True)]


def _mismatch(w: Weights, e: ArchitectureMismatch) -> ConfigError:
    return ConfigError(f"--model: the learner's weights (version {w.version}) are another architecture "
                       f"than this producer's model: {e}")


def weights_reader(kafka: KafkaConfig):
    """A consumer of `sao.weights` (one partition) from its beginning, in no group of its own
    that others share: every reader sees every announcement."""
    consumer = make_consumer(kafka, f"sao-weights-{uuid.uuid4().hex}")
    consumer.assign([TopicPartition(kafka.topic(T.WEIGHTS), 0, OFFSET_BEGINNING)])
    return consumer


def learner_store(kafka: KafkaConfig, stop: threading.Event, poll_s: float = 0.5) -> Path | None:
    """The learner's weight store folder, found through its first announcement on `sao.weights`
    (waiting for one: a producer may start before the learner); None once `stop` is set. The
    folder holds the `config.json` and `model.json` the learner writes at start (learner/store.py)."""
    consumer, next_log = weights_reader(kafka), time.monotonic()
    try:
        while not stop.is_set():
            msg = consumer.poll(poll_s)
            if msg is None or consumer_error(msg):
                if time.monotonic() >= next_log:
                    log.info("--model learner: waiting for the learner's first weights on %s", T.WEIGHTS)
                    next_log += 30
                continue
            try:
                folder = local_path(Weights.decode(msg.value() or b"").uri).parent
            except (SchemaError, WeightsError) as e:
                log.error("weights announcement at offset %d unusable: %s", msg.offset(), e)
                continue
            if (folder / "config.json").is_file() and (folder / "model.json").is_file():
                return folder
            raise ConfigError(f"--model learner: {folder} has no config.json and model.json; is the learner's "
                              "weights dir shared with this producer, and is the learner up to date?")
        return None
    finally:
        consumer.close()


class WeightSubscriber:
    """A background thread that keeps `generator` on the newest loadable announced version."""

    def __init__(self, kafka: KafkaConfig, generator: Generator, *, verify_files: bool = True,
                 poll_s: float = 0.2):
        self.kafka = kafka
        self.generator = generator
        self.verify_files = verify_files  # False: the generator only records versions (http backend),
        # so it gets the uri itself and this process needs no access to the file
        self.poll_s = poll_s
        self.counts = {"loaded": 0, "rejected": 0, "ignored": 0, "invalid": 0}
        self.last_swap_s = float("nan")  # announcement created_at -> new weights live
        self.caught_up = threading.Event()  # the backlog has been read and the newest version tried
        self.error: BaseException | None = None  # why the thread died; the owner should exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights", daemon=True)

    def start(self) -> WeightSubscriber:
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def apply(self, w: Weights) -> bool:
        """Load `w` if it is newer than the generator's version; False if ignored or rejected."""
        if w.version <= self.generator.version:
            self.counts["ignored"] += 1
            log.info("weights version %d ignored: already on %d", w.version, self.generator.version)
            return False
        try:
            self.generator.load_weights(str(verify(w)) if self.verify_files else w.uri, w.version)
        except ArchitectureMismatch as e:
            raise _mismatch(w, e) from e
        except Exception as e:  # a bad file or a load failure must never take the producer down
            self.counts["rejected"] += 1
            log.error("weights version %d rejected, staying on %d: %s", w.version,
                      self.generator.version, e)
            return False
        self.counts["loaded"] += 1
        self.last_swap_s = time.time() - w.created_at
        log.info("weights version %d live (%.3fs after its announcement)", w.version, self.last_swap_s)
        return True

    def _decode(self, msg) -> Weights | None:
        if msg is None:
            return None
        if consumer_error(msg):
            return None
        try:
            return Weights.decode(msg.value() or b"")
        except SchemaError as e:
            self.counts["invalid"] += 1
            log.error("invalid weights announcement at offset %d: %s", msg.offset(), e)
            return None

    def _catch_up(self, consumer, tp: TopicPartition) -> None:
        _, high = retrying(lambda: consumer.get_watermark_offsets(tp, timeout=5, cached=False))
        backlog, position = [], -1
        while position < high - 1 and not self._stop.is_set():
            msg = consumer.poll(self.poll_s)
            if msg is not None and not msg.error():
                position = msg.offset()
            if (w := self._decode(msg)) is not None:
                backlog.append(w)
        check = getattr(self.generator, "check_weights", None)  # backends that hold the model
        if check is not None and self.verify_files:
            # a version we start on and never load (v0 is built here from the same seed) must be this
            # model's architecture too; newer ones are checked as apply() loads them, hashed once
            for w in (w for w in newest_first(backlog, -1) if w.version <= self.generator.version):
                try:
                    path = verify(w)
                except WeightsError:
                    continue  # apply() below rejects and counts it
                try:
                    check(str(path))
                except ArchitectureMismatch as e:
                    raise _mismatch(w, e) from e
                break
        for w in newest_first(backlog, self.generator.version):
            if self.apply(w):
                break

    def _run(self) -> None:
        consumer = weights_reader(self.kafka)
        try:
            self._catch_up(consumer, consumer.assignment()[0])
            self.caught_up.set()
            while not self._stop.is_set():
                if (w := self._decode(consumer.poll(self.poll_s))) is not None:
                    self.apply(w)
        except BaseException as e:  # the owner checks `error` and exits: no silent stale weights
            self.error = e
            log.exception("weights subscription died")
        finally:
            self.caught_up.set()
            consumer.close()
