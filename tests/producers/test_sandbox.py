"""Each test attacks one property of the sandbox and checks the attack is contained and reported."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from producers.cgroup import parents, sweep
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


def test_only_the_allowlist_exists_outside_its_directory(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    targets = [str(secret), str(REPO / "pyproject.toml"), "/root", "/etc/shadow", "/etc/passwd", "/var"]
    code = ("import os\n"
            f"for p in {targets!r}:\n"
            "    try:\n"
            "        print(p, 'READ', os.listdir(p) if os.path.isdir(p) else open(p).read(50))\n"
            "    except OSError as e:\n"
            "        print(p, 'DENIED', type(e).__name__)\n"
            "print('root', sorted(os.listdir('/')))\n")
    res = sandbox.run(code)
    lines = dict(line.split(" ", 1) for line in res.output.splitlines())
    for target in targets:
        assert lines[target] == "DENIED FileNotFoundError", target
    assert lines["root"] == str(sorted(["bin", "dev", "etc", "lib", "lib64", "proc", "tmp", "usr"]))
    assert "host secret" not in res.output


def test_a_file_planted_where_no_list_ever_looked_is_invisible(sandbox):
    """A new top-level folder (a weights volume) and a token under /var/lib, both world-readable:
    a denylist would have had to name them; the allowlist root simply lacks them."""
    folder = Path(f"/sao-planted-{uuid.uuid4().hex[:8]}")
    token = Path(f"/var/lib/sao-token-{uuid.uuid4().hex[:8]}")
    try:
        folder.mkdir(mode=0o755)
        (folder / "weights.safetensors").write_text("weights bytes")
        token.write_text("token bytes")
        for p in (folder / "weights.safetensors", token):
            p.chmod(0o644)
        code = "\n".join(f"try:\n    print(open({str(p)!r}).read())\nexcept OSError as e:\n    print(type(e).__name__)"
                         for p in (folder / "weights.safetensors", token))
        res = sandbox.run(code)
        assert res.output.split() == ["FileNotFoundError", "FileNotFoundError"]
    finally:
        token.unlink(missing_ok=True)
        (folder / "weights.safetensors").unlink(missing_ok=True)
        folder.rmdir()


def test_16_processes_of_512_mib_under_a_1_gib_total_are_stopped_inside_the_cgroup():
    box = Sandbox(SandboxConfig(timeout_s=30, max_procs=32, max_total_memory_bytes=1 << 30))
    code = ("import os, time\n"
            "kids = []\n"
            "for _ in range(16):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        x = b'1' * (512 << 20)  # written, so every page is charged\n"
            "        time.sleep(3)\n"
            "        os._exit(0)\n"
            "    kids.append(pid)\n"
            "killed = sum(os.WIFSIGNALED(os.waitpid(p, 0)[1]) for p in kids)\n"
            "print('killed', killed)\n")
    res = box.run(code)
    assert res.ok, format_result(res)
    assert int(res.output.split()[1]) >= 15  # two of them plus Python do not fit in 1 GiB
    assert res.oom_kills >= 15 and "memory limit" in format_result(res)
    assert res.peak_memory_bytes <= 1 << 30  # the host never gave the run more than its bound


def test_refuses_without_a_cgroup_unless_opted_out():
    offered, _ = parents()
    with pytest.raises(SandboxUnavailable, match="--sandbox.cgroup off"):
        Sandbox(SandboxConfig(cgroup={"v1": "v2", "v2": "v1"}[offered]))
    res = Sandbox(SandboxConfig(cgroup="off")).run("print('ran')")
    assert res.output == "ran\n" and res.peak_memory_bytes is None


def test_groups_left_by_a_killed_owner_are_swept_and_a_reused_pid_meets_none(sandbox):
    """A producer SIGKILLed mid-run cannot remove its run groups; they piled up (86 on this machine
    after a day of tests), and a later process given the same pid failed creating a group of the
    same name (FileExistsError in CI)."""
    _, bases = parents()
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        left = [base / f"sao-sandbox-{dead.pid}-{uuid.uuid4().hex[:12]}" for base in bases.values()]
        held = [base / f"sao-sandbox-{alive.pid}-{uuid.uuid4().hex[:12]}" for base in bases.values()]
        for d in left + held:
            d.mkdir()
        assert all(sweep(base, min_age_s=3600) == [] for base in bases.values()), "too young to sweep"
        removed = [d for base in bases.values() for d in sweep(base, min_age_s=0)]
        assert set(left) <= set(removed) and not any(d.exists() for d in left)
        assert all(d.exists() for d in held), "a live owner's group is left alone"
        # a pid reused while its earlier owner's group remains: names differ, both runs work
        res = sandbox.run("print('ran')")
        assert res.output == "ran\n"
    finally:
        alive.kill()
        alive.wait()
        for d in held:
            d.rmdir()


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


def test_refuses_an_interpreter_outside_the_allowlist():
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
