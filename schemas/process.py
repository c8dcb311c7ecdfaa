"""What every service process shares beyond the wire: stopping cleanly on a signal, and calling
into an event loop from the process's other threads."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable


def stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """An event set by SIGTERM or SIGINT, so a service loop can finish its current unit of work
    and close its clients. Handlers can only be installed from the main thread; elsewhere (a
    service run inside a test's thread) the caller's `stop` is the only way to end the loop."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    return stop


def threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable) -> Callable:
    """`fn` made callable from another thread (an engine, a Kafka callback), run on `loop`. It
    never raises into that thread: a call after the loop closed (the server stopped) is dropped."""
    def call(*args) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(fn, *args)
    return call
