"""A stateful Python session in the sandbox: one interpreter kept for an episode's tool calls.

`PythonSession.run(code)` sends the code to an interpreter that lives in the sandbox's namespaces,
chroot, uid and cgroup (producers/sandbox.py: the same containment as a one-shot run) for as long
as the session: variables, imports and files in its private /tmp persist from one call to the
next, and nothing is shared with another session. Like a notebook cell, the value of a last bare
expression is printed. Each call has the sandbox's wall-clock limit; a call past it, code that
ends the interpreter (`os._exit`) or breaks the protocol kills the whole session, which the
result says, and the next call starts a fresh one (its first output line says the earlier
variables are gone): a tool that hangs costs its episode one timeout. `close` kills the
interpreter and every process it started and removes its cgroup; the episode closes it however
it ends, and the producer's death kills it too (its parent-death signal is tied to a thread that
lives as long as the producer, not to the short-lived thread of the call that started it).

Protocol: host to interpreter, on its stdin, an 8-byte little-endian length and the code; back,
on a copy of its original stdout, the same framing around `{"output", "truncated", "error"}`. The
code's own stdout and stderr go to a file in its /tmp (capped by RLIMIT_FSIZE), of which the first
`--sandbox.max-output-bytes` are returned.
"""

from __future__ import annotations

import json
import queue
import select
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future

from producers.sandbox import Sandbox, SandboxResult, kill_namespace

RESTARTED = "[a new session: variables from earlier calls are gone]"

_REPL = r'''
import ast, json, os, sys, traceback
CTL, OUT, LIMIT = os.dup(1), "/tmp/work/.out", %(limit)d
G = {"__name__": "__main__", "__builtins__": __builtins__}
def read(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf
def send(reply):
    data = json.dumps(reply).encode()
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(CTL, data):]
def run(code):
    fd = os.open(OUT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    error = None
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), G)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), G)
            if value is not None:
                print(repr(value))
    except BaseException as e:
        error = type(e).__name__
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(OUT, "rb") as f:
        data = f.read(LIMIT + 1)
    send({"output": data[:LIMIT].decode(errors="replace"), "truncated": len(data) > LIMIT, "error": error})
while True:
    try:
        n = int.from_bytes(read(8), "little")
    except EOFError:
        break
    run(read(n).decode(errors="replace"))
'''


class _Spawner:
    """Starts processes from one daemon thread that lives as long as this process (module docstring)."""

    def __init__(self):
        self._todo: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="sandbox-sessions", daemon=True).start()

    def _loop(self) -> None:
        while True:
            args, kw, done = self._todo.get()
            try:
                done.set_result(subprocess.Popen(*args, **kw))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, whose call it was
                done.set_exception(e)

    def popen(self, *args, **kw) -> subprocess.Popen:
        done: Future = Future()
        self._todo.put((args, kw, done))
        return done.result()


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def spawner() -> _Spawner:
    global _spawner
    with _spawner_lock:
        _spawner = _spawner or _Spawner()
        return _spawner


class PythonSession:
    """One interpreter for one episode; `run` from one thread at a time (an episode's steps are sequential)."""

    def __init__(self, sandbox: Sandbox, cpu_s: float | None = None):
        self.sandbox = sandbox
        self.cpu_s = cpu_s or 8 * sandbox.cfg.timeout_s  # CPU over the session's life; the wall clock bounds each call
        self.calls = self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._group = None
        self._lock = threading.Lock()
        self._closed = False

    def run(self, code: str) -> SandboxResult:
        """Run `code` in the session; a result as a one-shot `Sandbox.run` gives, never an exception
        for what the code does."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the session is closed")
            notice = ""
            if self._proc is None:
                if self.calls:
                    notice, self.restarts = RESTARTED + "\n", self.restarts + 1
                self._start()
            self.calls += 1
            t0 = time.monotonic()
            reply, problem = self._exchange(code.encode())
            duration = time.monotonic() - t0
            if reply is None:  # the session is gone: a timeout, an exit, or a broken protocol
                self._stop()
                return SandboxResult(exit_code=None, signal="SIGKILL" if problem == "timeout" else None,
                                     output=notice + ("" if problem == "timeout" else f"[session ended: {problem}]"),
                                     truncated=False, timed_out=problem == "timeout", duration_s=duration)
            return SandboxResult(exit_code=1 if reply["error"] else 0, signal=None, output=notice + reply["output"],
                                 truncated=reply["truncated"], timed_out=False, duration_s=duration)

    def close(self) -> None:
        """Kill the interpreter and everything it started; idempotent, from any thread."""
        self._closed = True
        self._stop()

    def __enter__(self) -> PythonSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the process
    def _start(self) -> None:
        program = _REPL % {"limit": self.sandbox.cfg.max_output_bytes}
        cmd, self._group = self.sandbox.command(program, cpu_s=self.cpu_s)
        self._setup_log = tempfile.TemporaryFile()
        self._proc = spawner().popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._setup_log,
                                     env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, cwd="/", start_new_session=True)

    def _stop(self) -> None:
        proc, group, self._proc, self._group = self._proc, self._group, None, None
        if proc is not None:
            if proc.poll() is None:
                kill_namespace(proc)
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()
            self._setup_log.close()
        if group is not None:
            group.close()

    def _exchange(self, code: bytes) -> tuple[dict | None, str]:
        """Send `code`, wait for its reply within the wall-clock limit: (reply, "") or (None, why not)."""
        deadline = time.monotonic() + self.sandbox.cfg.timeout_s
        try:
            self._proc.stdin.write(len(code).to_bytes(8, "little") + code)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None, self._why_gone()
        header = self._read(8, deadline)
        if not isinstance(header, bytes):
            return None, header
        size = int.from_bytes(header, "little")
        if size > 4 * self.sandbox.cfg.max_output_bytes + 1024:  # the code wrote to the control channel
            return None, "the session broke its protocol"
        body = self._read(size, deadline)
        if not isinstance(body, bytes):
            return None, body
        try:
            reply = json.loads(body)
            if not (isinstance(reply.get("output"), str) and isinstance(reply.get("truncated"), bool)):
                raise ValueError(reply)
        except (ValueError, AttributeError):
            return None, "the session broke its protocol"
        return reply, ""

    def _read(self, n: int, deadline: float) -> bytes | str:
        """`n` bytes of the reply, or why they did not come ("timeout", or the session ended)."""
        fd, buf = self._proc.stdout.fileno(), b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return "timeout"
            chunk = self._proc.stdout.read1(n - len(buf))
            if not chunk:
                return self._why_gone()
            buf += chunk
        return buf

    def _why_gone(self) -> str:
        try:
            rc = self._proc.wait(2)
        except subprocess.TimeoutExpired:
            return "the interpreter stopped answering"
        return f"the interpreter exited (status {rc})"
