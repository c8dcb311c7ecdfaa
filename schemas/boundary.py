"""The plug-in boundary: how a service calls environment, reward and judge plug-ins, enforced.

A plug-in is someone else's code inside a producer, the feeder or a judge, so whatever it does to
one episode costs that episode's prompt alone (dead-lettered with the plug-in's name and the
reason, its offset committed), never the service or the other episodes in flight. Here, not in a
service package, because producers and consumers both call plug-ins under the same rules:

- a call may raise anything, `SystemExit` and `KeyboardInterrupt` included: `PluginError`;
- a call is bounded in time (`--env-step-timeout`): one that takes longer is abandoned. It runs
  in a daemon thread of its own, which the producer neither waits for nor joins at exit (Python
  cannot stop a thread; a pool's threads would be waited for at exit and would run out);
- token ids it hands back (prompt, observations) are integers in `[0, vocab)`;
- the trajectory fits the model's context window and the codec's token limit: an observation
  that would overflow them is refused, and each turn samples at most what room is left;
- rewards (per turn and final) are finite real numbers, or None where the contract allows it.

The producer's own shutdown is not the plug-in's to stop: cancellation of the awaiting episode
(SIGTERM, a revoked partition) passes through untouched.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from schemas.messages import DEFAULT_LIMITS, SchemaError

R = TypeVar("R")


class PluginError(SchemaError):
    """A plug-in broke the contract on one episode; `field` names the call or value (`env.step`,
    `env.step.reward`, ...), the message the plug-in and what it did."""


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """What a plug-in's results must fit, from the model the producer samples with."""

    plugin: str
    """How the plug-in was named (`--env` or `--reward`), for the dead letter's reason."""
    vocab_size: int | None = None
    """Token ids must be below this (None: the model's vocabulary is the server's; int32 then)."""
    max_tokens: int = DEFAULT_LIMITS.max_tokens
    """Most tokens of a trajectory: the context window, within the codec's limit."""
    timeout_s: float = 120.0
    """Seconds one call may take before it is abandoned."""

    def fail(self, what: str, problem: str) -> PluginError:
        return PluginError(what, f"{problem} ({self.plugin})")


def _launch(bounds: Bounds, what: str, fn: Callable[..., R], args: tuple) -> Future:
    """`fn(*args)` started in a daemon thread; the future holds its result, or the PluginError
    for anything it raised but our own SchemaError."""
    done: Future = Future()

    def target() -> None:
        try:
            result, error = fn(*args), None
        except SchemaError as e:  # already says which rule it broke
            result, error = None, e
        except BaseException as e:  # noqa: BLE001 - the boundary: SystemExit too costs one episode
            result, error = None, bounds.fail(what, f"{type(e).__name__}: {e}")
        if done.set_running_or_notify_cancel():  # else abandoned (timed out, or its episode cancelled)
            done.set_exception(error) if error is not None else done.set_result(result)

    threading.Thread(target=target, name=f"plugin-{what}", daemon=True).start()
    return done


def _abandoned(bounds: Bounds, what: str) -> PluginError:
    return bounds.fail(what, f"no answer within {bounds.timeout_s:g} s (--env-step-timeout); abandoned")


async def call(bounds: Bounds, what: str, fn: Callable[..., R], *args) -> R:
    """`fn(*args)` in a daemon thread, awaited within `bounds.timeout_s`; PluginError for anything
    it raises but our own SchemaError, or for no answer in time."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(_launch(bounds, what, fn, args)), bounds.timeout_s)
    except TimeoutError:
        raise _abandoned(bounds, what) from None


def call_sync(bounds: Bounds, what: str, fn: Callable[..., R], *args) -> R:
    """`call` for a caller without an event loop (the feeder)."""
    try:
        return _launch(bounds, what, fn, args).result(bounds.timeout_s)
    except TimeoutError:
        raise _abandoned(bounds, what) from None


def token_ids(bounds: Bounds, what: str, ids: Sequence) -> list[int]:
    """`ids` as a list of ints, each in [0, vocab); PluginError naming the first that is not."""
    limit = bounds.vocab_size or 1 << 31
    try:
        out = list(ids)
    except TypeError:
        raise bounds.fail(what, f"expected a list of token ids, got {type(ids).__name__}") from None
    if len(out) > bounds.max_tokens:  # before looking at each: a plug-in may return millions
        raise bounds.fail(what, f"{len(out)} tokens: more than a trajectory may hold ({bounds.max_tokens}, "
                                f"the context window)")
    for t in out:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise bounds.fail(what, f"expected int token ids, got {t!r:.40} ({type(t).__name__})")
        if not 0 <= t < limit:
            raise bounds.fail(what, f"token id {t} outside the vocabulary [0, {limit})")
    return [int(t) for t in out]


def reward(bounds: Bounds, what: str, value) -> float | None:
    """A reward as float, None kept; PluginError for anything but a finite real number."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise bounds.fail(what, f"expected a number or None, got a {type(value).__name__} ({value!r:.40})")
    if not math.isfinite(value):
        raise bounds.fail(what, f"expected a finite number, got {value}")
    return float(value)


def room(bounds: Bounds, what: str, used: int, adding: int) -> None:
    """PluginError unless `adding` more tokens leave room for at least one more action token."""
    if used + adding + 1 > bounds.max_tokens:
        raise bounds.fail(what, f"{adding} tokens after {used} leave no room for the model's next "
                                f"turn within {bounds.max_tokens} tokens (the context window)")
