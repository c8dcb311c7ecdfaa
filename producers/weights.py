"""Weight subscription: follow `sao.weights`, rebuild each newer version, verify it, swap it in.

Every producer and inference server reads the one-partition topic with its own consumer and no
shared group. At start it reads the topic's tail back to its newest anchors (a window that grows
until it holds two, so a late start costs the chain, not the history), rebuilds the newest
version reachable (producers/updates.py: the newest anchor and the deltas after it, falling back
to older anchors when a link fails) and loads it. After that every announcement is planned the
same way: a delta onto the held version is applied to the held state; one onto another version
(missed, out of order) or one that does not verify is refused, and the newest anchor and its
chain are loaded instead. Nothing is half-applied: the engine gets one full file of a verified
state (`generator.load_weights`), swapped between two decode steps, so an episode in flight
continues on the new weights and its later tokens carry the new version.

Linked to the learner by the collective transport (`--weights.collective-addr`), an update the
learner broadcasts to this engine arrives over the link instead (schemas/collective.py), verified
the same way; a link that breaks falls back to the files and inline payloads, and links again.

Each update's figures (`last`, summed in `totals`): `fetch_s` reading, decoding, applying and
verifying; `write_s` the full file; `load_s` the generator's whole load; `pause_s` what the engine
stopped decoding for (the backend's `last_pause_s`); `lag_s` from the announcement to live.
A failed update keeps the old weights serving; it is logged and counted (`rejected`). Versions at
or below the engine's are `ignored`. When the newest version announced is out of reach (a delta
refused or its file gone, and no anchor after it), the subscriber asks the learner for an anchor
on `sao.weights.requests` (`anchor_asks`, at most one per `ANCHOR_ASK_EVERY_S`) instead of
waiting up to `--weights.anchor-every` versions for the next one. An undecodable announcement is
logged and counted (`invalid`) but not dead-lettered: every producer reads every announcement, so
each would send its own copy of the same dead letter.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from producers.generate.base import ArchitectureMismatch, Generator
from producers.updates import Rebuilt, WeightsError, local_path, plan, rebuild, write_full
from schemas import topics as T
from schemas import weights as W
from schemas.collective import Link
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, consumer_error, make_consumer, make_producer, produce_and_wait, read_ranges
from schemas.messages import AnchorRequest, SchemaError, Weights
from schemas.retry import retrying
from schemas.signing import load_trusted, refusal

log = logging.getLogger(__name__)

ANCHOR_ASK_EVERY_S = 10.0
"""Seconds between two anchor requests of one subscriber while the newest version stays out of reach."""

__all__ = ["FollowConfig", "Following", "WeightSubscriber", "WeightsError", "decode_announcement", "learner_store", "local_path",
           "prune", "read_backlog", "weights_reader"]


@dataclass(kw_only=True)
class FollowConfig:
    collective_addr: str = ""
    """host:port of the learner's collective endpoint (its --weights.collective-port): take updates
    broadcast to this engine over torch.distributed; "": files and inline payloads only."""
    collective_timeout_s: float = 30.0
    """A bucket of an update not received over the link within twice this many seconds (the
    learner's own timeout on a stalled peer first): the link is dropped and the files used."""
    collective_device: str = "cuda"
    """The GPU an NCCL link receives on (a learner on CUDA broadcasts over NCCL; gloo receives on
    the host)."""
    scratch_dir: str = ""
    """Folder for the full file handed to the engine at each update (one kept); "": a temporary folder."""
    trusted_keys: str = ""
    """Comma-separated Ed25519 public keys (PEM, `sao keys`) of the learner: an announcement not
    signed by one of them is refused, logged and counted, and the engine keeps its weights (two
    keys during a rotation); empty: announcements are not verified (said once at start)."""

    def __post_init__(self):
        self.trusted = load_trusted(self.trusted_keys) if self.trusted_keys else None  # a bad file: at start


def weights_reader(kafka: KafkaConfig):
    """A consumer of `sao.weights` (one partition) from its beginning, in no group of its own
    that others share: every reader sees every announcement."""
    consumer = make_consumer(kafka, f"sao-weights-{uuid.uuid4().hex}")
    consumer.assign([TopicPartition(kafka.topic(T.WEIGHTS), 0, OFFSET_BEGINNING)])
    return consumer


def learner_store(kafka: KafkaConfig, stop: threading.Event, poll_s: float = 0.5,
                  trusted: dict | None = None) -> Path | None:
    """The learner's weight store folder, found through its first announcement on `sao.weights`
    (waiting for one: a producer may start before the learner); None once `stop` is set. The
    folder holds the `config.json` and `model.json` the learner writes at start (learner/store.py)."""
    consumer, next_log = weights_reader(kafka), time.monotonic()
    try:
        while not stop.is_set():
            msg = consumer.poll(poll_s)
            if msg is None or consumer_error(msg):
                if time.monotonic() >= next_log:
                    log.info("--model learner: waiting for the learner's first weights on %s", kafka.topic(T.WEIGHTS))
                    next_log += 30
                continue
            w, refused = decode_announcement(msg, trusted)  # with trusted keys, only the learner names its store
            if w is None:
                continue
            try:
                folder = local_path(w.store)
            except WeightsError as e:
                log.error("weights announcement at offset %d unusable: %s", msg.offset(), e)
                continue
            if (folder / "config.json").is_file() and (folder / "model.json").is_file():
                return folder
            raise ConfigError(f"--model learner: {folder} has no config.json and model.json; is the learner's "
                              "weights dir shared with this producer, and is the learner up to date?")
        return None
    finally:
        consumer.close()


def read_backlog(consumer, keep_anchors: int, decode: Callable[[object], Weights | None], stop: threading.Event,
                 poll_s: float) -> list[Weights]:
    """The announcements at the end of `consumer`'s one partition, back to the `keep_anchors`-th
    newest anchor (or the beginning), read newest window first, each offset once, each message
    through `decode` (None: skipped); the consumer is left at the end for a live loop."""
    tp = consumer.assignment()[0]
    low, high = retrying(lambda: consumer.get_watermark_offsets(tp, timeout=5, cached=False))
    got, end, window = [], high, 64
    while end > low and sum(w.base < 0 for w in got) < keep_anchors and not stop.is_set():
        start = max(low, end - window)
        msgs = read_ranges(consumer, tp.topic, {0: (start, end)}, stop=stop, poll_s=poll_s)
        got = [w for msg in msgs if (w := decode(msg)) is not None] + got
        end, window = start, 4 * window
    consumer.assign([TopicPartition(tp.topic, 0, high)])
    return got


def decode_announcement(msg, trusted: dict | None = None) -> tuple[Weights | None, str]:
    """(the announcement `msg` holds if it may be acted on, else None; "" or why not: `invalid`,
    or with `trusted` keys `unsigned`, `untrusted`, `forged` (schemas/signing.py)). No message or a
    transient error is (None, ""). A refused one is logged, not dead-lettered (every reader of the
    topic reads it: each would send its own copy)."""
    if msg is None or consumer_error(msg):
        return None, ""
    try:
        w = Weights.decode(msg.value() or b"")
    except SchemaError as e:
        log.error("invalid weights announcement at offset %d: %s", msg.offset(), e)
        return None, "invalid"
    if trusted is not None and (why := refusal(w, trusted)):
        log.error("weights announcement of version %d at offset %d refused: %s (key %s)", w.version,
                  msg.offset(), why, w.key_id or "none")
        return None, why
    return w, ""


def prune(history: list[Weights], keep_anchors: int) -> list[Weights]:
    """`history` from its `keep_anchors`-th newest anchor on: what any chain to a version worth
    loading can start from."""
    anchors = [i for i, x in enumerate(history) if x.base < 0]
    return history[anchors[-keep_anchors]:] if len(anchors) > keep_anchors else history


class Following:
    """What a follower knows of the announcements and what it decides from them, with no Kafka, no
    files and no engine (the pure core of `WeightSubscriber`): the history back to its newest
    `keep_anchors` anchors, the versions that failed, the chain to load next, and when to ask the
    learner for an anchor."""

    def __init__(self, keep_anchors: int = 2, ask_every_s: float = ANCHOR_ASK_EVERY_S):
        self.keep_anchors, self.ask_every_s = keep_anchors, ask_every_s
        self.history: list[Weights] = []
        self.bad: set[int] = set()  # versions that failed to apply
        self.refusal = ""  # why the last version was refused, for an anchor request
        self.asked_at = -math.inf
        self.counts = {"loaded": 0, "rejected": 0, "ignored": 0, "invalid": 0, "anchor_asks": 0}

    def backlog(self, announcements: list[Weights]) -> None:
        self.history = prune(announcements, self.keep_anchors)

    def announced(self, w: Weights, engine_version: int, received: bool = False) -> None:
        """A new announcement; `received`: its update already came over the collective link."""
        if not received and w.version <= engine_version:
            self.counts["ignored"] += 1
            log.info("weights version %d ignored: already on %d", w.version, engine_version)
        self.history = prune([*self.history, w], self.keep_anchors)
        self.bad.discard(w.version)  # announced again: worth another try

    def chain(self, held_version: int) -> list[Weights]:
        """The updates to apply, in order, to reach the newest version reachable (`plan`)."""
        return plan(self.history, held_version, self.bad)

    def newest(self) -> Weights | None:
        return max(self.history, key=lambda w: w.version, default=None)

    def failed(self, version: int, error: str) -> None:
        self.bad.add(version)
        self.refusal = f"v{version}: {error}"
        self.counts["rejected"] += 1

    def anchor_request(self, requester: str, held: int, now: float) -> AnchorRequest | None:
        """An anchor request if the newest version announced is newer than `held` (anything held or
        loaded), and none was asked for within `ask_every_s`; None otherwise."""
        newest = max((w.version for w in self.history), default=-1)
        if newest <= held or now - self.asked_at < self.ask_every_s:
            return None
        self.asked_at = now
        return AnchorRequest(requester=requester, held_version=held, wanted_version=newest,
                             reason=self.refusal or "no anchor reaches it")


class WeightSubscriber:
    """A background thread that keeps `generator` on the newest version it can verify, as
    `Following` decides: the Kafka reading, the rebuilds, the engine loads and the anchor asks."""

    def __init__(self, kafka: KafkaConfig, generator: Generator, *, verify_files: bool = True,
                 follow: FollowConfig = FollowConfig(), poll_s: float = 0.2, keep_anchors: int = 2,
                 requester: str = ""):
        self.kafka = kafka
        self.requester = requester or f"{socket.gethostname()}-{os.getpid()}"  # named in its anchor requests
        self.generator = generator
        self.verify_files = verify_files  # False: the generator only records versions (http backend),
        # so it gets the uri itself and this process reads no payload
        self.poll_s, self.keep_anchors = poll_s, keep_anchors
        self.following = Following(keep_anchors)
        self.counts = self.following.counts
        self.trusted = follow.trusted
        if self.trusted is not None:
            self.counts |= {"unsigned": 0, "untrusted": 0, "forged": 0}
        else:
            log.warning("weights announcements are not verified: anyone who can write %s decides what this "
                        "engine runs (give --weights.trusted-keys)", kafka.topic(T.WEIGHTS))
        self.handled = 0  # valid announcements acted on (backlog and live): what a caller can wait for
        self.by_source = {"inline": 0, "file": 0, "collective": 0}  # updates loaded, by how their bytes came
        self.last: dict[str, float] = {}
        self.totals = {"fetch_s": 0.0, "write_s": 0.0, "load_s": 0.0, "pause_s": 0.0, "bytes": 0}
        self.caught_up = threading.Event()  # the backlog has been read and the newest version tried
        self.error: BaseException | None = None  # why the thread died; the owner should exit
        self._held: Rebuilt | None = None  # the state of the version last loaded: the base of the next delta
        self._asker = None  # a Kafka producer, made on the first anchor request
        self._own_scratch = not follow.scratch_dir
        self._scratch = Path(follow.scratch_dir or tempfile.mkdtemp(prefix="sao-weights-"))
        self._scratch.mkdir(parents=True, exist_ok=True)
        self._link = Link(follow.collective_addr, follow.collective_timeout_s, follow.collective_device) if follow.collective_addr else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights", daemon=True)

    def start(self) -> WeightSubscriber:
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._asker = None  # its client goes now, not when the subscriber is collected
        if self._link is not None:
            self._link.close()
        if self._own_scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)

    @property
    def held_version(self) -> int:
        return self._held.version if self._held else -1

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        consumer = weights_reader(self.kafka)
        try:
            self.following.backlog(self._backlog(consumer))
            self._advance()
            self.caught_up.set()
            while not self._stop.is_set():
                if (w := self._decode(consumer.poll(self.poll_s))) is not None:
                    self._announced(w)
        except BaseException as e:  # the owner checks `error` and exits: no silent stale weights
            self.error = e
            log.exception("weights subscription died")
        finally:
            self.caught_up.set()
            consumer.close()

    def _decode(self, msg) -> Weights | None:
        w, refused = decode_announcement(msg, self.trusted)
        if refused:
            self.counts[refused] += 1
        return w

    def _backlog(self, consumer) -> list[Weights]:
        return read_backlog(consumer, self.keep_anchors, self._decode, self._stop, self.poll_s)

    def _announced(self, w: Weights) -> None:
        received = self._receive(w) if self._link is not None else False  # a member must always take its broadcast
        self.following.announced(w, self.generator.version, received)
        if not received:
            self._advance()
        self.handled += 1

    # ------------------------------------------------------------------ updates
    def _advance(self) -> None:
        self._load_newest()
        self._ask_if_out_of_reach()

    def _load_newest(self) -> None:
        """Rebuild and load the newest version reachable, trying the next best after each failure."""
        if not self.verify_files:  # the server loads: hand it the newest announcement
            newest = self.following.newest()
            if newest is not None and newest.version > self.generator.version:
                self._load(newest.uri, newest.version, [newest], time.perf_counter(), "file")
            return
        while chain := self.following.chain(self.held_version):
            if chain[-1].version < self.generator.version:
                return  # nothing as new as what the engine runs
            t0 = time.perf_counter()
            state, failed, error = rebuild(chain, self._held)
            if failed is not None:
                self.following.failed(failed.version, error)
                log.error("weights version %d refused, staying on %d: %s", failed.version,
                          self.generator.version, error)
            if state is not None and state.version >= self.generator.version:
                used = chain[:chain.index(failed)] if failed is not None else chain
                self._install(state, used, t0, "inline" if all(w.inline for w in used) else "file")
            if failed is None:
                return

    def _ask_if_out_of_reach(self) -> None:
        """Ask the learner for an anchor if the newest version announced is newer than anything
        held or loaded: no chain from an anchor this subscriber has reaches it. Best effort: an
        ask that fails is logged, and the next scheduled anchor comes anyway."""
        held = max(self.held_version, self.generator.version)
        if not self.verify_files or (ask := self.following.anchor_request(self.requester, held, time.monotonic())) is None:
            return
        newest = ask.wanted_version
        self._asker = self._asker or make_producer(self.kafka)
        try:
            err = produce_and_wait(self._asker, self.kafka.topic(T.WEIGHT_REQUESTS), ask.encode(), ask.key,
                                   timeout=10.0, stop=self._stop)
        except TimeoutError as e:
            err = e
        if err is not None:
            log.warning("weights v%d out of reach; the anchor request was not delivered (%s)", newest, err)
            return
        self.counts["anchor_asks"] += 1
        log.warning("weights v%d out of reach from v%d (%s): asked the learner for an anchor", newest,
                    ask.held_version, ask.reason)

    def _install(self, state: Rebuilt, chain: list[Weights], t0: float, source: str) -> None:
        """Make `state` the held one, loading it unless the engine already runs its version (v0 is
        built from the learner's seed; its state is still needed as the base of the first delta,
        and it must be this engine's architecture)."""
        fetched = time.perf_counter()
        path = write_full(state, self._scratch)
        if state.version == self.generator.version:
            check = getattr(self.generator, "check_weights", None)
            try:
                if check is not None:
                    check(str(path))
            except ArchitectureMismatch as e:
                raise _mismatch(state.version, e) from e
            finally:
                path.unlink(missing_ok=True)
            self._hold(state)
            return
        moved = (sum(t.bits.nbytes for t in state.state.values()) if source == "collective"
                 else sum(w.num_bytes for w in chain))
        stats = {"fetch_s": fetched - t0, "write_s": time.perf_counter() - fetched, "bytes": moved}
        if self._load(str(path), state.version, chain, time.perf_counter(), source, stats):
            self._hold(state)
            for old in self._scratch.glob("v*.safetensors"):
                if old != path:
                    old.unlink(missing_ok=True)  # the engine's last good file stays (vLLM reloads it on failure)
        else:
            path.unlink(missing_ok=True)

    def _hold(self, state: Rebuilt) -> None:
        self._held = state
        if self._link is not None:
            self._link.start()  # a state to receive into: link (again) if not linked

    def _load(self, path: str, version: int, chain: list[Weights], t0: float, source: str,
              stats: dict | None = None) -> bool:
        try:
            self.generator.load_weights(path, version)
        except ArchitectureMismatch as e:
            raise _mismatch(version, e) from e
        except Exception as e:  # a load failure must never take the producer down
            self.following.failed(version, str(e))
            log.error("weights version %d rejected by the engine, staying on %d: %s", version,
                      self.generator.version, e)
            return False
        stats = (stats or {}) | {"version": version, "load_s": time.perf_counter() - t0, "chain": len(chain),
                                 "pause_s": getattr(self.generator, "last_pause_s", float("nan")),
                                 "lag_s": time.time() - chain[-1].created_at}
        self.last = stats
        for k in self.totals.keys() & stats.keys():
            self.totals[k] += 0 if math.isnan(stats[k]) else stats[k]  # NaN: a backend that does not measure it
        self.counts["loaded"] += 1
        self.by_source[source] += 1
        log.info("weights version %d live (%s, %d update%s, %.3f s after its announcement, engine paused %.3f s)",
                 version, source, len(chain), "" if len(chain) == 1 else "s", stats["lag_s"], stats["pause_s"])
        return True

    def _receive(self, w: Weights) -> bool:
        """Take `w` over the collective link if the learner broadcasts it to this engine; False
        to use the payload instead (not linked, not a member of this broadcast, or the link broke)."""
        if self._held is None:  # not linked yet: linking starts once a state is held
            return False
        t0 = time.perf_counter()
        try:
            state = self._link.receive(w.version, self._held.state)
        except RuntimeError as e:  # a broken link: dropped, relinked in the background
            log.warning("weights version %d not received over the link (%s); reading it instead", w.version, e)
            return False
        if state is None or w.version <= self.generator.version:
            return False
        if W.digest(state) != w.digest:
            self.counts["rejected"] += 1
            log.error("weights version %d from the link does not verify; reading it instead", w.version)
            return False
        self._install(Rebuilt(version=w.version, state=state, extra=self._held.extra), [w], t0, "collective")
        return self._held.version == w.version


def _mismatch(version: int, e: ArchitectureMismatch) -> ConfigError:
    return ConfigError(f"--model: the learner's weights (version {version}) are another architecture "
                       f"than this producer's model: {e}")
