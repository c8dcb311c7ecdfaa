"""From announcements to a verified state: which updates to apply (`plan`, over the history `prune`
keeps), reading one (`fetch`), applying a chain onto a held state (`rebuild`), and the tensors an
engine loads (`engine_state`).

A delta applies only onto its base version; every resulting tensor is checked against the
checksum its payload lists, and the whole state against the announcement's `digest`, before
anything is handed to an engine. A state is never modified in place: a failed link leaves the
state before it whole. LoRA runs publish the base weights with `*.lora_A.weight` and
`*.lora_B.weight` adapters beside them; engines get the merged weights `W + scale · B @ A`, so
both backends serve base + adapter with their ordinary loading path.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch

from schemas.messages import SchemaError, Weights
from schemas.weights import payload as W


class WeightsError(ValueError):
    """An announced update that cannot be used: its payload unreadable, of another size, or not
    verifying (SchemaError's message says which tensor)."""


def local_path(uri: str) -> Path:
    """The path of a `file:///abs/path` uri."""
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise WeightsError(f"unsupported weights uri {uri!r}: only file:///abs/path is supported")
    return Path(unquote(parsed.path))


def plan(history: list[Weights], held: int, bad: set[int] = frozenset()) -> list[Weights]:
    """The updates to apply, in order, to reach the newest version reachable: from the version whose
    state is held (`held`, -1 for none) along the deltas whose base is the previous link, or from
    an anchor and the chain after it; the shortest way to the newest end, [] if none goes past
    `held`. Announcements in `bad` (they failed) are never used; for a version announced twice
    the later announcement counts."""
    by_version = {w.version: w for w in history if w.version not in bad}
    after = {w.base: w for w in sorted(by_version.values(), key=lambda w: w.version) if w.base >= 0}

    def chain(start: int) -> list[Weights]:
        links = []
        while start in after:
            links.append(after[start])
            start = links[-1].version
        return links

    options = ([chain(held)] if held >= 0 else []) + [[a, *chain(a.version)] for a in by_version.values() if a.base < 0]
    best = max(options, key=lambda c: (c[-1].version if c else held, -len(c)), default=[])
    return best if best and best[-1].version > held else []


def prune(history: list[Weights], keep_anchors: int) -> list[Weights]:
    """`history` from its `keep_anchors`-th newest anchor on: what any chain to a version worth
    loading can start from."""
    anchors = [i for i, x in enumerate(history) if x.base < 0]
    return history[anchors[-keep_anchors]:] if len(anchors) > keep_anchors else history


def fetch(w: Weights) -> tuple[W.Payload, dict[str, memoryview]]:
    """The decoded payload of `w`: inline, or its file mapped into memory (tensors stay views of
    the mapping, which outlives the file's deletion by the learner's pruning)."""
    if w.inline:
        return W.decode(w.payload)
    path = local_path(w.uri)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != w.num_bytes:
                raise WeightsError(f"version {w.version}: {path} has {size} bytes, announced {w.num_bytes}")
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise WeightsError(f"version {w.version}: cannot read {path}: {e}") from None
    return W.decode(data)


@dataclass(kw_only=True)
class Rebuilt:
    """A verified state and the version it is; `extra` is the payload's plain data (LoRA scale)."""

    version: int
    state: W.State
    extra: dict = field(default_factory=dict)


def apply_one(w: Weights, base: Rebuilt | None) -> Rebuilt:
    """`w` applied onto `base` (None for an anchor), verified tensor by tensor and as a whole."""
    if w.base >= 0 and (base is None or base.version != w.base):
        raise WeightsError(f"version {w.version} is a delta onto {w.base}, not onto the held "
                           f"{base.version if base else 'nothing'}")
    try:
        payload, views = fetch(w)
        if payload.base != w.base:
            raise WeightsError(f"version {w.version}: the payload applies onto {payload.base}, announced {w.base}")
        state = W.apply(payload, views, base.state if w.base >= 0 else None)
    except SchemaError as e:
        raise WeightsError(f"version {w.version}: {e}") from None
    if (got := W.digest(state)) != w.digest:
        raise WeightsError(f"version {w.version}: state digest {got} != announced {w.digest}")
    return Rebuilt(version=w.version, state=state, extra=payload.extra)


def rebuild(chain: list[Weights], held: Rebuilt | None) -> tuple[Rebuilt | None, Weights | None, Exception | None]:
    """Apply `chain` link by link: (the last state that verified, or None; the link that failed,
    or None; its error). The held state is the start of a chain of deltas, never modified."""
    state = held if chain and chain[0].base >= 0 else None
    done = None
    for w in chain:
        try:
            state = done = apply_one(w, state)
        except WeightsError as e:
            return done, w, e
    return done, None, None


def adapter(name: str) -> bool:
    """A LoRA adapter's tensor, which engines never get (`merged` folds it into its module)."""
    return ".lora_A." in name or ".lora_B." in name


def merged(state: W.State, scale: float) -> W.State:
    """The plain weights of a LoRA state: `W + scale · B @ A` for every module with adapters,
    computed in float32 and cast back; the adapters themselves dropped."""
    out = {}
    for name, t in state.items():
        if adapter(name):
            continue
        module = name.removesuffix(".weight")
        a, b = state.get(f"{module}.lora_A.weight"), state.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            out[name] = t
            continue
        base = W.to_torch(t)
        delta = W.to_torch(b).float() @ W.to_torch(a).float()  # (out, r) @ (r, in)
        out[name] = W.from_torch((base.float() + scale * delta).to(base.dtype))
    return out


def engine_state(state: Rebuilt) -> dict[str, torch.Tensor]:
    """The tensors an engine loads for `state` (`Engine.load_state`): its plain weights, merged if
    it holds LoRA adapters, as torch tensors over the state's own memory where nothing is computed."""
    tensors = merged(state.state, float(state.extra["lora_scale"])) if "lora_scale" in state.extra else state.state
    return {name: W.to_torch(t) for name, t in tensors.items()}


def engine_shapes(state: Rebuilt) -> dict[str, tuple[int, ...]]:
    """The names and shapes of `engine_state(state)`, computing no tensor (a merge keeps shapes)."""
    return {name: t.shape for name, t in state.state.items() if not adapter(name)}
