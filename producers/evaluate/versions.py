"""Which policy version to evaluate next (`due`, pure), and that exact version in the engine
(`Versions`).

An evaluator scores the run's first version (the policy before training), then every version
that is a multiple of `every`, and, on a clean stop, the newest version announced, so a run's
last policy has a score. One that falls behind goes to the newest due version instead of
queueing the older ones: their anchors may be pruned from the weight store by then, and a score
of the newest is what the run needs. Unlike a producer, which always runs the newest version it
can verify, the evaluator loads exactly the version it scores and holds it until the scoring is
done; the engine labels every token with that version, which the service checks.

Asked for named versions instead (`sao eval --versions`), it scores exactly those, oldest first,
and stops once each is scored: how a finished run is scored again with other settings (more
samples, another suite) against its broker's log and weight store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection

from schemas.kafka import KafkaConfig
from schemas.messages import Weights
from schemas.weights.announcements import decode_announcement, read_backlog, weights_reader
from schemas.weights.chain import Rebuilt, WeightsError, engine_state, plan, prune, rebuild
from schemas.weights.engine import Engine

log = logging.getLogger(__name__)


def due(announced: Collection[int], settled: Collection[int], every: int, first: int | None,
        wanted: Collection[int] = ()) -> int | None:
    """The version to evaluate next: `first` (the run's first version) until it is settled (scored,
    or given up), then the newest multiple of `every` past every settled version; None if none.
    Given `wanted` versions instead (a finished run re-scored), the oldest of them announced and
    unsettled: each is asked for by name, so none is skipped for being behind."""
    if wanted:
        return min((v for v in wanted if v in announced and v not in settled), default=None)
    if first is not None and first in announced and first not in settled:
        return first
    last = max(settled, default=-1)
    return max((v for v in announced if v % every == 0 and v > last), default=None)


def out_of_reach(wanted: Collection[int], announced: Collection[int], settled: Collection[int]) -> list[int]:
    """The `wanted` versions older than every version announced since the second-newest anchor:
    no chain of anchor and deltas held reaches them, and waiting will not change that."""
    oldest = min(announced, default=None)
    return sorted(v for v in wanted if oldest is not None and v < oldest and v not in settled)


def final(announced: Collection[int], settled: Collection[int]) -> int | None:
    """The version to evaluate at a clean stop: the newest announced, unless it is settled."""
    newest = max(announced, default=None)
    return None if newest is None or newest in settled else newest


class Versions:
    """The announcements on `sao.weights` (from the `keep_anchors`-th newest anchor on) and one
    version held in `generator`, loaded on request."""

    def __init__(self, kafka: KafkaConfig, generator: Engine, *, keep_anchors: int = 2, poll_s: float = 0.2,
                 trusted: dict | None = None):
        self.generator, self.keep_anchors, self.poll_s, self.trusted = generator, keep_anchors, poll_s, trusted
        self.refused: dict[str, int] = {}  # announcements not acted on, by why (invalid, unsigned, forged, ...)
        self._consumer = weights_reader(kafka)
        self._stop = threading.Event()
        self.history = read_backlog(self._consumer, keep_anchors, self._decode, self._stop, poll_s)
        self.first = min((w.version for w in self.history), default=None)
        self._held: Rebuilt | None = None

    @property
    def announced(self) -> set[int]:
        return {w.version for w in self.history}

    def announcement(self, version: int) -> Weights:
        """The latest announcement of `version` (a version announced twice: the later counts)."""
        return next(w for w in reversed(self.history) if w.version == version)

    def poll(self, timeout: float) -> int:
        """Read what was announced since; waits up to `timeout` for the first. Returns how many."""
        n, wait = 0, timeout
        while (msg := self._consumer.poll(wait)) is not None:
            wait = 0
            if (w := self._decode(msg)) is not None:
                self.history = prune([*self.history, w], self.keep_anchors)
                self.first = w.version if self.first is None else self.first
                n += 1
        return n

    def load(self, version: int) -> Weights:
        """Rebuild `version` from the anchors and deltas that reach it, verify it, and load it into
        the engine; its announcement. WeightsError if nothing held reaches it, or it does not verify."""
        if version == self.generator.version:
            return self.announcement(version)
        held = self._held if self._held is not None and self._held.version <= version else None
        chain = plan([w for w in self.history if w.version <= version], held.version if held else -1)
        if not chain or chain[-1].version != version:
            raise WeightsError(f"version {version}: no anchor held reaches it")
        state, failed, error = rebuild(chain, held)
        if failed is not None:
            raise WeightsError(f"version {version}: {error}")
        self.generator.load_state(engine_state(state), version)
        self._held = state
        return chain[-1]

    def _decode(self, msg) -> Weights | None:
        w, refused = decode_announcement(msg, self.trusted)
        if refused:
            self.refused[refused] = self.refused.get(refused, 0) + 1
        return w

    def close(self) -> None:
        self._stop.set()
        self._consumer.close()
