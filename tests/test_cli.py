"""The `sao` entry point: usage, the demo round trip, and the whole stack with tiny settings."""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import tyro
from confluent_kafka import TopicPartition

from sao.cli import COMMANDS, main
from schemas import topics as T
from schemas.kafka import make_consumer
from tests.learner.service_util import announcements

ROOT = Path(__file__).resolve().parents[1]


def _sao(*args: str, kafka_cfg=None, as_flags: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """`sao ARGS` on the test cluster, named by SAO_KAFKA_* variables or (`as_flags`) by
    `--kafka.*` flags alone, with no SAO_KAFKA_BOOTSTRAP in the environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING"}
    if kafka_cfg is not None and as_flags:
        env.pop("SAO_KAFKA_BOOTSTRAP", None)
        args = (*args, "--kafka.bootstrap", kafka_cfg.bootstrap, "--kafka.topic-prefix", kafka_cfg.topic_prefix)
    elif kafka_cfg is not None:
        env |= {"SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix}
    return subprocess.run([sys.executable, "-m", "sao", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_usage_lists_every_subcommand_and_unknown_ones_fail():
    out = _sao("--help")
    assert out.returncode == 0
    for name in ("broker", "up", "demo", "learner", "producer", "feed", "serve", "audit"):
        assert f"  {name} " in out.stdout
    assert _sao("no-such-command").returncode == 2


POSITIONAL = set(typing.get_args(tyro.conf.Positional[int])[1:])


def _flags(cls: type, prefix: str = "") -> list[str]:
    """How the help names every setting of a config dataclass: a flag, nested ones dotted, or
    tyro's heading for a positional argument."""
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls, include_extras=True)[f.name]
        name = prefix + f.name.replace("_", "-")
        if POSITIONAL & set(typing.get_args(tp)[1:]):
            out.append("positional arguments")
        elif dataclasses.is_dataclass(tp):
            out += _flags(tp, name + ".")
        else:
            out.append(f"--{name}")
    return out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_has_help_listing_each_of_its_settings(command, capsys):
    """`sao <command> --help` exits 0 and names every flag its config dataclass has (in-process:
    a child per subcommand would spend most of a minute importing)."""
    module_name, config_name, _ = COMMANDS[command]
    with pytest.raises(SystemExit) as exit_:
        main([*command.split(), "--help"])
    help_text = capsys.readouterr().out
    assert exit_.value.code == 0
    config = getattr(importlib.import_module(module_name), config_name)
    missing = [flag for flag in _flags(config) if flag not in help_text]
    assert not missing, f"sao {command} --help does not list {missing}"


def test_help_shows_the_settings_docstrings():
    out = _sao("learner", "--help")
    assert out.returncode == 0 and "--batch-trajectories" in out.stdout and "whichever comes first" in out.stdout


def test_demo_round_trips_through_the_broker(kafka_cfg):
    out = _sao("demo", "--trajectories", "5", "--max-tokens", "500", kafka_cfg=kafka_cfg)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("byte-identical") == 5 and "round trip OK" in out.stdout


def _on_the_cluster(kafka_cfg, topic, n: int) -> None:
    """`topic` of the named cluster holds `n` messages (written there, not to a broker of its own)."""
    consumer = make_consumer(kafka_cfg, "watermarks")
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        assert sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts) == n
    finally:
        consumer.close()


def test_demo_and_up_use_the_cluster_named_by_the_flag_not_a_broker_of_their_own(kafka_cfg, tmp_path):
    out = _sao("demo", "--trajectories", "3", "--max-tokens", "100", kafka_cfg=kafka_cfg, as_flags=True)
    assert out.returncode == 0, out.stderr
    assert "broker up at" not in out.stdout and "round trip OK" in out.stdout
    _on_the_cluster(kafka_cfg, kafka_cfg.topic(T.TRAJECTORIES), 3)
    out = _sao("up", "--steps", "1", "--producers", "1", "--batch-trajectories", "2", "--eval-every", "0",
               "--run-dir", str(tmp_path), kafka_cfg=kafka_cfg, as_flags=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "broker up at" not in out.stdout
    assert [w.version for w in announcements(kafka_cfg, timeout=10)][:1] == [0]  # the learner's, on the named cluster


def test_up_runs_learner_producers_and_feeder_and_plots(kafka_cfg, tmp_path):
    out = _sao("up", "--steps", "3", "--producers", "1", "--batch-trajectories", "4",
               "--run-dir", str(tmp_path), kafka_cfg=kafka_cfg)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step/index"] for s in steps] == [0, 1, 2]
    assert all(s["batch/trajectories"] == 4 for s in steps)
    _accounted(tmp_path, kafka_cfg)
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sao_variables_configure_a_service_under_the_flags():
    from learner.service import LearnerConfig
    from schemas.config import ConfigError, from_env
    env = {"SAO_BATCH_TRAJECTORIES": "7", "SAO_WEIGHTS_DIR": "/w", "SAO_UPDATE_ALGORITHM": "grpo_dis",
           "SAO_UPDATE_EPS_LOW": "0.5", "SAO_KAFKA_BOOTSTRAP": "k:1", "SAO_PARALLEL_MIXED_PRECISION": "true"}
    cfg = from_env(LearnerConfig, env)
    assert (cfg.batch_trajectories, str(cfg.weights_dir), cfg.update.algorithm, cfg.update.eps) == \
        (7, "/w", "grpo_dis", (0.5, 5.0))
    assert cfg.kafka.bootstrap == "k:1" and cfg.parallel.mixed_precision is True
    import pytest
    with pytest.raises(ConfigError, match="SAO_UPDATE_ALGORITHM"):
        from_env(LearnerConfig, {"SAO_UPDATE_ALGORITHM": "ppo"})
    with pytest.raises(ConfigError, match="SAO_MAX_STEPS"):
        from_env(LearnerConfig, {"SAO_MAX_STEPS": "many"})


def test_group_baselines_through_up_train_whole_groups_with_a_group_advantage(kafka_cfg, tmp_path):
    out = _sao("up", "--steps", "2", "--eval-every", "0", "--producers", "1", "--batch-trajectories", "8", "--group-size", "8",
               "--learner-flags=--update.algorithm grpo --update.lr-policy 3e-3", "--run-dir", str(tmp_path),
               kafka_cfg=kafka_cfg)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for s in steps:
        groups = collections.Counter(i.rpartition(".")[0] for i in s["trajectory_ids"])  # <prompt>#<attempt>
        assert set(groups.values()) == {8}, groups  # whole groups only
        assert s["adv/abs_mean"] > 0  # rewards differ within a group: the group advantage is not zero
    _accounted(tmp_path, kafka_cfg)  # members of groups still incomplete are held in the checkpoint


def _accounted(run: Path, kafka_cfg) -> None:
    """`sao audit` of a stopped stack run finds every id explained."""
    out = _sao("audit", "--run-dir", str(run / "learner"), kafka_cfg=kafka_cfg)
    assert out.returncode == 0 and "every id accounted for" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
