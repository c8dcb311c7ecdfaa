"""The collective weight transport: the learner's rank 0 broadcasts every update to the engines
linked to it over torch.distributed, while `sao.weights` still carries the announcement (the
source of truth for versions; an engine outside the broadcast reads the payload instead).

The learner hosts a TCPStore (`--weights.collective-port`) and writes there the backend its
links use: NCCL where it trains on CUDA (the bytes go GPU to GPU, over NVLink or InfiniBand), gloo
otherwise (host tensors over TCP). An engine that holds a state links itself: it takes a slot
number from the store and forms a two-member group of that backend with the learner under that
slot's prefix; an engine that cannot use the backend (NCCL, and no GPU here) stays on the files.
One group per engine, not one for all: an engine that dies or stops breaks its own group only,
so the learner drops it at the first failed or timed-out operation (an NCCL group is aborted
then, by this code's own deadline, long before torch's watchdog, which would end the whole
process) and goes on with the others; the engine catches up from anchors and deltas and links
again under a new slot.

Per update the learner writes the members it broadcasts to under `sao/bcast/{version}`, then
sends each a header (version, bytes, bucket size) and then every tensor's bytes a bucket at a
time: a bucket is staged on the link's device (no copy on the host, where gloo sends the
snapshot's own memory; `--weights.bucket-mb` of device memory under NCCL), broadcast to every
member, and waited for before the next: a member that has not taken a bucket within
`--weights.collective-timeout-s` is dropped, and the others, which wait up to twice their own
timeout for a bucket, go on with the next. An engine that reads the announcement waits for that key,
receives if it is listed, into the layout of the state it holds (same names, dtypes, shapes),
through device buffers of the same buckets under NCCL, and verifies the result against the
announcement's digest like any other update.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from schemas.config import ConfigError
from schemas.weights import payload as W

log = logging.getLogger(__name__)

_ENGINES, _LINK, _BCAST, _BACKEND = "sao/engines", "sao/link/", "sao/bcast/", "sao/backend"

Backend = Literal["gloo", "nccl"]


def link_backend(choice: Literal["auto", "gloo", "nccl"], device: torch.device) -> Backend:
    """The backend of the learner's links: `auto` is NCCL where the learner trains on CUDA."""
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if choice == "nccl" and device.type != "cuda":
        raise ConfigError(f"--weights.collective-backend nccl needs the learner on CUDA; it runs on {device}")
    return choice


def _group(store, slot: int, rank: int, timeout_s: float, backend: Backend, device: torch.device):
    prefix = dist.PrefixStore(f"{_LINK}{slot}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, 2, timeout)  # waits for the other half
    # Non-blocking NCCL, as torchft runs it: a peer that never comes or dies makes our own deadline
    # fail (then `abort`), not a hang; torch's watchdog, which would end the whole process (the
    # learner with every other engine), is set far past that deadline.
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(timeout_s)))
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.blocking = False
    opts._timeout = max(datetime.timedelta(minutes=30), 10 * timeout)
    group = dist.ProcessGroupNCCL(prefix, rank, 2, opts)
    group.eager_connect_single_device(device)  # the communicator now, as gloo's constructor does
    return group


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of `tensors` of at most `bucket_bytes` each (a larger tensor alone)."""
    bucket, size = [], 0
    for t in tensors:
        if bucket and size + t.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.nbytes
    if bucket:
        yield bucket


def _start(group, tensors: list[torch.Tensor], deadline: float) -> list:
    """Queue the broadcast of `tensors` from the learner (rank 0) over `group`, each to fail at
    `deadline` (monotonic), not at the group's own timeout."""
    opts = dist.BroadcastOptions()
    opts.timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    return [group.broadcast([t], opts) for t in tensors]


def _finish(works: list, deadline: float) -> None:
    """Wait for queued broadcasts; RuntimeError if they have not finished by `deadline` (monotonic)."""
    for work in works:
        work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


PEER_STALL = 2.0
"""An engine waits this many times its timeout for a bucket: the learner may first wait its own
timeout on a stalled peer of that bucket before dropping it and sending on."""


def _drop(group, backend: Backend) -> None:
    if backend == "nccl":
        group.abort()  # frees the communicator and anything still queued on it


class Links:
    """Learner side: accepts engines as they link, and broadcasts states to them."""

    def __init__(self, port: int, timeout_s: float, backend: Backend = "gloo",
                 device: torch.device = torch.device("cpu"), bucket_bytes: int = 256 << 20):
        self.timeout_s, self.backend, self.device, self.bucket_bytes = timeout_s, backend, device, bucket_bytes
        self.store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.store.set(_BACKEND, backend)
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
                    group = _group(self.store, slot, 0, self.timeout_s, self.backend, self.device)
                except RuntimeError as e:
                    log.warning("engine %d did not link: %s", slot, e)
                    continue
                with self._lock:
                    self._groups[slot] = group
                log.info("engine %d linked for weight broadcasts (%s)", slot, self.backend)

    def broadcast(self, version: int, state: W.State) -> list[int]:
        """Send `state` to every linked engine; returns the ones that took it. An engine that fails
        or has not taken it within the timeout is dropped (it reads the payload instead and links
        again)."""
        with self._lock:
            groups = dict(self._groups)
        self.store.set(f"{_BCAST}{version}", ",".join(map(str, groups)))
        if version >= 16:
            self.store.delete_key(f"{_BCAST}{version - 16}")  # engines long past it
        total = sum(t.bits.nbytes for t in state.values())
        header = torch.tensor([version, total, self.bucket_bytes], dtype=torch.int64)
        tensors = [torch.from_numpy(t.bits.view(np.uint8)) for t in state.values()]
        for bucket in [[header]] + list(_buckets(tensors, self.bucket_bytes)):
            staged = [t.to(self.device, non_blocking=True) for t in bucket]  # the tensor itself on the host
            deadline = time.monotonic() + self.timeout_s
            queued, failed = {}, {}
            for slot, group in groups.items():  # every member's share queued at once, then waited for
                try:
                    queued[slot] = _start(group, staged, deadline)
                except RuntimeError as e:
                    failed[slot] = e
            for slot, works in queued.items():
                try:
                    _finish(works, deadline)
                except RuntimeError as e:  # died, stopped or lagging past the timeout: the others go on
                    failed[slot] = e
            for slot, e in failed.items():
                log.warning("engine %d dropped from the weight broadcast: %s", slot, e)
                _drop(groups.pop(slot), self.backend)
                with self._lock:
                    self._groups.pop(slot, None)
        return sorted(groups)

    def close(self) -> None:
        self._closed.set()
        self._acceptor.join(self.timeout_s + 1)


class Link:
    """Engine side: links to the learner in the background once `start`ed, and receives the
    broadcasts it is a member of. `refused` says why it will not link (the learner's backend is
    one this engine cannot use); it then stays on the files."""

    def __init__(self, addr: str, timeout_s: float, device: str = "cuda"):
        host, _, port = addr.rpartition(":")
        self.host, self.port, self.timeout_s, self.device = host, int(port), timeout_s, device
        self.slot, self.backend, self.refused, self._on = 0, "gloo", "", torch.device("cpu")
        self._store = self._group = None
        self._linked, self._closed = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin linking (again, after a drop), in the background."""
        if not self.refused and (self._thread is None or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._connect, name="weights-link", daemon=True)
            self._thread.start()

    @property
    def linked(self) -> bool:
        return self._linked.is_set()

    def _device(self, backend: Backend) -> torch.device:
        if backend == "gloo":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ConfigError("the learner broadcasts over NCCL and this engine has no GPU")
        device = torch.device(self.device)
        if device.type != "cuda":
            raise ConfigError(f"the learner broadcasts over NCCL; --weights.collective-device {self.device} is no GPU")
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    def _connect(self) -> None:
        backoff = 0.5
        while not self._closed.is_set() and not self._linked.is_set():
            try:
                store = dist.TCPStore(self.host, self.port, is_master=False,
                                      timeout=datetime.timedelta(seconds=self.timeout_s))
                backend = store.get(_BACKEND).decode()
                device = self._device(backend)
                slot = store.add(_ENGINES, 1)
                group = _group(store, slot, 1, self.timeout_s, backend, device)
                self._store, self._group, self.slot, self.backend, self._on = store, group, slot, backend, device
                self._linked.set()
                log.info("linked to the learner at %s:%d as engine %d (%s)", self.host, self.port, slot, backend)
            except ConfigError as e:
                self.refused = str(e)
                log.error("not linking to the learner at %s:%d: %s; taking updates from the files",
                          self.host, self.port, e)
                return
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
            bufs = [np.empty(t.bits.nbytes, np.uint8) for t in layout.values()]
            header = self._receive([torch.empty(3, dtype=torch.int64)])[0]
            version_sent, total, bucket_bytes = header.tolist()
            if [version_sent, total] != [version, sum(b.size for b in bufs)]:
                raise RuntimeError(f"broadcast of version {version_sent}, {total} bytes; expected "
                                   f"version {version}, {sum(b.size for b in bufs)} bytes (another layout)")
            for bucket in _buckets([torch.from_numpy(b) for b in bufs], bucket_bytes):
                self._receive(bucket)
        except RuntimeError:
            self._unlink()
            raise
        return {name: W.Tensor(t.dtype, t.shape, b.view(t.bits.dtype))
                for (name, t), b in zip(layout.items(), bufs)}

    def _receive(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """Receive one bucket into `host` (through buffers on the link's device, if not the host's)."""
        staged = [t if t.device == self._on else torch.empty_like(t, device=self._on) for t in host]
        deadline = time.monotonic() + PEER_STALL * self.timeout_s
        _finish(_start(self._group, staged, deadline), deadline)
        for h, s in zip(host, staged):
            if s is not h:
                h.copy_(s)
        return host

    def _unlink(self) -> None:
        self._linked.clear()
        if self._group is not None:
            _drop(self._group, self.backend)
        self._store = self._group = None
        self.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)
