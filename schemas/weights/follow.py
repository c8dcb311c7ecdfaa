"""Weight subscription: follow `sao.weights`, rebuild each newer version, verify it, swap it in.

Every producer and inference server reads the one-partition topic with its own consumer and no
shared group. At start it reads the topic's tail back to its newest anchors (a window that grows
until it holds two, so a late start costs the chain, not the history), rebuilds the newest
version reachable (schemas/weights/chain.py: the newest anchor and the deltas after it, falling
back to older anchors when a link fails) and loads it. After that every announcement is planned the
same way: a delta onto the held version is applied to the held state; one onto another version
(missed, out of order) or one that does not verify is refused, and the newest anchor and its
chain are loaded instead. Nothing is half-applied: the engine gets the whole of a verified state,
in memory (`Engine.load_state`, schemas/weights/engine.py: no file is written, whatever carried the
update), swapped between two decode steps, so an episode in flight continues on the new weights and
its later tokens carry the new version. An engine in another process that reads the store itself
(`RemoteEngine`, the http backend) is handed the newest announcement's uri instead.

Linked to the learner by the collective transport (`--weights.collective-addr`), an update the
learner broadcasts to this engine arrives over the link instead (schemas/weights/collective.py), verified
the same way; a link that breaks falls back to the files and inline payloads, and links again.

Each update's figures (`last`, summed in `totals`): `fetch_s` reading, decoding, applying and
verifying; `load_s` the engine's whole load; `pause_s` what the engine
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
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, make_producer, produce_and_wait
from schemas.messages import AnchorRequest, Weights
from schemas.signing import load_trusted
from schemas.weights import payload as W
from schemas.weights.announcements import decode_announcement, read_backlog, weights_reader
from schemas.weights.chain import Rebuilt, engine_shapes, engine_state, plan, prune, rebuild
from schemas.weights.collective import Link
from schemas.weights.engine import ArchitectureMismatch, Engine, RemoteEngine

log = logging.getLogger(__name__)

ANCHOR_ASK_EVERY_S = 10.0
"""Seconds between two anchor requests of one subscriber while the newest version stays out of reach."""

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
    trusted_keys: str = ""
    """Comma-separated Ed25519 public keys (PEM, `sao keys`) of the learner: an announcement not
    signed by one of them is refused, logged and counted, and the engine keeps its weights (two
    keys during a rotation); empty: announcements are not verified (said once at start)."""

    def __post_init__(self):
        self.trusted = load_trusted(self.trusted_keys) if self.trusted_keys else None  # a bad file: at start


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

    def __init__(self, kafka: KafkaConfig, generator: Engine | RemoteEngine, *, verify_files: bool = True,
                 follow: FollowConfig = FollowConfig(), poll_s: float = 0.2, keep_anchors: int = 2,
                 requester: str = ""):
        self.kafka = kafka
        self.requester = requester or f"{socket.gethostname()}-{os.getpid()}"  # named in its anchor requests
        self.generator = generator
        self.verify_files = verify_files  # False: a RemoteEngine (http backend), handed the newest
        # announcement's uri: its server reads the payload, this process reads none
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
        self.totals = {"fetch_s": 0.0, "load_s": 0.0, "pause_s": 0.0, "bytes": 0}
        self.caught_up = threading.Event()  # the backlog has been read and the newest version tried
        self.error: BaseException | None = None  # why the thread died; the owner should exit
        self._held: Rebuilt | None = None  # the state of the version last loaded: the base of the next delta
        self._asker = None  # a Kafka producer, made on the first anchor request
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
                self._load(lambda: self.generator.load_weights(newest.uri, newest.version), newest.version,
                           [newest], time.perf_counter(), "file")
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
        """Make `state` the held one, loading it into the engine's memory unless the engine already
        runs its version (v0 is built from the learner's seed; its state is still needed as the
        base of the first delta, and it must be this engine's architecture)."""
        if state.version == self.generator.version:
            try:
                self.generator.check_shapes(engine_shapes(state))
            except ArchitectureMismatch as e:
                raise _mismatch(state.version, e) from e
            self._hold(state)
            return
        moved = (sum(t.bits.nbytes for t in state.state.values()) if source == "collective"
                 else sum(w.num_bytes for w in chain))
        tensors = engine_state(state)  # a LoRA merge counts as fetching, as the rebuild does
        stats = {"fetch_s": time.perf_counter() - t0, "bytes": moved}
        if self._load(lambda: self.generator.load_state(tensors, state.version), state.version, chain,
                      time.perf_counter(), source, stats):
            self._hold(state)

    def _hold(self, state: Rebuilt) -> None:
        self._held = state
        if self._link is not None:
            self._link.start()  # a state to receive into: link (again) if not linked

    def _load(self, load: Callable[[], None], version: int, chain: list[Weights], t0: float, source: str,
              stats: dict | None = None) -> bool:
        """`load()` the engine onto `version`: True if it did; a failure is counted and logged, and
        the engine keeps serving the weights it had (another architecture stops the producer)."""
        try:
            load()
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
