"""The rollout proxy behind `sao serve`'s `/v1/chat/completions`: chat turns as exact token ids,
and sessions (episodes) of an external agent that become trajectories.

Token ids. The first turn is the model's chat template over the request's messages (and `tools`,
passed to the template), ending with the assistant header. A later turn of a session appends only
what the template adds after the conversation so far: the end of the last assistant turn (less
the stop token the model already sampled), the new messages (tool results, user turns) and the
next assistant header. The next prompt is the session's stored ids plus those, so every action
token in the trajectory is exactly as sampled, never decoded and re-tokenised (the drift behind
NeMo Gym 1416 and rllm 225). This needs a template that renders a conversation as a prefix of its
continuation, which `Chat` checks at start and each turn checks again.

History rule. A later turn must repeat the session's messages exactly as the proxy saw and
answered them (roles, text, tool calls with their ids and arguments), then add at least one
message and no assistant message (assistant turns are sampled, not written); anything else is a
400 naming the first differing message: a different history is a different episode, so a branch
opens a new session.

A session ends when the agent closes it (with a reward: onto `sao.trajectories`; without: onto
`sao.trajectories.pending`, where a reward posted later by receipt is joined by `sao reward-join`),
or when it has been idle for `idle_s`, then published to pending with finish_reason `truncated`.
The receipt is the trajectory id. A turn in flight keeps its session from closing or expiring.

With a journal folder, each session's state is written there after every turn (a whole file
replaced at once) and removed once the session is published, so a proxy restarted after a crash
or a SIGKILL takes its open sessions up where their last turn left them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np

from producers.serve.api import RequestError, check_context
from producers.envs.chat import Chat
from producers.envs.tools import render_chat
from producers.generate.base import Generation, SamplingParams
from schemas import topics as T
from schemas.files import atomic_file
from schemas.kafka import KafkaConfig, produce_and_wait
from schemas.messages import Trajectory

log = logging.getLogger(__name__)

def new_messages(known: list[dict], messages: list[dict]) -> list[dict]:
    """The messages added since the session's last turn; RequestError where the agent's history
    is not the session's (see the module docstring)."""
    for i, (was, now) in enumerate(zip(known, messages)):
        if was != now:
            raise RequestError(f"messages[{i}] differs from this session's history ({now['role']} message); "
                               "a different history is a new session")
    new = messages[len(known):]
    if len(messages) < len(known) or not new:
        raise RequestError("messages: expected this session's history plus at least one new message")
    if any(m["role"] == "assistant" for m in new):
        raise RequestError("messages: an assistant turn of a session must be sampled here, not sent")
    return new


@dataclass(eq=False, kw_only=True)
class Session:
    """One episode: its messages so far and its token spans (as `producers.episode` builds them)."""

    id: str
    params: SamplingParams
    tools: list | None
    prompt_id: str = ""
    messages: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    num_turns: int = 0
    finish_reason: str = "stop"
    generate_s: float = 0.0
    opened: float = field(default_factory=time.monotonic)
    used: float = field(default_factory=time.monotonic)
    busy: bool = False

    def add(self, ids, acted: bool, logprobs=None, versions=None) -> None:
        n = len(ids)
        self.tokens += [int(t) for t in ids]
        self.action_mask += [int(acted)] * n
        self.rollout_logprobs += [0.0] * n if logprobs is None else [float(x) for x in logprobs]
        self.versions += [-1] * n if versions is None else [int(v) for v in versions]

    def record(self) -> dict:
        """The session as plain data, for the journal; `from_record` reverses it."""
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("opened", "used", "busy")}
        return kept | {"params": dataclasses.asdict(self.params), "age_s": time.monotonic() - self.opened}

    @classmethod
    def from_record(cls, record: dict) -> Session:
        params = record.pop("params")
        age_s = record.pop("age_s")
        return cls(**record, params=SamplingParams(**params | {"stop_token_ids": tuple(params["stop_token_ids"])}),
                   opened=time.monotonic() - age_s)

    def trajectory(self, *, reward: float | None, finish_reason: str, producer_id: str, closed: str) -> Trajectory:
        return Trajectory(id=self.id, prompt_id=self.prompt_id, env="proxy", producer_id=producer_id,
                          tokens=np.array(self.tokens, np.int32), action_mask=np.array(self.action_mask, np.uint8),
                          rollout_logprobs=np.array(self.rollout_logprobs, np.float32),
                          versions=np.array(self.versions, np.int32), prompt_len=self.prompt_len, reward=reward,
                          temperature=self.params.temperature, top_p=self.params.top_p, top_k=self.params.top_k,
                          finish_reason=finish_reason, num_turns=self.num_turns,
                          timing={"generate_s": self.generate_s, "total_s": time.monotonic() - self.opened},
                          meta={"closed": closed})


class Sessions:
    """Open sessions by receipt id, behind one lock (the server runs each request in its own thread);
    a background thread publishes those idle for `idle_s` as truncated. `journal`: a folder where
    open sessions survive the process (see the module docstring); those found there are open."""

    def __init__(self, chat: Chat, publish: Callable[[Trajectory], str], *, context: int,
                 idle_s: float = 600.0, producer_id: str = "serve", max_open: int = 1024,
                 journal: Path | None = None):
        self.chat, self.publish, self.context = chat, publish, context
        self.idle_s, self.producer_id, self.max_open = idle_s, producer_id, max_open
        self.journal = journal
        self._open: dict[str, Session] = self._take_up() if journal is not None else {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="session-reaper", daemon=True)
        self._reaper.start()

    def render(self, messages: list[dict], tools, generation: bool) -> str:
        return render_chat(self.chat.tokenizer, messages, tools, generation)

    def begin(self, receipt: str | None, messages: list[dict], tools, params: SamplingParams,
              max_tokens: int | None, prompt_id: str | None = None) -> tuple[Session, list[int], SamplingParams]:
        """The session of a turn (receipt None: a turn outside any session; "new": open one), the
        prompt ids to sample from, and the params with the template's stop tokens and max_tokens
        (None: as many as fit the context). Marks the session busy until `finish` or `release`."""
        with self._lock:
            s = self._open.get(receipt) if receipt not in (None, "new") else None
            if receipt not in (None, "new") and s is None:
                raise RequestError(f"session {receipt!r}: not open (closed, expired or never opened)", 404)
            if s is not None and s.busy:
                raise RequestError(f"session {receipt!r}: a turn is already in flight", 409)
            if receipt == "new" and len(self._open) >= self.max_open:  # memory is bounded, not only by idling
                raise RequestError(f"{self.max_open} sessions are open (--max-sessions); close one or retry", 429)
            if s is None:
                s = Session(id=f"proxy-{uuid.uuid4().hex}" if receipt else "", params=params, tools=tools)
            elif (params.temperature, params.top_p, params.top_k) != (s.params.temperature, s.params.top_p,
                                                                       s.params.top_k):
                raise RequestError("temperature/top_p/top_k: must stay those of the session's first turn "
                                   "(a trajectory has one sampling distribution)")
            s.busy = True
        try:
            ids = self._prompt(s, messages, tools)
            n = max_tokens if max_tokens is not None else min(params.max_tokens, self.context - len(ids))
            check_context(len(ids), max(n, 1), self.context)
        except Exception:
            self.release(s)
            raise
        if s.id and not s.num_turns:
            s.prompt_id = prompt_id or "proxy/" + hashlib.sha256(np.array(ids, np.int32).tobytes()).hexdigest()[:16]
        stop = tuple(sorted({*params.stop_token_ids, *self.chat.stop_token_ids()}))
        return s, ids, SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                      max_tokens=n, stop_token_ids=stop, seed=params.seed)

    def _prompt(self, s: Session, messages: list[dict], tools) -> list[int]:
        if not s.num_turns:
            if messages[-1]["role"] == "assistant":
                raise RequestError("messages: the last message must not be the assistant's (no prefill)")
            return self.chat.encode(self.render(messages, tools, generation=True))
        if tools != s.tools:
            raise RequestError("tools: must stay those of the session's first turn")
        new = new_messages(s.messages, messages)
        before = self.render(s.messages, tools, generation=False)
        after = self.render(s.messages + new, tools, generation=True)
        if not (after.startswith(before) and before.endswith(self.chat.turn_end)):
            raise RequestError("the chat template does not render this conversation as a prefix of its "
                               "continuation, so the sampled tokens cannot be kept; open a new session")
        last_action = s.tokens[len(s.tokens) - s.action_mask[::-1].index(0):]
        return s.tokens + self.chat.encode(self.chat.closing(last_action) + after[len(before):])

    def finish(self, s: Session, messages: list[dict], prompt_ids: list[int], out: Generation,
               reply: dict) -> None:
        """Record a sampled turn: the prompt's new tokens, the action, and the reply as answered."""
        if s.id:
            s.add(prompt_ids[len(s.tokens):], False)
            s.prompt_len = s.prompt_len or len(prompt_ids)
            s.add(out.token_ids, True, out.logprobs, out.versions)
            s.messages = messages + [reply]
            s.num_turns += 1
            s.finish_reason = out.finish_reason
            s.generate_s += out.timing.get("generate_s", 0.0)
            self._write(s)
        self.release(s)

    def release(self, s: Session) -> None:
        """End a turn (done or failed); a session whose first turn failed is forgotten."""
        with self._lock:
            s.busy, s.used = False, time.monotonic()
            if s.id and s.num_turns and s.id not in self._open:
                self._open[s.id] = s

    def close(self, receipt: str, reward: float | None) -> tuple[Trajectory, str]:
        """Publish a session by its agent's word; the trajectory and its topic."""
        if reward is not None and not (isinstance(reward, (int, float)) and not isinstance(reward, bool)
                                        and math.isfinite(reward)):
            raise RequestError("reward: expected a finite number or null")
        with self._lock:
            s = self._open.get(receipt)
            if s is None:
                raise RequestError(f"session {receipt!r}: not open (closed, expired or never opened)", 404)
            if s.busy:
                raise RequestError(f"session {receipt!r}: a turn is in flight", 409)
            del self._open[receipt]
        traj = s.trajectory(reward=reward, finish_reason=s.finish_reason, producer_id=self.producer_id,
                            closed="agent")
        return traj, self._publish(s, traj)

    def _publish(self, s: Session, traj: Trajectory) -> str:
        try:
            topic = self.publish(traj)
        except Exception as e:  # the broker did not take it: keep the session, the agent may retry
            with self._lock:
                self._open[s.id] = s
            raise RequestError(f"session {s.id!r}: not published ({e}); still open", 503) from e
        if self.journal is not None:
            (self.journal / f"{s.id}.msgpack").unlink(missing_ok=True)
        return topic

    def _write(self, s: Session) -> None:
        """Journal `s` after a turn. One turn of a session runs at a time, so its temporary file
        is its own; the rename replaces the last turn's file whole."""
        if self.journal is None:
            return
        path = self.journal / f"{s.id}.msgpack"
        atomic_file(path, msgpack.packb(s.record(), use_bin_type=True), durable=False)

    def _take_up(self) -> dict[str, Session]:
        """The sessions journaled by an earlier run of this proxy; a file that does not read as one
        is renamed `*.unreadable` and reported, never deleted."""
        self.journal.mkdir(parents=True, exist_ok=True)
        found = {}
        for path in sorted(self.journal.glob("*.msgpack")):
            try:
                s = Session.from_record(msgpack.unpackb(path.read_bytes(), raw=False))
            except Exception as e:
                log.warning("journal %s is not a session (%s: %s); set aside as .unreadable",
                            path, type(e).__name__, e)
                path.rename(path.with_suffix(".unreadable"))
                continue
            found[s.id] = s
        for tmp in self.journal.glob("*.tmp"):  # a write cut short; its session's last turn stands
            tmp.unlink()
        if found:
            log.info("took up %d open sessions from %s", len(found), self.journal)
        return found

    def expire(self, idle_s: float | None = None) -> list[Trajectory]:
        """Publish the sessions idle for `idle_s` (default: the configured time) to pending, as truncated."""
        cutoff = time.monotonic() - (self.idle_s if idle_s is None else idle_s)
        with self._lock:
            idle = [s for s in self._open.values() if not s.busy and s.used < cutoff]
            for s in idle:
                del self._open[s.id]
        trajs = [s.trajectory(reward=None, finish_reason="truncated", producer_id=self.producer_id,
                              closed="expired") for s in idle]
        for s, traj in zip(idle, trajs):
            self._publish(s, traj)
        return trajs

    def _reap(self) -> None:
        while not self._stop.wait(min(1.0, self.idle_s / 4)):
            try:
                self.expire()
            except RequestError as e:  # kept open; the next sweep tries again
                log.warning("%s", e)

    def close_all(self) -> None:
        """Stop expiring, and publish every session still open as truncated (at shutdown)."""
        self._stop.set()
        self._reaper.join()
        self.expire(idle_s=0.0)


def kafka_publisher(producer, kafka: KafkaConfig, timeout: float = 30.0) -> Callable[[Trajectory], str]:
    """Publish a trajectory (scored: `sao.trajectories`, else pending) and wait for the broker's
    ack; returns the topic, raises if it did not come within `timeout`."""
    def publish(traj: Trajectory) -> str:
        topic = kafka.topic(T.TRAJECTORIES if traj.reward is not None else T.PENDING)
        try:
            err = produce_and_wait(producer, topic, traj.encode(), traj.key, timeout=timeout)
        except TimeoutError:
            err = "timed out"
        if err is not None:
            raise RuntimeError(f"the broker did not acknowledge it: {err}")
        return topic
    return publish
