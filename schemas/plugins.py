"""Plug-ins: user code named on the command line as `module:attr`, or by an installed package's
entry point, resolved in one place so producers, the feeder and the judge fail alike.

A plug-in that cannot be used is a ConfigError naming the flag, raised at start: a module that does
not import (whatever it raises while importing), a missing attribute, something not callable, a
function whose parameters cannot take the arguments it will be called with.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from importlib.metadata import entry_points

from schemas.config import ConfigError


def load_object(spec: str, flag: str) -> object:
    """The object `spec` = `package.module:attr` (attr may be dotted) names."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"{flag} {spec!r}: expected module:attribute, e.g. mypkg.envs:MyEnv")
    if os.getcwd() not in sys.path:  # as `python -m` would: the `sao` script puts only its own folder there
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # the user's module may raise anything while importing
        raise ConfigError(f"{flag} {spec!r}: cannot import {module}: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{flag} {spec!r}: module {module} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_callable(spec: str, flag: str, args: tuple[str, ...]) -> object:
    """`load_object`, which must be callable with the positional arguments named `args`."""
    obj = load_object(spec, flag)
    if not callable(obj):
        raise ConfigError(f"{flag} {spec!r}: a {type(obj).__name__}, not a class or function")
    try:
        inspect.signature(obj).bind(*args)
    except TypeError as e:
        raise ConfigError(f"{flag} {spec!r}: cannot be called as {spec.partition(':')[2]}({', '.join(args)}): {e}") from e
    except ValueError:  # no signature to read (some builtins): the call will tell
        pass
    return obj


def entry_point(group: str, name: str) -> str | None:
    """The `module:attr` an installed package registers as `name` in entry-point group `group`."""
    found = entry_points(group=group).select(name=name)
    return next(iter(found)).value if found else None


def entry_point_names(group: str) -> list[str]:
    return sorted(ep.name for ep in entry_points(group=group))
