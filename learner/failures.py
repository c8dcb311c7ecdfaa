"""A step that keeps failing is dead-lettered whole, so a restart can never loop on it.

Steps re-form identically after a restart (they close on counts, never on time), which is what
makes training exactly-once, and also what would make a learner crash-loop forever on a step that
raises whatever the checks in learner/checks.py let through. The count of consecutive failures of
the same step (the same trajectories) lives next to the checkpoint; once it reaches the limit, the
source dead-letters that step's trajectories with the recorded error instead of training them.

Only failures that raise are counted: a SIGKILL (an operator, the OOM killer, a node drain) leaves
no record, so killing a healthy learner repeatedly never drops data.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from schemas.files import atomic_file

log = logging.getLogger(__name__)


class StepFailures:
    """The trajectory ids of the step that last raised, and on how many consecutive starts."""

    def __init__(self, path: Path, max_failures: int):
        self.path, self.max_failures = path, max_failures

    def _load(self) -> tuple[set[str], int, str]:
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return set(), 0, ""
        return set(record["ids"]), record["failures"], record["error"]

    def poisoned(self, ids: Iterable[str]) -> str | None:
        """The recorded error if a step sharing trajectories with this one has failed
        `max_failures` consecutive starts, else None."""
        failed, failures, error = self._load()
        if failures >= self.max_failures and not failed.isdisjoint(ids):
            return f"step failed on {failures} consecutive starts: {error}"
        return None

    @contextlib.contextmanager
    def guard(self, ids: list[str]) -> Iterator[None]:
        """Run a step; if it raises, count the failure durably, then let the error stop the learner.

        With several partitions a restart may form the failing step with other companions, so a
        failure counts as consecutive when the steps share trajectories, and the record narrows to
        the shared ones: the culprit is among them."""
        try:
            yield
        except Exception as e:
            failed, failures, _ = self._load()
            shared = failed.intersection(ids)
            failed, failures = (shared, failures + 1) if shared else (set(ids), 1)
            record = {"ids": sorted(failed), "failures": failures, "error": f"{type(e).__name__}: {e}"[:2000]}
            atomic_file(self.path, lambda tmp: tmp.write_text(json.dumps(record)))
            log.error("step of %d trajectories failed (%d/%d consecutive starts): %s", len(ids), failures,
                      self.max_failures, e)
            raise
