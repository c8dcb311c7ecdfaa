"""`sao up` (what `make run` runs): the whole pipeline on this machine with a live dashboard.

Starts Apache Kafka (unless `--kafka.bootstrap` or `SAO_KAFKA_BOOTSTRAP` names a cluster), creates the topics, then each
service as its own process, as they would run on separate machines: the learner, `--producers`
producers (each serving Prometheus metrics on a free port) and the prompt feeder. A child that
crashes is reported and restarted, at most `--max-restarts` times each (a producer's prompts go to
the others meanwhile; the learner resumes from its checkpoint). The run ends when the learner has
trained `--steps` steps, or on Ctrl-C / SIGTERM; every child is stopped, none is left behind, and
`report.png` plus `summary.txt` are written to `--run-dir` (`sao report RUN_DIR` redoes them).

A run continues where it stopped with `sao up --resume RUN_DIR`, after Ctrl-C, SIGTERM or a SIGKILL
of the whole process tree: on its own broker the Kafka data lives in RUN_DIR/kafka, so the same
topics come back with every prompt, trajectory, weight announcement and evaluation, every group's
committed position; the learner restores its newest checkpoint (steps past it are replayed, never
trained twice), producers go on from their group's committed prompts, the evaluator from what
sao.evaluations says it scored, the feeder with new tasks; metrics, evaluations and logs are
appended to and the report covers the whole run. The run's settings come from RUN_DIR/up.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sao import report
from sao.broker import BrokerConfig, EmbeddedBroker, cluster, embedded_unless_named, free_port
from sao.dashboard import Dashboard
from sao.supervisor import Supervisor
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, ensure_topics
from schemas.process import stop_on_signals
from schemas.signing import PRIVATE_FILE, PUBLIC_FILE, create_keys, load_trusted


@dataclass(kw_only=True)
class UpConfig:
    steps: int = 150
    """Learner steps before everything stops."""
    producers: int = 2
    """Producer processes."""
    env: str = "toy-target"
    """Environment the producers play and the feeder samples prompts from."""
    model: str = "tiny-llama"
    """Model of the producers and the learner: tiny-llama (random, learns toy-target in minutes on
    2 cores) | smollm2 (SmolLM2-135M-Instruct, what `make run` trains) | ..."""
    batch_trajectories: int = 16
    """Trajectories per learner step."""
    group_size: int = 1
    """Rollouts per prompt the feeder asks for (G >= 2 for the group baselines)."""
    max_lag_steps: float = 2.0
    """How far rollouts may run ahead of training, in learner steps: the feeder and producers hold
    new prompts while the learner has this many steps' trajectories left (`--max-lag`; 0: no bound)."""
    max_tokens: int = 8
    """Tokens per model turn."""
    run_dir: Path = Path("runs/up")
    """Learner metrics, checkpoints, weights, process logs, report.png and summary.txt; on `sao up`'s
    own broker every run starts afresh (an earlier run's state there is removed)."""
    learner_flags: str = "--update.warmup-steps 5 --update.lr-policy 3e-3 --update.lr-critic 3e-3"
    """Extra `sao learner` flags, space separated."""
    producer_flags: str = "--concurrency 8"
    """Extra `sao producer` flags, space separated."""
    producer_backend: Literal["auto", "hf", "vllm"] = "auto"
    """Generation backend of the producers (`sao producer --backend`); auto: vllm where this machine
    and the model allow it (vLLM's CPU build on x86-64 with AVX2/AVX-512, or a GPU), hf otherwise."""
    judge: str = ""
    """A style for `sao judge` to reward (uppercase, concise, exclaim, ...): starts the judge and the
    reward joiner, for environments without a reward of their own (`writing`). Empty: none."""
    learner_threads: int = 2
    """Torch threads of the learner (every other process gets one)."""
    eval_every: int = 5
    """Score the policy on held-out tasks every this many versions, and the first and last, with
    `sao eval` on an engine of its own (0: no evaluation)."""
    eval_tasks: int = 16
    """Held-out tasks each evaluation plays (`sao eval --tasks`)."""
    eval_samples: int = 4
    """Sampled episodes per held-out task besides the greedy one (`sao eval --samples`)."""
    heldout_frac: float = 0.1
    """Share of the env's tasks held out of training for evaluation (the feeder's and the
    evaluator's `--heldout-frac`)."""
    eval_flags: str = ""
    """Extra `sao eval` flags, space separated."""
    final_eval_s: float = 300.0
    """Seconds the evaluator gets, once the learner is done, to score the last version."""
    export: bool = True
    """At the end, write the newest version as a folder transformers and `vllm serve` load, to
    <run-dir>/model (`sao export`)."""
    max_restarts: int = 3
    """Restarts of one crashed child before `sao up` gives up."""
    dashboard: bool = True
    """Live dashboard when the output is a terminal (else a progress line every 10 s)."""
    resume: Path | None = None
    """Continue the run stopped in this run dir, with the settings it started with (its up.json),
    instead of starting a new one."""
    kafka: KafkaConfig = field(default_factory=embedded_unless_named)
    """The cluster; an empty `--kafka.bootstrap` (the default) starts an embedded broker."""
    broker: BrokerConfig = field(default_factory=lambda: BrokerConfig(port=0))


def _sao(*args: str) -> list[str]:
    return [sys.executable, "-m", "sao", *args]


def backend_line(backend: str) -> str:
    """What the producers' `--backend` will be, in words."""
    if backend != "auto":
        return f"{backend} backend"
    from producers.generate.vllm import unsupported_here
    why = unsupported_here()
    return f"hf backend ({why})" if why else ("vllm backend where the learner's model fits vLLM's kernels, "
                                               "else hf (each producer's log says which)")


def commands(cfg: UpConfig, ports: dict[str, int], feed_seed: int = 0) -> dict[str, list[str]]:
    """Each child's command line; `ports` names a Prometheus port for each producer and the evaluator.
    The learner signs its weights with the run's key; producers and the evaluator load only what it
    signed (RUN_DIR/keys, made by `run`)."""
    kafka = ["--kafka.bootstrap", cfg.kafka.bootstrap, "--kafka.topic-prefix", cfg.kafka.topic_prefix]
    keys = cfg.run_dir / "keys"
    signing, trusted = str(keys / PRIVATE_FILE), str(keys / PUBLIC_FILE)
    lag = ["--max-lag", str(round(cfg.max_lag_steps * cfg.batch_trajectories))]
    cmds = {"learner": _sao("learner", "--run-dir", str(cfg.run_dir / "learner"),
                            "--weights-dir", str(cfg.run_dir / "weights"), "--model.name", cfg.model,
                            "--batch-trajectories", str(cfg.batch_trajectories), "--max-steps", str(cfg.steps),
                            "--weights.signing-key", signing,
                            *cfg.learner_flags.split(), *kafka)}
    for name, port in ((n, p) for n, p in ports.items() if n.startswith("producer-")):
        # `--model learner`: the producers build the learner's published architecture and load its weights
        cmds[name] = _sao("producer", "--backend", cfg.producer_backend, "--env", cfg.env, "--model", "learner", "--producer-id", name,
                          "--max-tokens", str(cfg.max_tokens), "--metrics-port", str(port), "--log-every-s", "10",
                          "--weights.trusted-keys", trusted, *lag, *cfg.producer_flags.split(), *kafka)
    if cfg.judge:  # live rewards: pending trajectories -> judge -> sao.rewards -> joiner -> learner
        cmds["judge"] = _sao("judge", "--model", cfg.model, "--criteria", cfg.judge, "--log-every-s", "10", *kafka)
        cmds["reward-join"] = _sao("reward-join", "--data-dir", str(cfg.run_dir / "joiner"), *kafka)
    if cfg.eval_every:  # its own engine, following sao.weights like a producer; the judge's style as its reward
        reward = ["--reward", f"consumers.style_rewards:{cfg.judge}"] if cfg.judge else []
        cmds["eval"] = _sao("eval", "--env", cfg.env, "--every", str(cfg.eval_every), "--tasks", str(cfg.eval_tasks),
                            "--samples", str(cfg.eval_samples), "--heldout-frac", str(cfg.heldout_frac),
                            "--backend", cfg.producer_backend, "--max-tokens", str(cfg.max_tokens),
                            "--out", str(cfg.run_dir / "eval.jsonl"), "--evaluator-id", "eval",
                            "--metrics-port", str(ports["eval"]), "--trusted-keys", trusted, *reward,
                            *cfg.eval_flags.split(), *kafka)
    cmds["feeder"] = _sao("feed", "--env", cfg.env, "--max-unfinished", str(4 * cfg.batch_trajectories),
                          "--group-size", str(cfg.group_size), "--heldout-frac", str(cfg.heldout_frac), "--seed", str(feed_seed), *lag, *kafka)
    return cmds


def supervise(cfg: UpConfig, sup: Supervisor, dash: Dashboard, stop) -> str | None:
    """Poll children and redraw until the learner is done, a child is out of restarts, or `stop`.
    Returns why the run failed, or None."""
    live = None
    if cfg.dashboard and sys.stdout.isatty():
        from rich.live import Live
        live = Live(dash.render(), refresh_per_second=2)
    last_line = 0.0
    with live or contextlib.nullcontext():
        while not stop.wait(1.0):
            events = sup.poll()
            dash.update(events)
            if live:
                live.update(dash.render())
            else:
                for e in events:
                    print(e, flush=True)
                if time.monotonic() - last_line >= 10:
                    print(dash.line(), flush=True)
                    last_line = time.monotonic()
            if sup.children["learner"].state == "done":
                return None
            if failed := [c.name for c in sup.children.values() if c.state == "failed"]:
                return f"{', '.join(failed)} crashed more than {cfg.max_restarts} times"
    return None


RUN_STATE = ("learner", "weights", "joiner", "logs", "processes.json", "report.png", "summary.txt", "eval.jsonl",
             "model", "kafka", "up.json", "keys")
"""What one run leaves in its run dir."""


def last_evaluation(cfg: UpConfig, sup: Supervisor, dash: Dashboard) -> None:
    """The learner is done: stop the rest, then let the evaluator score the last version (it does
    on SIGTERM) within `--final-eval-s`, its cores no longer shared with rollouts."""
    sup.stop([name for name in sup.children if name != "eval"])
    print(f"learner done: the evaluator scores the last version (up to {cfg.final_eval_s:.0f} s)", flush=True)
    sup.stop(["eval"], timeout=cfg.final_eval_s)
    dash.update([])


def export_final(cfg: UpConfig) -> None:
    """The newest version as a transformers folder in <run-dir>/model, and where it is."""
    from schemas.weights.chain import WeightsError
    from sao.export import from_weights, write

    try:
        policy = from_weights(cfg.kafka, trusted=load_trusted(str(cfg.run_dir / "keys" / PUBLIC_FILE)))
        print(f"model: version {policy.version} exported to {write(policy, cfg.run_dir / 'model')}", flush=True)
    except (ConfigError, WeightsError) as e:  # the run's results stand without it
        print(f"model: not exported ({e})", flush=True)


def start_afresh(run_dir: Path) -> None:
    """Remove an earlier run's state from `run_dir`: on a new embedded broker its checkpoints name
    offsets of topics that are gone, and its metrics would pass for this run's."""
    old = [run_dir / name for name in RUN_STATE if (run_dir / name).exists()]
    if old:
        print(f"sao up: a new run in {run_dir} (the earlier run's state removed)", flush=True)
    for path in old:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


PRINCIPALS = {"learner": "learner", "producer": "producer", "eval": "evaluator", "feeder": "feeder",
              "judge": "judge", "reward-join": "joiner"}
"""The principal (sao.access.ACCESS) each child connects as on a secured broker, by child name
(producer-0, producer-1, ... are producers)."""


def principal(child: str) -> str:
    return PRINCIPALS[child.split("-")[0] if child.startswith("producer-") else child]


def run_up(cfg: UpConfig, broker: EmbeddedBroker | None = None) -> None:
    """The run on `cfg.kafka`; on a secured embedded `broker` each child connects as its own
    principal, with only the rights its job needs."""
    ensure_topics(cfg.kafka)
    if not (cfg.run_dir / "keys" / PRIVATE_FILE).exists():  # a resumed run keeps its key
        create_keys(cfg.run_dir / "keys")
    ports = {f"producer-{i}": free_port() for i in range(cfg.producers)} | {"eval": free_port()}
    # one thread per process unless told otherwise: N processes each taking every core thrash
    env = {"OMP_NUM_THREADS": "1", **os.environ, "SAO_LOG_LEVEL": os.environ.get("SAO_LOG_LEVEL", "INFO"),
           "PYTHONUNBUFFERED": "1"}
    # a resumed run's feeder draws new tasks: its generator seeded past what was published
    cmds = commands(cfg, ports, feed_seed=prompts_published(cfg.kafka))
    child_env = {name: broker.service_env(principal(name)) if broker else {} for name in cmds}
    child_env["learner"]["OMP_NUM_THREADS"] = str(cfg.learner_threads)
    sup = Supervisor(cmds, cfg.run_dir / "logs", env, cfg.max_restarts, child_env)
    dash = Dashboard(sup, cfg.run_dir, {n: p for n, p in ports.items() if n.startswith("producer-")}, cfg.kafka,
                     cfg.steps)
    stop = stop_on_signals()
    t0 = time.monotonic()
    failure = None
    try:
        sup.start()
        print(" ".join(f"{c.name}={c.pid}" for c in sup.children.values()), flush=True)
        print(f"producers: {backend_line(cfg.producer_backend)}", flush=True)
        failure = supervise(cfg, sup, dash, stop)
        if failure is None and not stop.is_set() and "eval" in sup.children:
            last_evaluation(cfg, sup, dash)
    finally:
        sup.stop()
        dash.close()
        (cfg.run_dir / "processes.json").write_text(json.dumps(
            {"wall_s": time.monotonic() - t0, "processes": sup.summary()}, indent=1))
        if report.load_steps(cfg.run_dir):
            print(report.write(cfg.run_dir), end="")
            print(f"report: {cfg.run_dir / 'report.png'}", flush=True)
    if failure is None and cfg.export:
        export_final(cfg)
    if failure:
        raise SystemExit(f"sao up: {failure}; logs in {cfg.run_dir / 'logs'}")


SETTINGS_KEPT_APART = ("resume", "dashboard", "kafka", "broker")
"""UpConfig fields a resumed run does not take from up.json: how it is watched, and where Kafka is
(own broker: RUN_DIR/kafka again; a named cluster: up.json's unless named again)."""


def save_settings(cfg: UpConfig) -> None:
    """RUN_DIR/up.json: what `--resume` continues with."""
    settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in SETTINGS_KEPT_APART}
    kafka = {"bootstrap": cfg.kafka.bootstrap, "topic_prefix": cfg.kafka.topic_prefix}
    (cfg.run_dir / "up.json").write_text(json.dumps({"settings": settings, "kafka": kafka}, indent=1, default=str))


def resumed(cfg: UpConfig) -> UpConfig:
    """`cfg` with the settings of the run in `cfg.resume`; ConfigError if there is none to go on."""
    run_dir = Path(cfg.resume)
    try:
        saved = json.loads((run_dir / "up.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"--resume {run_dir}: no up.json there; not the run dir of a `sao up` run") from None
    types = {f.name: f.type for f in dataclasses.fields(UpConfig)}
    settings = {k: Path(v) if "Path" in str(types[k]) else v for k, v in saved["settings"].items() if k in types}
    out = dataclasses.replace(cfg, **settings)
    out.run_dir = run_dir  # the folder given, wherever the run was started from
    if not cfg.kafka.bootstrap:
        out.kafka.bootstrap, out.kafka.topic_prefix = saved["kafka"]["bootstrap"], saved["kafka"]["topic_prefix"]
    if not out.kafka.bootstrap and not (run_dir / "kafka").is_dir():
        raise ConfigError(f"--resume {run_dir}: its broker's data (kafka/) is gone; the run cannot continue")
    if not out.kafka.bootstrap and (run_dir / "kafka" / "access").is_dir():
        out.broker.secure = True  # a secured run's broker comes back secured, its credentials kept
    return out


def prompts_published(kafka: KafkaConfig) -> int:
    """Prompts ever published on the run's prompts topic (0 on a new run)."""
    from confluent_kafka import TopicPartition

    from schemas import topics as T
    from schemas.kafka import make_consumer
    from schemas.retry import retrying

    consumer = make_consumer(kafka, f"sao-up-{os.getpid()}")
    try:
        topic = kafka.topic(T.PROMPTS)
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        # a partition's leader may not be elected yet on a broker just (re)started
        return sum(retrying(lambda: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30))[1]
                   for p in parts)
    finally:
        consumer.close()


def run(cfg: UpConfig) -> None:
    if cfg.resume is not None:
        cfg = resumed(cfg)
        print(f"sao up: resuming the run in {cfg.run_dir}", flush=True)
    elif not cfg.kafka.bootstrap:  # our own broker, new and empty: nothing of an earlier run resumes
        start_afresh(cfg.run_dir)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.kafka.bootstrap and cfg.broker.data_dir is None:  # kept with the run, for --resume
        cfg.broker.data_dir = cfg.run_dir / "kafka"
    if cfg.resume is None:
        save_settings(cfg)
    with cluster(cfg.kafka, cfg.broker) as broker:
        run_up(cfg, broker)
