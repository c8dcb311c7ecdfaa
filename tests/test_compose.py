"""docker-compose.yml is valid Compose (checked with Debian's docker-compose; no engine needed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_file_validates():
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is installed by `make install`; it is needed to validate the file"
    out = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_compose_runs_kafka_in_kraft_mode():
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = spec["services"]["kafka"]["environment"]
    assert spec["services"]["kafka"]["image"].startswith("apache/kafka:")
    assert "controller" in env["KAFKA_PROCESS_ROLES"] and "broker" in env["KAFKA_PROCESS_ROLES"]
