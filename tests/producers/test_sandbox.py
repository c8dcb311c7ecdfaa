"""Each test attacks one property of the sandbox and checks the attack is contained and reported."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producers.sandbox import Sandbox, SandboxConfig, SandboxUnavailable, format_result

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(timeout_s=2.0))


def _sandbox_pids(cfg: SandboxConfig) -> list[int]:
    """Host processes owned by any sandbox uid."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if cfg.uid_base <= int(uid_line.split()[1]) < cfg.uid_base + 50_000:
            pids.append(int(status.parent.name))
    return pids


def test_runs_code_and_captures_stdout_and_stderr(sandbox):
    res = sandbox.run("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)")
    assert res.ok and res.exit_code == 0
    assert res.output.split() == ["42", "warn"]


def test_infinite_loop_is_killed_at_the_wall_clock_timeout(sandbox):
    res = sandbox.run("while True:\n    pass")
    assert res.timed_out and not res.ok and res.exit_code is None
    assert 1.9 < res.duration_s < 5
    assert "timeout" in format_result(res)
    assert sandbox.run("print('next')").output == "next\n"


def test_fork_bomb_is_bounded_and_leaves_no_process_behind(sandbox):
    code = ("import os, time\n"
            "n = 0\n"
            "while True:\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            os.setsid()  # try to escape the process group\n"
            "            while True: os.fork() if n < 0 else time.sleep(1)\n"
            "        n += 1\n"
            "    except OSError as e:\n"
            "        print('forked', n, e, flush=True)\n"
            "        while True: pass\n")
    res = sandbox.run(code)
    assert res.timed_out
    forked = int(res.output.split()[1])
    assert forked < sandbox.cfg.max_procs  # RLIMIT_NPROC held although the parent is root
    assert "Resource temporarily unavailable" in format_result(res)
    assert _sandbox_pids(sandbox.cfg) == []  # setsid children died with the PID namespace


def test_allocating_10_gb_fails_with_memory_error(sandbox):
    res = sandbox.run("x = bytearray(10 * 2**30)\nprint('allocated')")
    assert res.exit_code == 1 and "MemoryError" in res.output and "allocated" not in res.output


def test_writing_a_1_gb_file_stops_at_the_file_size_limit(sandbox):
    code = ("import os\n"
            "with open('big', 'wb') as f:\n"
            "    try:\n"
            "        for _ in range(1024):\n"
            "            f.write(b'0' * 2**20)\n"
            "            f.flush()\n"
            "    except OSError as e:\n"
            "        print('stopped', e)\n"
            "print('size', os.path.getsize('big'))")
    res = sandbox.run(code)
    assert "File too large" in res.output
    assert int(res.output.split("size")[1]) <= sandbox.cfg.max_file_bytes


def test_files_outside_its_directory_are_hidden_or_unreadable(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    targets = [str(secret), str(REPO / "pyproject.toml"), "/root", "/etc/shadow"]
    code = ("import os\n"
            f"for p in {targets!r}:\n"
            "    try:\n"
            "        print(p, 'READ', os.listdir(p) if os.path.isdir(p) else open(p).read(50))\n"
            "    except OSError as e:\n"
            "        print(p, 'DENIED', type(e).__name__)\n")
    res = sandbox.run(code)
    lines = dict(line.split(" ", 1) for line in res.output.splitlines())
    assert lines[str(secret)].startswith("DENIED")  # /tmp is a private tmpfs
    assert lines[str(REPO / "pyproject.toml")].startswith("DENIED")  # the repository is hidden
    assert lines["/root"] == "READ []"  # an empty tmpfs
    assert lines["/etc/shadow"].startswith("DENIED")  # unprivileged uid
    assert "host secret" not in res.output


def test_writing_outside_its_directory_fails(sandbox):
    code = ("for p in ['/etc/sao-sandbox-test', '/usr/sao-sandbox-test', '/var/tmp/x']:\n"
            "    try:\n"
            "        open(p, 'w').write('x'); print(p, 'WROTE')\n"
            "    except OSError as e:\n"
            "        print(p, 'DENIED', e)\n")
    res = sandbox.run(code)
    assert "WROTE" not in res.output and res.output.count("DENIED") == 3
    assert not os.path.exists("/etc/sao-sandbox-test") and not os.path.exists("/usr/sao-sandbox-test")


def test_the_environment_is_empty(sandbox, monkeypatch):
    monkeypatch.setenv("SAO_TEST_SECRET", "hunter2")
    res = sandbox.run("import os\nprint(sorted(os.environ))\nprint(os.getuid())")
    names, uid = res.output.splitlines()
    assert "SAO_TEST_SECRET" not in names and "hunter2" not in res.output
    assert int(uid) >= sandbox.cfg.uid_base


def test_tcp_connection_to_the_broker_fails(sandbox, kafka_bootstrap):
    host, port = kafka_bootstrap.rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()  # reachable from the host
    code = ("import socket\n"
            "try:\n"
            f"    socket.create_connection(({host!r}, {int(port)}), timeout=2); print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('REFUSED', e)\n")
    res = sandbox.run(code)
    assert res.output.startswith("REFUSED") and "Network is unreachable" in res.output


def test_output_is_truncated_at_the_limit(sandbox):
    res = sandbox.run("print('x' * 100_000)")
    assert res.truncated and len(res.output) == sandbox.cfg.max_output_bytes
    assert format_result(res).endswith("[output truncated]")


def test_a_signal_is_reported(sandbox):
    res = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert res.signal == "SIGKILL" and format_result(res).endswith("[killed by SIGKILL]")


def test_refuses_loudly_when_namespaces_cannot_be_created():
    with pytest.raises(SandboxUnavailable, match="refuses to execute code"):
        Sandbox(SandboxConfig(unshare="/bin/false"))
    with pytest.raises(SandboxUnavailable, match="unisolated"):
        Sandbox(SandboxConfig(unshare="/nonexistent/unshare"))


def test_refuses_an_interpreter_inside_a_hidden_directory():
    with pytest.raises(SandboxUnavailable, match="sandbox.python"):
        Sandbox(SandboxConfig(python=str(REPO / ".venv" / "bin" / "python")))


def test_nothing_outlives_a_producer_killed_mid_run():
    code = "import time; time.sleep(120)"
    runner = subprocess.Popen([sys.executable, "-c", "from producers.sandbox import Sandbox, SandboxConfig; "
                               f"Sandbox(SandboxConfig(timeout_s=60)).run({code!r})"], cwd=REPO)
    cfg = SandboxConfig()
    deadline = time.monotonic() + 30
    while not _sandbox_pids(cfg) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # past the start-up probe: this is the sleeping run
    assert _sandbox_pids(cfg), "the sandboxed code never started"
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    deadline = time.monotonic() + 5
    while _sandbox_pids(cfg) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_pids(cfg) == []
