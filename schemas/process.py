"""What every service process shares beyond the wire: stopping cleanly on a signal."""

from __future__ import annotations

import signal
import threading


def stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """An event set by SIGTERM or SIGINT, so a service loop can finish its current unit of work
    and close its clients. Handlers can only be installed from the main thread; elsewhere (a
    service run inside a test's thread) the caller's `stop` is the only way to end the loop."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    return stop
