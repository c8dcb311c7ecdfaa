"""Typed configuration: dataclasses with `SAO_*` environment variables as the layer under the flags.

A field `batch_size` of a service config reads `SAO_BATCH_SIZE`; a field `bootstrap` of its nested
`kafka` config reads `SAO_KAFKA_BOOTSTRAP`. Flags parsed by tyro override both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the variable or flag to change."""


@contextlib.contextmanager
def one_line_errors(prog: str):
    """A misconfiguration, found while parsing or while a service starts, ends the process with
    one line naming the setting and exit status 2, not a traceback (every entry point: `sao …`
    and the learner under torchrun)."""
    try:
        yield
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server on this machine (endpoints beyond it need a token)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _convert(raw: str, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw.lower() in ("", "none", "null") and len(args) < len(typing.get_args(tp)):
            return None
        return _convert(raw, args[0], name)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if raw not in choices:
            raise ConfigError(f"{name}={raw!r}: expected one of {choices}")
        return raw
    if tp is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(f"{name}={raw!r}: expected a boolean")
    if tp in (int, float, str, Path):
        try:
            return tp(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: expected {tp.__name__}") from None
    if origin in (tuple, list) or tp in (tuple, list):
        item = (typing.get_args(tp) or (str,))[0]
        return (tuple if origin is tuple else list)(
            _convert(x.strip(), item, name) for x in raw.split(",") if x.strip())
    raise ConfigError(f"{name}: cannot be set from the environment (type {tp})")


def from_env(cls: type[T], environ: Mapping[str, str] | None = None, prefix: str = "SAO_",
             base: T | None = None) -> T:
    """An instance of dataclass `cls` whose fields are overridden by `{prefix}{FIELD}` variables."""
    environ = os.environ if environ is None else environ
    base = cls() if base is None else base
    hints = typing.get_type_hints(cls)
    changes = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        name = f"{prefix}{f.name.upper()}"
        tp = hints[f.name]
        value = getattr(base, f.name)
        if dataclasses.is_dataclass(tp):
            changes[f.name] = from_env(tp, environ, name + "_", value)
        elif name in environ and typing.get_origin(tp) not in (dict, Mapping):
            changes[f.name] = _convert(environ[name], tp, name)
    return dataclasses.replace(base, **changes)


def parse(cls: type[T], args: Sequence[str] | None = None, description: str | None = None) -> T:
    """Flags over `SAO_*` variables over the dataclass defaults; `--help` shows field docstrings."""
    import tyro  # only the command line needs it

    return tyro.cli(cls, default=from_env(cls), args=args, description=description)
