"""The stateful Python session of an agent's episode: each test attacks one property and checks that
it holds and that the attack cost this session alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from producers.sandbox import Sandbox, SandboxConfig
from producers.session import RESTARTED, PythonSession
from tests.producers.test_sandbox import _sandbox_pids

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(timeout_s=2.0, uid_base=260_000))


def test_variables_persist_across_calls_from_threads_that_have_ended(sandbox):
    with PythonSession(sandbox) as s:
        def first():
            assert s.run("total = 6 * 7\nimport math").ok
        t = threading.Thread(target=first)
        t.start()
        t.join()  # the thread that started the interpreter is gone; the interpreter is not
        res = s.run("total + math.floor(0.5)")
        assert res.ok and res.output == "42\n"


def test_two_sessions_share_no_variable_file_or_process(sandbox):
    with PythonSession(sandbox) as a, PythonSession(sandbox) as b:
        assert a.run("secret = 7\nopen('/tmp/work/note', 'w').write('a')\nimport os\nos.getpid()").ok
        assert "NameError" in b.run("secret").output
        assert "FileNotFoundError" in b.run("open('/tmp/work/note').read()").output
        assert b.run("import os\nsorted(int(p) for p in os.listdir('/proc') if p.isdigit())").output.count(",") < 4


def test_a_hanging_call_costs_one_timeout_and_the_next_call_says_the_session_is_new(sandbox):
    with PythonSession(sandbox) as s:
        s.run("x = 1")
        res = s.run("while True:\n    pass")
        assert res.timed_out and 1.9 < res.duration_s < 4
        res = s.run("print('alive')\nx")
        assert res.output.startswith(RESTARTED) and "alive" in res.output and "NameError" in res.output
        assert s.restarts == 1


def test_exit_keeps_the_session_and_a_hard_exit_ends_it_saying_so(sandbox):
    with PythonSession(sandbox) as s:
        s.run("x = 5")
        assert "SystemExit" in s.run("raise SystemExit(3)").output
        assert s.run("x").output == "5\n"
        res = s.run("import os\nos._exit(4)")
        assert "session ended" in res.output and "status 4" in res.output and not res.ok


def test_garbage_on_the_control_channel_breaks_that_session_alone(sandbox):
    with PythonSession(sandbox) as s, PythonSession(sandbox) as other:
        other.run("y = 2")
        res = s.run("import os\nos.write(3, (10**12).to_bytes(8, 'little'))")  # a length no reply has
        assert "broke its protocol" in res.output or "session ended" in res.output or res.timed_out
        assert other.run("y").output == "2\n"
        assert s.run("print('again')").output.endswith("again\n")


def test_output_is_capped(sandbox):
    with PythonSession(sandbox) as s:
        res = s.run("print('x' * 100_000)")
        assert res.truncated and len(res.output) <= sandbox.cfg.max_output_bytes


def test_the_network_stays_unreachable_in_a_session(sandbox):
    with PythonSession(sandbox) as s:
        res = s.run("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
        assert not res.ok and ("OSError" in res.output or "unreachable" in res.output.lower())


def test_close_kills_every_process_the_session_started_and_removes_its_cgroup(sandbox):
    before = set(_sandbox_pids(sandbox.cfg))
    s = PythonSession(sandbox)
    s.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n")
    group = s._group
    assert set(_sandbox_pids(sandbox.cfg)) - before  # the interpreter and its escaped child
    s.close()
    deadline = time.monotonic() + 30  # a loaded machine reaps slowly
    while set(_sandbox_pids(sandbox.cfg)) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    left = set(_sandbox_pids(sandbox.cfg)) - before
    assert not left, {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in left if Path(f"/proc/{p}").exists()}
    assert group is None or not any(d.exists() for d in group.dirs), group.dirs
    with pytest.raises(RuntimeError, match="closed"):
        s.run("1")


def test_a_killed_producer_leaves_no_session_behind(tmp_path):
    cfg = SandboxConfig(timeout_s=5.0, uid_base=320_000)
    code = ("import sys, time\nfrom producers.sandbox import Sandbox, SandboxConfig\n"
            "from producers.session import PythonSession\n"
            f"s = PythonSession(Sandbox(SandboxConfig(timeout_s=5.0, uid_base={cfg.uid_base})))\n"
            "s.run('import os, time\\nif os.fork() == 0:\\n    time.sleep(600)')\n"
            "print('ready', flush=True)\ntime.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert owner.stdout.readline().strip() == "ready"
        assert _sandbox_pids(cfg)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while _sandbox_pids(cfg) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _sandbox_pids(cfg), "a session outlived the producer that held it"
    finally:
        owner.kill()
