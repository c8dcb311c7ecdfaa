"""Every topic of the system, its partitions and its broker-side configuration (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message any topic takes, and the codec's limit (schemas.fields.Limits)."""
MAX_RECORD_BYTES = MAX_MESSAGE_BYTES + (1 << 20)
"""The largest message with room for its record overhead: what clients and brokers are set to
send, fetch and store (librdkafka, aiokafka, the embedded broker, docker-compose's Kafka)."""


@dataclass(frozen=True)
class Topic:
    suffix: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)

    def name(self, prefix: str = "sao") -> str:
        return f"{prefix}.{self.suffix}"


_BIG = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}

PROMPTS = Topic("prompts", 12)
TRAJECTORIES = Topic("trajectories", 12, _BIG)
PENDING = Topic("trajectories.pending", 12, _BIG)
REWARDS = Topic("rewards", 12)
# One partition keeps announcements ordered; producers read all of it with no shared group.
WEIGHTS = Topic("weights", 1, {"retention.ms": str(7 * 24 * 3600 * 1000), **_BIG})  # updates travel inline
DLQ = Topic("dlq", 1, _BIG)
# Producers that cannot reach the newest version ask the learner for an anchor; old asks expire.
WEIGHT_REQUESTS = Topic("weights.requests", 1, {"retention.ms": str(24 * 3600 * 1000)})
# One partition: the scores of a run in the order they were measured; kept as long as the weights.
EVALUATIONS = Topic("evaluations", 1, {"retention.ms": str(7 * 24 * 3600 * 1000)})

ALL = (PROMPTS, TRAJECTORIES, PENDING, REWARDS, WEIGHTS, DLQ, WEIGHT_REQUESTS, EVALUATIONS)


def replication(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of every topic on a cluster of `brokers`: three
    copies where there are three brokers or more, of which an acks=all write needs two, so one
    broker may be down without a write being lost or refused; fewer brokers, fewer copies."""
    factor = min(3, brokers)
    return factor, max(factor - 1, 1)
