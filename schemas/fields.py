"""The codec's building blocks: the one error type, the decoder's bounds, the per-token dtypes, and
one reader per field type. Each reader takes the decoded map and a field name and returns the value
or raises SchemaError naming the field; schemas/messages.py composes them into the message kinds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.topics import MAX_MESSAGE_BYTES

# Per-token arrays and their fixed little-endian dtypes.
TOKEN_ARRAYS: dict[str, np.dtype] = {
    "tokens": np.dtype("<i4"),
    "action_mask": np.dtype("u1"),
    "rollout_logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
}


class SchemaError(ValueError):
    """The one error type decoding and validation raise; `field` names what was wrong."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Bounds on what a decoder accepts, so a few-byte message can never allocate gigabytes."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Largest encoded message."""
    max_tokens: int = 1 << 20
    """Longest trajectory in tokens."""
    max_str_bytes: int = 1 << 16
    """Longest string field (ids, errors, uris)."""
    max_map_entries: int = 256
    """Most entries in a free-form map (`task`, `timing`, `meta`)."""
    max_turn_rewards: int = 4096
    """Most per-turn rewards on one trajectory."""


DEFAULT_LIMITS = Limits()


def required(m: dict, name: str) -> Any:
    if name not in m:
        raise SchemaError(name, "missing field")
    return m[name]


def typed(m: dict, name: str, kind: type | tuple[type, ...], label: str) -> Any:
    """The field's value, which must be a `kind` and never a bool (bool is an int to Python, not to
    the wire contract)."""
    v = required(m, name)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise SchemaError(name, f"expected {label}, got {type(v).__name__}")
    return v


def sized(v: Any, name: str, most: int, unit: str) -> Any:
    if len(v) > most:
        raise SchemaError(name, f"more than {most} {unit}")
    return v


def string(m: dict, name: str, limits: Limits) -> str:
    return sized(typed(m, name, str, "str"), name, limits.max_str_bytes, "characters")


def integer(m: dict, name: str, lo: int | None = None) -> int:
    v = typed(m, name, int, "int")
    if lo is not None and v < lo:
        raise SchemaError(name, f"must be >= {lo}, got {v}")
    return v


def optional_integer(m: dict, name: str, lo: int | None = None) -> int | None:
    return None if required(m, name) is None else integer(m, name, lo)


def number(m: dict, name: str, *, nullable: bool = False, finite: bool = True) -> float | None:
    if nullable and required(m, name) is None:
        return None
    v = float(typed(m, name, (int, float), "float"))
    if finite and not math.isfinite(v):
        raise SchemaError(name, f"must be finite, got {v}")
    return v


def mapping(m: dict, name: str, limits: Limits) -> dict:
    v = sized(typed(m, name, dict, "map"), name, limits.max_map_entries, "entries")
    if not all(isinstance(k, str) for k in v):
        raise SchemaError(name, "map keys must be str")
    return v


def number_map(m: dict, name: str, limits: Limits) -> dict[str, float]:
    """A map of str to finite numbers (a result's named figures)."""
    v = mapping(m, name, limits)
    for key, x in v.items():
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
            raise SchemaError(f"{name}.{key}", f"expected a finite number, got {x!r:.40}")
    return {k: float(x) for k, x in v.items()}


def binary(m: dict, name: str, limits: Limits) -> bytes:
    return typed(m, name, bytes, "bytes")


def token_array(m: dict, name: str, limits: Limits) -> np.ndarray:
    raw = binary(m, name, limits)
    dtype = TOKEN_ARRAYS[name]
    if len(raw) % dtype.itemsize:
        raise SchemaError(name, f"{len(raw)} bytes is not a whole number of {dtype} items")
    n = len(raw) // dtype.itemsize
    if n > limits.max_tokens:
        raise SchemaError(name, f"{n} tokens exceeds the limit of {limits.max_tokens}")
    return np.frombuffer(raw, dtype=dtype)  # a read-only view: no copy


def turn_rewards_field(m: dict, acted: np.ndarray, limits: Limits) -> list[tuple[int, float]]:
    """`turn_rewards`: [[token_index, reward], ...], each index on an action token, each reward
    finite; the learner adds them to the token rewards without looking again (docs/algorithm.md §4)."""
    v = sized(typed(m, "turn_rewards", list, "a list"), "turn_rewards", limits.max_turn_rewards, "entries")
    out = []
    for i, pair in enumerate(v):
        name = f"turn_rewards[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise SchemaError(name, "expected a [token_index, reward] pair")
        index, reward = integer({name: pair[0]}, name, lo=0), number({name: pair[1]}, name)
        if index >= len(acted) or not acted[index]:
            raise SchemaError(name, f"token index {index} is not an action token")
        out.append((index, reward))
    return out


def as_le(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    dtype = TOKEN_ARRAYS[name]
    if a.ndim != 1:
        raise SchemaError(name, f"expected a 1-D array, got shape {a.shape}")
    if a.dtype != dtype:
        if a.size and not np.can_cast(a.dtype, dtype, casting="same_kind"):
            raise SchemaError(name, f"cannot store {a.dtype} as {dtype}")
        a = a.astype(dtype)
    return a
