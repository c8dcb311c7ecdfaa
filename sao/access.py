"""`sao access`: least privilege on a secured cluster: one SCRAM principal per kind of service, and
the ACLs that let each read and write what its job needs, nothing else (docs/security.md has the
table; `ACCESS` below is its one definition).

Kafka's own mechanisms, as Kafka documents them: SASL/SCRAM-SHA-512 credentials kept by the
cluster (KRaft stores their salted hashes in its metadata log), ACLs checked by KRaft's
`StandardAuthorizer` with nothing allowed where no ACL allows it. `apply` creates the topics
first (services never create the run's topics on a secured cluster: only `admin` may), then
upserts every principal's credentials and ACLs; it is idempotent, so a second run changes nothing
and a run with `--rotate` gives every principal a new password.

Each principal's password is written to `<dir>/<principal>.password` (mode 0600) and never
printed; `<dir>/<principal>.env` holds the `SAO_KAFKA_*` variables a service of that kind runs
with, the password by file (`SAO_KAFKA_PASSWORD_FILE`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from consumers.control import CONTROL
from schemas import topics as T
from schemas.files import atomic_file
from schemas.kafka import KafkaConfig, ensure_topics

log = logging.getLogger(__name__)

ADMIN = "admin"
"""The super user: the brokers' own inter-broker identity, `sao access`, `sao topics`, operators'
tools (`sao judge set-criterion`) and `sao up` on the broker it starts."""
MECHANISM = "SCRAM-SHA-512"
SCRAM_ITERATIONS = 8192


@dataclass(frozen=True)
class Grant:
    """Operations a principal may do on a topic, a group or a transactional id, by name (`*`: any)
    or by name prefix. `{p}` in `name` is the run's topic prefix."""

    resource: str  # topic | group | transactional_id
    name: str
    ops: tuple[str, ...]
    prefixed: bool = False

    def on(self, prefix: str) -> Grant:
        return Grant(self.resource, self.name.replace("{p}", prefix), self.ops, self.prefixed)

    def allows(self, resource: str, name: str, op: str) -> bool:
        return (resource == self.resource and (op in self.ops or "ALL" in self.ops)
                and (name.startswith(self.name) if self.prefixed else self.name in (name, "*")))


def topic(t: T.Topic | str, *ops: str) -> Grant:
    return Grant("topic", t if isinstance(t, str) else "{p}." + t.suffix, ops)


def groups(prefix: str, *ops: str) -> Grant:
    return Grant("group", prefix, ops or ("READ",), prefixed=True)


def group(name: str, *ops: str) -> Grant:
    return Grant("group", name, ops or ("READ",))


SEE_TOPICS = Grant("topic", "{p}.", ("DESCRIBE",), prefixed=True)
"""Every service may see which of the run's topics exist (and so creates none)."""
REPORT_BAD_INPUT = topic(T.DLQ, "WRITE")
"""Every service dead-letters input it cannot use: bad input is reported, never lost."""
FOLLOW_WEIGHTS = (topic(T.WEIGHTS, "READ"), groups("sao-weights-"), topic(T.WEIGHT_REQUESTS, "WRITE"))
"""A follower of the weights reads every announcement and may ask the learner for an anchor."""
LEARNER_BACKLOG = group("{p}-learner-progress", "DESCRIBE")
"""The learner's progress commits, read to hold rollouts back while it has work left (`--max-lag`)."""


@dataclass(frozen=True)
class Principal:
    services: str
    grants: tuple[Grant, ...] = field(default_factory=tuple)


ACCESS: dict[str, Principal] = {
    "learner": Principal("sao learner", (
        SEE_TOPICS, REPORT_BAD_INPUT,
        topic(T.TRAJECTORIES, "READ"), group("{p}-learner"), group("{p}-learner-progress"),
        topic(T.WEIGHTS, "WRITE", "READ"), groups("{p}-versions-"),
        topic(T.WEIGHT_REQUESTS, "READ"), groups("{p}-anchor-requests-"))),
    "producer": Principal("sao producer", (
        SEE_TOPICS, REPORT_BAD_INPUT, *FOLLOW_WEIGHTS, LEARNER_BACKLOG,
        topic(T.PROMPTS, "READ"), group("sao-producers"),
        topic(T.TRAJECTORIES, "WRITE"), topic(T.PENDING, "WRITE"))),
    "feeder": Principal("sao feed", (
        SEE_TOPICS, REPORT_BAD_INPUT, LEARNER_BACKLOG,
        topic(T.PROMPTS, "WRITE", "READ"), group("sao-producers", "DESCRIBE"), groups("sao-feed."))),
    "judge": Principal("sao judge, sao reward serve, sao reward publish", (
        SEE_TOPICS, REPORT_BAD_INPUT,
        topic(T.PENDING, "READ"), group("sao-judges"), groups("judge-control-"), groups("{p}.reward-serve-"),
        topic(CONTROL, "READ"),
        topic(T.REWARDS, "WRITE"))),
    "joiner": Principal("sao reward-join", (
        SEE_TOPICS, REPORT_BAD_INPUT,
        topic(T.PENDING, "READ"), topic(T.REWARDS, "READ"), topic(T.TRAJECTORIES, "WRITE"),
        # faust's own topics (ticks, the table's changelog, its leader topic), group and transactions
        Grant("topic", "{p}.reward-join", ("ALL",), prefixed=True), groups("{p}.reward-join"),
        Grant("transactional_id", "{p}.reward-join", ("ALL",), prefixed=True))),
    "evaluator": Principal("sao eval", (
        SEE_TOPICS, REPORT_BAD_INPUT, *FOLLOW_WEIGHTS,
        topic(T.EVALUATIONS, "WRITE", "READ"), groups("sao-eval-read-"))),
    "serve": Principal("sao serve", (
        SEE_TOPICS, REPORT_BAD_INPUT, *FOLLOW_WEIGHTS,
        topic(T.TRAJECTORIES, "WRITE"), topic(T.PENDING, "WRITE"))),
    "observer": Principal("sao audit, sao export, sao report", (
        Grant("topic", "{p}.", ("READ", "DESCRIBE"), prefixed=True), group("*", "DESCRIBE"),
        groups("{p}-audit-"), groups("sao-up-"), groups("sao-weights-"), groups("sao-eval-read-"))),
}
"""Who may do what. Only the learner writes `sao.weights`; producers cannot read rewards or write
weights; judges write rewards (and dead letters) only."""


def allows(principal: str, resource: str, name: str, op: str, prefix: str = "sao") -> bool:
    """Whether `ACCESS` lets `principal` do `op` on the named resource of the run `prefix`."""
    return principal == ADMIN or any(g.on(prefix).allows(resource, name, op) for g in ACCESS[principal].grants)


def markdown(prefix: str = "sao") -> str:
    """`ACCESS` as the table docs/security.md shows (a test keeps the two equal)."""
    def names(p: Principal, resource: str, op: str) -> list[str]:
        return [f"`{g.name}*`" if g.prefixed else f"`{g.name}`" for g in (g.on(prefix) for g in p.grants)
                if g.resource == resource and (op in g.ops or "ALL" in g.ops)]

    def cell(names_: list[str]) -> str:
        return ", ".join(names_) or "-"

    rows = ["| principal | services | reads | writes | groups (read; *describe*) |", "| --- | --- | --- | --- | --- |"]
    for name, p in ACCESS.items():
        read = names(p, "group", "READ")
        described = [n for n in names(p, "group", "DESCRIBE") if n not in read]
        rows.append(f"| `{name}` | {p.services} | {cell(names(p, 'topic', 'READ'))} | {cell(names(p, 'topic', 'WRITE'))} | "
                    f"{cell(read)}{''.join(f'; *{n}*' for n in described)} |")
    return "\n".join(rows) + "\n"


def acl_bindings(prefix: str) -> list:
    """`ACCESS` as Kafka ACL bindings for the run whose topics start with `prefix`."""
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    return [AclBinding(ResourceType[g.resource.upper()], g.name, ResourcePatternType.PREFIXED if g.prefixed
                       else ResourcePatternType.LITERAL, f"User:{name}", "*", AclOperation[op],
                       AclPermissionType.ALLOW)
            for name, p in ACCESS.items() for g in (g.on(prefix) for g in p.grants) for op in g.ops]


def client_settings(principal: str, ca: Path | None) -> dict[str, str]:
    """The librdkafka settings of `principal` on a SASL_SSL listener (its password aside)."""
    return {"security.protocol": "SASL_SSL", "sasl.mechanism": MECHANISM, "sasl.username": principal,
            **({"ssl.ca.location": str(ca)} if ca else {})}


def client_env(principal: str, folder: Path, ca: Path | None) -> dict[str, str]:
    """`client_settings` as the SAO_KAFKA_* variables of a service process, the password by file."""
    env = {"SAO_KAFKA_" + k.upper().replace(".", "_"): v for k, v in client_settings(principal, ca).items()}
    return env | {"SAO_KAFKA_PASSWORD_FILE": str(password_file(folder, principal))}


def password_file(folder: Path, principal: str) -> Path:
    return Path(folder) / f"{principal}.password"


def password(folder: Path, principal: str, rotate: bool = False) -> str:
    """The principal's password kept in `folder`, made (or remade with `rotate`) as needed."""
    path = password_file(folder, principal)
    if rotate or not path.exists():
        Path(folder).mkdir(parents=True, exist_ok=True)
        atomic_file(path, secrets.token_urlsafe(24).encode(), mode=0o600)
    return path.read_text().strip()


def upsert_credentials(kafka: KafkaConfig, folder: Path, principals: Iterable[str], rotate: bool = False,
                       timeout: float = 30.0) -> None:
    """Create or update each principal's SCRAM credentials on the cluster."""
    from confluent_kafka.admin import AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    upserts = [UserScramCredentialUpsertion(p, info, password(folder, p, rotate).encode()) for p in principals]
    admin = AdminClient(kafka.client())  # held until every future settles: its handle serves them
    for fut in admin.alter_user_scram_credentials(upserts, request_timeout=timeout).values():
        fut.result(timeout)


def apply(kafka: KafkaConfig, folder: Path, ca: Path | None, rotate: bool = False, timeout: float = 30.0,
          also_prefixes: Iterable[str] = ()) -> list[str]:
    """Topics, credentials and ACLs of every principal in `ACCESS`, as the admin `kafka` names, for
    its topic prefix and each of `also_prefixes` (another pipeline on the same cluster); writes each
    principal's password and env file (naming `kafka`'s prefix) to `folder`. Returns the principals."""
    from confluent_kafka.admin import AdminClient

    prefixes = [kafka.topic_prefix, *also_prefixes]
    for prefix in prefixes:
        ensure_topics(replace(kafka, topic_prefix=prefix), (*T.ALL, CONTROL), timeout)
    upsert_credentials(kafka, folder, ACCESS, rotate, timeout)
    admin = AdminClient(kafka.client())
    bindings = list(dict.fromkeys(b for prefix in prefixes for b in acl_bindings(prefix)))  # groups: one name for all
    for fut in admin.create_acls(bindings, request_timeout=timeout).values():
        fut.result(timeout)
    for name in ACCESS:
        env = client_env(name, folder, ca) | {"SAO_KAFKA_BOOTSTRAP": kafka.bootstrap,
                                              "SAO_KAFKA_TOPIC_PREFIX": kafka.topic_prefix}
        atomic_file(Path(folder) / f"{name}.env", "".join(f"{k}={v}\n" for k, v in env.items()).encode())
    return list(ACCESS)


@dataclass(kw_only=True)
class AccessConfig:
    dir: Path = Path("access")
    """Where each principal's password (`<name>.password`, mode 0600) and variables (`<name>.env`)
    are written."""
    ca: Path | None = None
    """The CA certificate clients trust, named in the env files (`ssl.ca.location`)."""
    rotate: bool = False
    """New passwords for every principal (the services must restart with theirs)."""
    prepare: bool = False
    """Only write the passwords (admin's included) and, with --tls-dir, a throwaway CA and the
    brokers' certificate, touching no cluster: what a deployment mounts before its broker starts
    (docker-compose.secure.yml)."""
    tls_dir: Path | None = None
    """--prepare: where the CA (`ca.pem`) and the brokers' key and certificate (`broker.pem`) go
    (kept if already there)."""
    tls_hosts: str = "localhost,127.0.0.1"
    """--prepare: the names the brokers' certificate is valid for, comma separated."""
    also_prefixes: tuple[str, ...] = ()
    """Topic prefixes besides --kafka.topic-prefix whose topics get the same table (another
    pipeline on this cluster: compose's agent profile runs on `agent`)."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    """The cluster, as its admin (`SAO_KAFKA_SASL_USERNAME=admin` and its password file)."""


def prepare(cfg: AccessConfig) -> list[str]:
    """Every principal's password in `cfg.dir` and, with `cfg.tls_dir`, the TLS files; no cluster."""
    from sao.tls import make_tls

    if cfg.tls_dir is not None:
        make_tls(cfg.tls_dir, cfg.tls_hosts.split(","))
    names = [ADMIN, *ACCESS]
    for name in names:
        password(cfg.dir, name, cfg.rotate)
    return names


def run(cfg: AccessConfig) -> None:
    if cfg.prepare:
        names = prepare(cfg)
        print(f"passwords of {', '.join(names)} in {cfg.dir}" + (f"; CA and broker certificate in {cfg.tls_dir}"
                                                                  if cfg.tls_dir else ""), flush=True)
        return
    names = apply(cfg.kafka, cfg.dir, cfg.ca, cfg.rotate, also_prefixes=cfg.also_prefixes)
    print(f"access applied on {cfg.kafka.bootstrap}: {', '.join(names)} (passwords and env files in {cfg.dir})",
          flush=True)
