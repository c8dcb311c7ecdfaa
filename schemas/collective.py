"""The collective weight transport: the learner's rank 0 broadcasts every update to the engines
linked to it over torch.distributed, while `sao.weights` still carries the announcement (the
source of truth for versions; an engine outside the broadcast reads the payload instead).

The learner hosts a TCPStore (`--weights.collective-port`). An engine that holds a state links
itself: it takes a slot number from the store and forms a two-member gloo group with the learner
under that slot's prefix. One group per engine, not one for all: an engine that dies or stops
breaks its own group only, so the learner drops it at the first failed or timed-out operation
and goes on with the others; the engine catches up from anchors and deltas and links again under
a new slot. (NCCL would keep the bytes on the GPUs; it is not wired here, see docs/operations.md, Weight transport.)

Per update the learner writes the members it broadcasts to under `sao/bcast/{version}`, then
queues to each a header (version, bytes) and every tensor's bytes, straight from its snapshot (no
staging copy), on that member's own group, so a member that stalls holds up its own queue only;
an engine that reads the announcement waits for that key, receives if it is listed, into the
layout of the state it holds (same names, dtypes, shapes), and verifies the result against the
announcement's digest like any other update.
"""

from __future__ import annotations

import datetime
import logging
import threading

import numpy as np
import torch
import torch.distributed as dist

from schemas import weights as W

log = logging.getLogger(__name__)

_ENGINES, _LINK, _BCAST = "sao/engines", "sao/link/", "sao/bcast/"


def _group(store, slot: int, rank: int, timeout_s: float):
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{_LINK}{slot}", store), rank, 2,
                                 datetime.timedelta(seconds=timeout_s))


def _broadcast(group, tensor: torch.Tensor):
    return group.broadcast([tensor], dist.BroadcastOptions())  # root 0: the learner


class Links:
    """Learner side: accepts engines as they link, and broadcasts states to them."""

    def __init__(self, port: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self._groups: dict[int, object] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._accepted = 0
        self._acceptor = threading.Thread(target=self._accept, name="weights-links", daemon=True)
        self._acceptor.start()

    @property
    def members(self) -> list[int]:
        with self._lock:
            return sorted(self._groups)

    def _accept(self) -> None:
        while not self._closed.wait(0.2):
            for slot in range(self._accepted + 1, self.store.add(_ENGINES, 0) + 1):
                self._accepted = slot
                try:
                    group = _group(self.store, slot, 0, self.timeout_s)  # waits for the engine's half
                except RuntimeError as e:
                    log.warning("engine %d did not link: %s", slot, e)
                    continue
                with self._lock:
                    self._groups[slot] = group
                log.info("engine %d linked for weight broadcasts", slot)

    def broadcast(self, version: int, state: W.State) -> list[int]:
        """Send `state` to every linked engine; returns the ones that took it. An engine that fails
        or times out is dropped (it reads the payload instead and links again)."""
        with self._lock:
            groups = dict(self._groups)
        self.store.set(f"{_BCAST}{version}", ",".join(map(str, groups)))
        if version >= 16:
            self.store.delete_key(f"{_BCAST}{version - 16}")  # engines long past it
        header = torch.tensor([version, sum(t.bits.nbytes for t in state.values())], dtype=torch.int64)
        tensors = [header] + [torch.from_numpy(t.bits.view(np.uint8)) for t in state.values()]
        queued = {slot: [_broadcast(g, t) for t in tensors] for slot, g in groups.items()}  # all at once
        alive = []
        for slot, works in queued.items():
            try:
                for work in works:
                    work.wait()
                alive.append(slot)
            except RuntimeError as e:  # died, stopped or lagging past the timeout: the others go on
                log.warning("engine %d dropped from the weight broadcast: %s", slot, e)
        with self._lock:
            for slot in groups.keys() - set(alive):
                self._groups.pop(slot, None)
        return alive

    def close(self) -> None:
        self._closed.set()
        self._acceptor.join(self.timeout_s + 1)


class Link:
    """Engine side: links to the learner in the background once `start`ed, and receives the
    broadcasts it is a member of."""

    def __init__(self, addr: str, timeout_s: float):
        host, _, port = addr.rpartition(":")
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self.slot = 0
        self._store = self._group = None
        self._linked, self._closed = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin linking (again, after a drop), in the background."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._connect, name="weights-link", daemon=True)
            self._thread.start()

    @property
    def linked(self) -> bool:
        return self._linked.is_set()

    def _connect(self) -> None:
        backoff = 0.5
        while not self._closed.is_set() and not self._linked.is_set():
            try:
                store = dist.TCPStore(self.host, self.port, is_master=False,
                                      timeout=datetime.timedelta(seconds=self.timeout_s))
                slot = store.add(_ENGINES, 1)
                self._store, self._group, self.slot = store, _group(store, slot, 1, self.timeout_s), slot
                self._linked.set()
                log.info("linked to the learner at %s:%d as engine %d", self.host, self.port, slot)
            except RuntimeError as e:  # no learner yet, or it went away
                log.info("no weight link to %s:%d yet: %s", self.host, self.port, e)
                self._closed.wait(backoff)
                backoff = min(2 * backoff, 10.0)

    def receive(self, version: int, layout: W.State) -> W.State | None:
        """The state broadcast as `version`, in `layout`'s names, dtypes and shapes; None if this
        engine is not linked or not in that broadcast. Raises RuntimeError (and unlinks, then
        links again) if the link broke."""
        if not self._linked.is_set():
            return None
        try:
            key = f"{_BCAST}{version}"
            self._store.wait([key], datetime.timedelta(seconds=self.timeout_s))
            if str(self.slot) not in self._store.get(key).decode().split(","):
                return None
            header = torch.empty(2, dtype=torch.int64)
            bufs = [np.empty(t.bits.nbytes, np.uint8) for t in layout.values()]
            works = [_broadcast(self._group, header)] + [_broadcast(self._group, torch.from_numpy(b)) for b in bufs]
            works[0].wait()
            total = sum(b.size for b in bufs)
            if header.tolist() != [version, total]:
                raise RuntimeError(f"broadcast of {header.tolist()}, expected version {version} of {total} bytes")
            for work in works[1:]:
                work.wait()
        except RuntimeError:
            self._unlink()
            raise
        return {name: W.Tensor(t.dtype, t.shape, b.view(t.bits.dtype)) for (name, t), b in zip(layout.items(), bufs)}

    def _unlink(self) -> None:
        self._linked.clear()
        self._store = self._group = None
        self.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)
