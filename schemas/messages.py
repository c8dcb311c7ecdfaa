"""The wire contract: the message kinds of docs/architecture.md (and the anchor request) and their MessagePack codec.

Every message is a MessagePack map carrying `v` (schema version) and `kind`. Per-token arrays
travel as raw little-endian bytes whose dtype the schema fixes, and decode into numpy views over
those bytes (no Python lists on the hot path). Decoding is strict and bounded: anything unexpected
raises `SchemaError` naming the offending field. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack
import numpy as np

from schemas.fields import (DEFAULT_LIMITS, TOKEN_ARRAYS, Limits, SchemaError, as_le, binary, integer, mapping,
                            number, number_map, optional_integer, required, string, token_array, turn_rewards_field)

SCHEMA_VERSION = 3  # 2: typed per-turn rewards and sampling settings on trajectories; 3: tool counts
READS = (2, 3)
"""Versions this build decodes: a version-2 trajectory has no tool counts (read as 0)."""

TRUNCATED = ("length", "context")
"""Finish reasons of an episode cut short by a token budget: its last turn by `--max-tokens`, or
the whole at the context window or `--max-episode-tokens`. The learner trains them under its
overlong policy (`--update.overlong`)."""

__all__ = ["DEFAULT_LIMITS", "TOKEN_ARRAYS", "Limits", "SchemaError", "SCHEMA_VERSION", "Prompt", "Trajectory",
           "Reward", "Weights", "DeadLetter", "AnchorRequest", "Evaluation", "KINDS", "Message", "decode"]


def _now() -> float:
    return time.time()


# ---------------------------------------------------------------------------- messages


class _Message:
    kind: ClassVar[str]

    def _fields(self) -> dict:
        raise NotImplementedError

    def encode(self) -> bytes:
        body = {"v": SCHEMA_VERSION, "kind": self.kind, **self._fields()}
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes, limits: Limits = DEFAULT_LIMITS):
        msg = decode(data, limits)
        if not isinstance(msg, cls):
            raise SchemaError("kind", f"expected {cls.kind!r}, got {msg.kind!r}")
        return msg


@dataclass(kw_only=True, eq=False)
class Prompt(_Message):
    """A task for a producer; `task` is the environment's own map."""

    kind: ClassVar[str] = "prompt"
    id: str
    """Stable per task (a dataset row keeps its id across epochs: running means key on it)."""
    env: str
    task: dict = field(default_factory=dict)
    created_at: float = field(default_factory=_now)
    attempt: int = 0
    """Which publication of this task (the epoch): a new attempt is a new trajectory, not a duplicate."""
    sample: int = 0
    """Index of this rollout within its group, 0 ≤ sample < group_size."""
    group_size: int = 1
    """Rollouts published for this (id, attempt): G for group baselines, 1 for SAO."""

    @property
    def key(self) -> bytes:
        return self.id.encode()

    @property
    def group(self) -> str:
        """The G rollouts of one publication share it; the learner's group baselines key on it."""
        return f"{self.id}#{self.attempt}"

    @property
    def trajectory_id(self) -> str:
        """A redelivered prompt yields the same id, which is how the learner drops duplicates."""
        return f"{self.group}.{self.sample}"

    def _fields(self) -> dict:
        return {"id": self.id, "env": self.env, "task": self.task,
                "created_at": float(self.created_at), "attempt": self.attempt,
                "sample": self.sample, "group_size": self.group_size}

    @classmethod
    def _from_map(cls, m: dict, limits: Limits) -> Prompt:
        group_size = integer(m, "group_size", lo=1)
        sample = integer(m, "sample", lo=0)
        if sample >= group_size:
            raise SchemaError("sample", f"{sample} is not below group_size {group_size}")
        return cls(id=string(m, "id", limits), env=string(m, "env", limits), task=mapping(m, "task", limits),
                   created_at=number(m, "created_at"), attempt=integer(m, "attempt", lo=0),
                   sample=sample, group_size=group_size)


@dataclass(kw_only=True, eq=False)
class Trajectory(_Message):
    """One finished episode with the rollout engine's per-token log-probs (docs/algorithm.md §2).

    `versions` holds the weight version that sampled each action token and -1 elsewhere;
    `reward` is None while a live reward stream has yet to score it.
    """

    kind: ClassVar[str] = "trajectory"
    id: str
    prompt_id: str
    env: str
    producer_id: str
    tokens: np.ndarray  # (T,) int32
    action_mask: np.ndarray  # (T,) uint8, 1 where the policy sampled the token
    rollout_logprobs: np.ndarray  # (T,) float32, finite on action tokens
    versions: np.ndarray  # (T,) int32, -1 off actions
    prompt_len: int
    reward: float | None = None
    group: str = ""
    """Shared by the rollouts of one prompt publication (`Prompt.group`); "" for none."""
    group_size: int = 1
    """How many rollouts share `group`; the learner trains a group only whole."""
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    """Rewards of earlier turns as (token_index, reward): the index of the last action token of
    that turn, where the learner places it (docs/algorithm.md §4); the final turn's reward is `reward`."""
    temperature: float = 1.0
    """Sampling temperature T of every action token; the learner recomputes at the same T."""
    top_p: float = 1.0
    """Nucleus truncation used when sampling (1.0: none)."""
    top_k: int = 0
    """Top-k truncation used when sampling (0: none)."""
    finish_reason: str = "stop"
    """Why the episode ended: stop (the model's last turn ended), length (it reached --max-tokens),
    context (the episode reached its token budget), max_turns, invalid_calls, deadline (the env's
    limits), truncated (a proxy session closed unfinished)."""
    num_turns: int = 1
    tool_calls: int = 0
    """Tool calls the model made over the episode."""
    tool_errors: int = 0
    """Of them, those that failed (malformed, unknown tool, bad arguments, the tool raised)."""
    timing: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    """Free-form; never read by the learner."""

    def __post_init__(self):
        for name in TOKEN_ARRAYS:
            setattr(self, name, as_le(getattr(self, name), name))

    @property
    def key(self) -> bytes:
        return self.id.encode()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def min_version(self) -> int:
        """Oldest weight version that sampled any action token (docs/algorithm.md §6); -1 if no actions."""
        acted = self.versions[self.action_mask.astype(bool)]
        return int(acted.min()) if acted.size else -1

    def _fields(self) -> dict:
        return {"id": self.id, "prompt_id": self.prompt_id, "env": self.env,
                "producer_id": self.producer_id,
                # byte views, not copies: msgpack packs any buffer as bin
                **{name: memoryview(np.ascontiguousarray(getattr(self, name))).cast("B")
                   for name in TOKEN_ARRAYS},
                "prompt_len": self.prompt_len,
                "reward": None if self.reward is None else float(self.reward),
                "group": self.group, "group_size": self.group_size,
                "turn_rewards": [[int(i), float(r)] for i, r in self.turn_rewards],
                "temperature": float(self.temperature), "top_p": float(self.top_p), "top_k": int(self.top_k),
                "finish_reason": self.finish_reason, "num_turns": self.num_turns,
                "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "timing": self.timing, "meta": self.meta}

    @classmethod
    def _from_map(cls, m: dict, limits: Limits) -> Trajectory:
        arrays = {name: token_array(m, name, limits) for name in TOKEN_ARRAYS}
        n = len(arrays["tokens"])
        for name, a in arrays.items():
            if len(a) != n:
                raise SchemaError(name, f"length {len(a)} differs from tokens' {n}")
        prompt_len = integer(m, "prompt_len", lo=0)
        if prompt_len > n:
            raise SchemaError("prompt_len", f"{prompt_len} exceeds the sequence length {n}")
        mask = arrays["action_mask"]
        if mask.size and mask.max() > 1:
            raise SchemaError("action_mask", "values must be 0 or 1")
        # Whole-array element-wise checks, a few passes each: boolean indexing would copy, and
        # this is the decode hot path (bench/codec.py).
        acted = mask.view(np.bool_)  # zero-copy: the bytes are 0 or 1
        if acted[:prompt_len].any():
            raise SchemaError("action_mask", "action token inside the prompt")
        # acted > finite is True exactly on action tokens with a NaN or infinite log-prob
        if np.greater(acted, np.isfinite(arrays["rollout_logprobs"])).any():
            raise SchemaError("rollout_logprobs", "non-finite log-prob on an action token")
        versions = arrays["versions"]
        if versions.size and not (((versions >= 0) == acted).all() and versions.min() >= -1):
            raise SchemaError("versions", "must be >= 0 on action tokens and -1 elsewhere")
        temperature, top_p = number(m, "temperature"), number(m, "top_p")
        if not temperature > 0:
            raise SchemaError("temperature", f"must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise SchemaError("top_p", f"must be in (0, 1], got {top_p}")
        return cls(id=string(m, "id", limits), prompt_id=string(m, "prompt_id", limits),
                   env=string(m, "env", limits), producer_id=string(m, "producer_id", limits),
                   **arrays, prompt_len=prompt_len,
                   reward=number(m, "reward", nullable=True),
                   group=string(m, "group", limits), group_size=integer(m, "group_size", lo=1),
                   turn_rewards=turn_rewards_field(m, acted, limits),
                   temperature=temperature, top_p=top_p, top_k=integer(m, "top_k", lo=0),
                   finish_reason=string(m, "finish_reason", limits),
                   num_turns=integer(m, "num_turns", lo=0),
                   **({"tool_calls": integer(m, "tool_calls", lo=0), "tool_errors": integer(m, "tool_errors", lo=0)}
                      if m["v"] >= 3 else {}),
                   timing=mapping(m, "timing", limits), meta=mapping(m, "meta", limits))


@dataclass(kw_only=True, eq=False)
class Reward(_Message):
    """A live reward for a trajectory waiting on `sao.trajectories.pending`."""

    kind: ClassVar[str] = "reward"
    trajectory_id: str
    reward: float
    token_index: int | None = None
    """None: the outcome reward; else a per-turn reward on this action token (merged into
    `Trajectory.turn_rewards`)."""
    source: str = "cli"
    criterion: str = ""
    created_at: float = field(default_factory=_now)

    @property
    def key(self) -> bytes:
        return self.trajectory_id.encode()

    def _fields(self) -> dict:
        return {"trajectory_id": self.trajectory_id, "reward": float(self.reward),
                "token_index": self.token_index, "source": self.source, "criterion": self.criterion,
                "created_at": float(self.created_at)}

    @classmethod
    def _from_map(cls, m: dict, limits: Limits) -> Reward:
        return cls(trajectory_id=string(m, "trajectory_id", limits), reward=number(m, "reward"),
                   token_index=optional_integer(m, "token_index", lo=0), source=string(m, "source", limits),
                   criterion=string(m, "criterion", limits),
                   created_at=number(m, "created_at"))


@dataclass(kw_only=True, eq=False)
class Weights(_Message):
    """Announcement of a new policy version: an anchor (`base` -1, the whole state) or a delta onto
    version `base`, its payload (schemas/weights/payload.py) at `uri` or inline in `payload`, and the
    `digest` of the state it results in (what every receiver checks, whatever carried the bytes)."""

    kind: ClassVar[str] = "weights"
    version: int
    step: int
    digest: str
    """schemas.weights.digest of the resulting state: blake3 over each tensor's name, dtype, shape, checksum."""
    num_bytes: int
    """Size of the payload."""
    base: int = -1
    """-1: an anchor; else the version the delta applies onto (and only onto)."""
    uri: str = ""
    """`file://` uri of the payload; "" when it is inline."""
    payload: bytes = b""
    """The payload itself, when small enough (`--weights.inline-bytes`); b"" when at `uri`."""
    store: str = ""
    """`file://` uri of the learner's weight store folder (config.json, model.json), "" if unshared."""
    dtype: str = "bfloat16"
    format: str = "safetensors"
    created_at: float = field(default_factory=_now)
    key_id: str = ""
    """Id of the learner's key that signed it; "" unsigned (schemas/signing.py)."""
    signature: bytes = b""
    """Ed25519 signature over the fields that decide what is loaded (schemas/signing.py)."""

    @property
    def key(self) -> bytes:
        return str(self.version).encode()

    @property
    def inline(self) -> bool:
        return not self.uri

    def _fields(self) -> dict:
        return {"version": self.version, "step": self.step, "created_at": float(self.created_at),
                "base": self.base, "uri": self.uri, "payload": self.payload, "store": self.store,
                "format": self.format, "digest": self.digest, "num_bytes": self.num_bytes, "dtype": self.dtype,
                "key_id": self.key_id, "signature": self.signature}

    @classmethod
    def _from_map(cls, m: dict, limits: Limits) -> Weights:
        digest = string(m, "digest", limits)
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise SchemaError("digest", "expected 64 lowercase hex digits")
        fmt = string(m, "format", limits)
        if fmt != "safetensors":
            raise SchemaError("format", f"unsupported weight format {fmt!r}")
        version, base = integer(m, "version", lo=0), integer(m, "base", lo=-1)
        if base >= version:
            raise SchemaError("base", f"a delta applies onto an older version, got {base} for {version}")
        uri, payload, num_bytes = string(m, "uri", limits), binary(m, "payload", limits), integer(m, "num_bytes", lo=0)
        if bool(uri) == bool(payload):
            raise SchemaError("payload", "exactly one of uri and payload must be set")
        if payload and len(payload) != num_bytes:
            raise SchemaError("payload", f"{len(payload)} bytes, announced {num_bytes}")
        # announcements written before signing existed have neither field: unsigned
        signed = ({"key_id": string(m, "key_id", limits), "signature": binary(m, "signature", limits)}
                  if "signature" in m or "key_id" in m else {})
        return cls(version=version, step=integer(m, "step", lo=0), digest=digest, num_bytes=num_bytes,
                   base=base, uri=uri, payload=payload, store=string(m, "store", limits),
                   dtype=string(m, "dtype", limits), format=fmt, created_at=number(m, "created_at"), **signed)


@dataclass(kw_only=True, eq=False)
class AnchorRequest(_Message):
    """A producer's request, on `sao.weights.requests`, that the learner's next publication be an
    anchor: from what it holds it cannot reach the newest version announced (a delta refused or
    its file gone, and no later anchor yet)."""

    kind: ClassVar[str] = "anchor_request"
    requester: str
    """Who asks (a producer id, or host-pid); the message key."""
    held_version: int
    """The version its engine serves (-1: none yet)."""
    wanted_version: int
    """The newest version announced, which it cannot reach."""
    reason: str = ""
    created_at: float = field(default_factory=_now)

    @property
    def key(self) -> bytes:
        return self.requester.encode()

    def _fields(self) -> dict:
        return {"requester": self.requester, "held_version": self.held_version,
                "wanted_version": self.wanted_version, "reason": self.reason, "created_at": float(self.created_at)}

    @classmethod
    def _from_map(cls, m: dict, limits: Limits) -> AnchorRequest:
        return cls(requester=string(m, "requester", limits), held_version=integer(m, "held_version", lo=-1),
                   wanted_version=integer(m, "wanted_version", lo=0), reason=string(m, "reason", limits),
                   created_at=number(m, "created_at"))


@dataclass(kw_only=True, eq=False)
class DeadLetter(_Message):
    """A message some service could not use, kept with its original bytes and where it came from."""

    kind: ClassVar[str] = "dead_letter"
    source_topic: str
    partition: int
    offset: int
    error: str
    payload: bytes
    created_at: float = field(default_factory=_now)

    def _fields(self) -> dict:
        return {"source_topic": self.source_topic, "partition": self.partition,
                "offset": self.offset, "error": self.error, "payload": self.payload,
                "created_at": float(self.created_at)}

    @classmethod
    def _from_map(cls, m: dict, limits: Limits) -> DeadLetter:
        return cls(source_topic=string(m, "source_topic", limits),
                   partition=integer(m, "partition", lo=-1), offset=integer(m, "offset", lo=-1001),
                   error=string(m, "error", limits), payload=binary(m, "payload", limits),
                   created_at=number(m, "created_at"))


@dataclass(kw_only=True, eq=False)
class Evaluation(_Message):
    """The score of one weight version on one environment's evaluation tasks (`sao eval`): every
    episode behind it was sampled by exactly `version`, so a score belongs to one policy."""

    kind: ClassVar[str] = "evaluation"
    version: int
    step: int
    """The learner step that produced `version` (its announcement's)."""
    env: str
    suite: str
    """The evaluation's name (`sao eval --name`): one task set and one set of settings."""
    split: str
    """heldout: tasks the feeder never trains on; all: any task, which training may see too."""
    num_tasks: int
    samples: int
    """Sampled episodes per task (k); 0: greedy only."""
    metrics: dict[str, float]
    """Named figures: `greedy/mean`, `sampled/pass@k`, ... (producers/evaluate/scores.py)."""
    evaluator: str = ""
    seconds: float = 0.0
    """Wall time of the evaluation, loading the version included."""
    created_at: float = field(default_factory=_now)

    @property
    def key(self) -> bytes:
        return f"{self.suite}/{self.env}/{self.version}".encode()

    def _fields(self) -> dict:
        return {"version": self.version, "step": self.step, "env": self.env, "suite": self.suite,
                "split": self.split, "num_tasks": self.num_tasks, "samples": self.samples,
                "metrics": {k: float(x) for k, x in self.metrics.items()}, "evaluator": self.evaluator,
                "seconds": float(self.seconds), "created_at": float(self.created_at)}

    @classmethod
    def _from_map(cls, m: dict, limits: Limits) -> Evaluation:
        return cls(version=integer(m, "version", lo=0), step=integer(m, "step", lo=0), env=string(m, "env", limits),
                   suite=string(m, "suite", limits), split=string(m, "split", limits),
                   num_tasks=integer(m, "num_tasks", lo=1), samples=integer(m, "samples", lo=0),
                   metrics=number_map(m, "metrics", limits), evaluator=string(m, "evaluator", limits),
                   seconds=number(m, "seconds"), created_at=number(m, "created_at"))


KINDS: dict[str, type[_Message]] = {c.kind: c for c in (Prompt, Trajectory, Reward, Weights, DeadLetter,
                                                        AnchorRequest, Evaluation)}
_FIELD_NAMES = {c: {"v", "kind", *(f.name for f in dataclasses.fields(c))} for c in KINDS.values()}
_SINCE_3 = {"tool_calls", "tool_errors", "key_id", "signature"}
Message = Prompt | Trajectory | Reward | Weights | DeadLetter | AnchorRequest | Evaluation


def decode(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode any message kind, strictly; raises SchemaError naming the field at fault."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError("<message>", f"expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise SchemaError("<message>", f"{len(data)} bytes exceeds the limit of {limits.max_message_bytes}")
    try:
        # Every length limit is bounded by the payload itself, so a header that claims a huge
        # container or blob fails before anything is allocated.
        m = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True,
            max_str_len=min(len(data), limits.max_str_bytes),
            max_bin_len=len(data), max_array_len=len(data),
            max_map_len=min(len(data), limits.max_map_entries), max_ext_len=0)
    except msgpack.ExtraData:
        raise SchemaError("<message>", "trailing bytes after the message") from None
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise SchemaError("<message>", f"not valid MessagePack ({type(e).__name__}: {e})") from None
    if not isinstance(m, dict):
        raise SchemaError("<message>", f"expected a map, got {type(m).__name__}")
    v = integer(m, "v")
    if v not in READS:
        raise SchemaError("v", f"unknown schema version {v} (this build reads {READS})")
    kind = required(m, "kind")
    if kind not in KINDS:
        raise SchemaError("kind", f"unknown message kind {kind!r}")
    cls = KINDS[kind]
    unknown = m.keys() - (_FIELD_NAMES[cls] - _SINCE_3 if v < 3 else _FIELD_NAMES[cls])
    if unknown:
        raise SchemaError(sorted(unknown)[0], f"unknown field in a {kind!r} message")
    return cls._from_map(m, limits)
