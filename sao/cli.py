"""`sao`: the one command-line entry point, one subcommand per service.

Each subcommand names a module with a config dataclass and a `run(cfg)` loop; modules are imported
only when their subcommand runs, so `sao broker` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from schemas.config import one_line_errors, parse
from schemas.kafka import FatalKafkaError

# subcommand -> (module, config class, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "broker": ("sao.broker", "BrokerConfig", "run the embedded Apache Kafka broker (KRaft) on loopback"),
    "up": ("sao.up", "UpConfig", "the whole pipeline on this machine with a live dashboard and a report (make run)"),
    "report": ("sao.report", "ReportConfig", "redo report.png and summary.txt of a `sao up` run directory"),
    "access": ("sao.access", "AccessConfig", "secured cluster: every service's SCRAM credentials and least-privilege ACLs"),
    "topics": ("sao.topics", "TopicsConfig", "create every sao topic with its partitions and configs, then exit"),
    "audit": ("sao.audit", "AuditConfig", "account for every prompt and trajectory of a run; exit 1 on any unexplained"),
    "demo": ("sao.demo", "DemoConfig", "broker + topics + a visible produce -> consume round trip"),
    "producer": ("producers.service", "ProducerConfig", "play prompts from sao.prompts, publish trajectories"),
    "feed": ("producers.feeder.service", "FeedConfig", "publish prompts (JSONL or env generator) with backpressure"),
    "warmup": ("sao.warmup", "WarmupConfig", "teach a base model an env's own demonstrations before RL (the cold start)"),
    "keys": ("sao.keys", "KeysConfig", "a new Ed25519 key pair: the learner signs weight announcements, followers verify"),
    "export": ("sao.export", "ExportConfig", "write a policy version as a folder transformers and vllm serve load"),
    "eval": ("producers.evaluate.service", "EvalConfig", "score every Nth weight version on held-out tasks, publish the results"),
    "serve": ("producers.serve.service", "ServeConfig", "completions and chat (rollout proxy) over the hf backend, following sao.weights"),
    "learner": ("learner.service", "LearnerConfig", "streaming SAO learner: trajectories in, FSDP2 training, weights out"),
    "reward-join": ("consumers.joiner", "JoinerConfig", "join pending trajectories with live rewards (faust), publish them"),
    "reward publish": ("consumers.rewards", "PublishConfig", "publish one reward for a trajectory id"),
    "reward serve": ("consumers.endpoint", "RewardServeConfig", "HTTP endpoint POST /rewards (bearer token) onto sao.rewards"),
    "judge": ("consumers.judge", "JudgeConfig", "score pending trajectories with a judge, publish rewards"),
    "judge set-criterion": ("consumers.control", "CriterionConfig", "switch the criterion of running judges"),
}


def usage() -> str:
    lines = ["usage: sao <command> [--help] [flags]", "", "commands:"]
    lines += [f"  {name:<20} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Every flag can also be set as an SAO_* environment variable (docs/configuration.md)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if " ".join(argv[:2]) in COMMANDS:  # a two-word command: `sao reward publish`
        argv = [" ".join(argv[:2]), *argv[2:]]
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    module_name, config_name, help_ = COMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    with one_line_errors(f"sao {argv[0]}"):
        cfg = parse(getattr(module, config_name), argv[1:], description=module.__doc__ or help_)
        logging.basicConfig(level=os.environ.get("SAO_LOG_LEVEL", "INFO"),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            module.run(cfg)
        except FatalKafkaError as e:  # a refusal (ACLs, credentials) or a vanished topic: no retry fixes it
            print(f"sao {argv[0]}: {type(e).__name__}: {e}", file=sys.stderr)
            raise SystemExit(1) from None
