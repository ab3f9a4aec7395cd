"""One soak run, end to end: services, proxies, workers, traffic, faults, drain, figures.

:func:`run_soak` returns a :class:`SoakResult` (the figures, the fault log, ``ok``); everything it
started is stopped in its ``finally``, and the run's ledger tables are dropped unless ``keep``.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from .. import services
from .faults import Fault, FaultScheduler
from .ledger import Ledger
from .processes import ROOT, Processes, Tansu, Worker
from .proxy import TcpProxy
from .report import Figures, collect, format_report
from .traffic import Producer, Targets

__all__ = ["INTEGRATIONS", "SoakConfig", "SoakResult", "run_soak"]

log = logging.getLogger(__name__)
INTEGRATIONS = ("celery", "rabbitmq", "kafka", "replay")


@dataclass
class SoakConfig:
    duration: float = 120.0
    seed: int = 1
    integrations: list[str] = field(default_factory=lambda: list(INTEGRATIONS))
    rate: float = 8.0            # operations started per second, over all integrations
    lease: float = 2.0
    work: float = 0.15           # the longest simulated handler work, seconds
    fault_gap: tuple[float, float] = (4.0, 10.0)
    drain_timeout: float = 180.0
    postgres_dsn: str = "postgresql://postgres@127.0.0.1:5432/test"
    rabbitmq_url: str = "amqp://guest:guest@127.0.0.1:5672//"
    keep: bool = False
    write: str = "idempotent"    # "fenced": the bare fenced increment; "plain": a plain one in atomic() (ledger.py)


@dataclass
class SoakResult:
    config: SoakConfig
    figures: dict[str, Figures]
    faults: list[Fault]
    seconds: float
    replays: Counter[str]
    producer_errors: list[str]
    logdir: Path

    @property
    def lost(self) -> int:
        return sum(len(f.lost) for f in self.figures.values())

    @property
    def applied_twice(self) -> int:
        return sum(len(f.applied_twice) for f in self.figures.values())

    @property
    def unexplained(self) -> int:
        return sum(len(f.unexplained) for f in self.figures.values())

    @property
    def ok(self) -> bool:
        """No operation lost, none applied twice, and every handler re-run in a window the
        guarantees name (docs/guarantees.md: a fault or a lost lease explains it)."""
        return self.lost == 0 and self.applied_twice == 0 and self.unexplained == 0

    def fault_counts(self) -> Counter[str]:
        return Counter(f.kind for f in self.faults if not f.detail.startswith("failed"))

    def report(self) -> str:
        head = (f"soak: seed {self.config.seed}, {self.seconds:.0f}s of traffic, integrations "
                f"{','.join(self.config.integrations)}, lease {self.config.lease}s, {self.config.write} writes\n"
                f"faults: {', '.join(f'{k} {v}' for k, v in sorted(self.fault_counts().items()))}\n"
                f"replay runs: {dict(self.replays)}\n")
        if self.producer_errors:
            head += f"producer errors: {self.producer_errors[:5]}\n"
        verdict = (f"\nRESULT: {'PASS' if self.ok else 'FAIL'}: {self.lost} lost, {self.applied_twice} applied twice, "
                   f"{self.unexplained} unexplained re-runs")
        return head + format_report(self.figures, self.seconds) + verdict


class Run:
    """The moving parts of one run (see :func:`run_soak`)."""

    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.id = f"{int(time.time())}_{uuid.uuid4().hex[:6]}"
        self.namespace = f"soak-{self.id}"
        self.logdir = Path(tempfile.mkdtemp(prefix=f"soak-{self.id}-"))
        self.ledger = Ledger(config.postgres_dsn, self.id)
        self.proxies: dict[str, TcpProxy] = {}
        self.queues = {name: f"soak-{self.id}-{name}" for name in ("celery", "rabbitmq", "replay")}
        self.topic = f"soak-{self.id}"
        self.replays: Counter[str] = Counter()
        self.kafka_members = 0
        self.processes: Processes | None = None

    def start(self) -> Processes:
        c = self.config
        self.ledger.create()
        env = {"SOAK_DSN": c.postgres_dsn, "SOAK_RUN": self.id, "SOAK_WORK": str(c.work),
               "SOAK_NAMESPACE": self.namespace, "SOAK_LEASE": str(c.lease),
               "SOAK_CELERY_QUEUE": self.queues["celery"], "SOAK_WRITE": c.write}
        if c.write == "plain":  # every worker's Deduplicator gets the outcome table (DEDUPE_SQL_*)
            from dedupe_worker.sql import SqlOutcomes

            SqlOutcomes(c.postgres_dsn, table=self.ledger.outcomes).create_table()
            env.update(DEDUPE_SQL_DSN=c.postgres_dsn, DEDUPE_SQL_TABLE=self.ledger.outcomes)
        procs = self.processes = Processes(self.logdir, env)
        redis = procs.start_redis()
        self.proxies["redis"] = TcpProxy(redis.port, "redis")
        broker = urlsplit(c.rabbitmq_url)
        self.proxies["amqp"] = TcpProxy(broker.port or 5672, "amqp")
        redis_url = f"redis://127.0.0.1:{self.proxies['redis'].port}/0"
        amqp_url = urlunsplit(broker._replace(netloc=f"{broker.username or 'guest'}:{broker.password or 'guest'}"
                                                     f"@127.0.0.1:{self.proxies['amqp'].port}"))
        procs.env.update(SOAK_REDIS_URL=redis_url, SOAK_CELERY_BROKER=amqp_url)
        self.dedupe_args = ["--redis-url", redis_url, "--namespace", self.namespace, "--lease", str(c.lease)]
        self.amqp_url = amqp_url
        self.declare_queues()
        if "kafka" in c.integrations:
            tansu_port = services.free_port()
            self.proxies["kafka"] = TcpProxy(tansu_port, "kafka")
            procs.tansu = Tansu(tansu_port, self.proxies["kafka"].port)
            self.create_topic(f"127.0.0.1:{tansu_port}")
            for _ in range(2):
                self.add_kafka_consumer()
        if "celery" in c.integrations:
            procs.celery("celery-0", self.queues["celery"])
        if {"rabbitmq", "replay"} & set(c.integrations):
            queues = [a for q in ("rabbitmq", "replay") if q in c.integrations for a in ("--queue", self.queues[q])]
            for n in range(2):
                procs.consumer(f"rabbitmq-{n}", "rabbitmq", ["rabbitmq", "--url", amqp_url, *queues, *self.dedupe_args])
        return procs

    def declare_queues(self) -> None:
        from kombu import Connection

        with Connection(self.config.rabbitmq_url) as conn:
            channel = conn.channel()
            for name in self.queues.values():
                for queue in (name, f"{name}.dlq"):
                    channel.queue_declare(queue=queue, durable=True, auto_delete=False)

    def delete_queues(self) -> None:
        from kombu import Connection

        with Connection(self.config.rabbitmq_url) as conn:
            channel = conn.channel()
            for name in self.queues.values():
                for queue in (name, f"{name}.dlq", f"{name}.delay"):
                    channel.queue_delete(queue=queue)

    def create_topic(self, bootstrap: str) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": bootstrap})
        for future in admin.create_topics([NewTopic(self.topic, 3, 1), NewTopic(f"{self.topic}.dlq", 1, 1)],
                                          operation_timeout=20).values():
            future.result(20)

    def add_kafka_consumer(self) -> Worker:
        assert self.processes is not None
        bootstrap = f"127.0.0.1:{self.proxies['kafka'].port}"
        name = f"kafka-{self.kafka_members}"
        self.kafka_members += 1
        return self.processes.consumer(name, "kafka", ["kafka", "--bootstrap", bootstrap, "--topic", self.topic,
                                                       "--group", f"soak-{self.id}", *self.dedupe_args])

    def replay_once(self) -> None:
        """One ``dedupe-worker replay rabbitmq`` pass over the replay queue's dead letters."""
        queue = self.queues["replay"]
        args = [sys.executable, "-m", "dedupe_worker", "replay", "rabbitmq", "--url", self.amqp_url,
                "--from", f"{queue}.dlq", *self.dedupe_args[:4], "--json", "--no-progress"]
        try:
            done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)
            summary = json.loads(done.stdout or "{}")
        except (subprocess.TimeoutExpired, ValueError):
            self.replays["errors"] += 1
            return
        self.replays["runs"] += 1
        for name in ("replayed", "already_applied", "left_in_place", "failed"):
            self.replays[name] += int(summary.get(name, 0))

    def dlq_depth(self) -> int:
        from kombu import Connection

        from ..rabbitmq_fixtures import depth

        with Connection(self.config.rabbitmq_url) as conn:
            return depth(conn, f"{self.queues['replay']}.dlq")

    def queued(self) -> int:
        """Messages still ready in the run's RabbitMQ queues and their delay queues (copies not
        consumed yet: the drain waits for them too, so a late copy cannot escape the count)."""
        from amqp.exceptions import NotFound
        from kombu import Connection

        total = 0
        with Connection(self.config.rabbitmq_url) as conn:
            for queue in (q for name in self.queues.values() for q in (name, f"{name}.delay")):
                channel = conn.channel()  # a passive declare of a missing queue closes its channel
                try:
                    total += int(channel.queue_declare(queue=queue, passive=True).message_count)
                except NotFound:
                    pass
                finally:
                    channel.close()
        return total

    def unapplied(self) -> int:
        return int(self.ledger.rows("SELECT count(*) FROM {accounts} WHERE balance = 0")[0][0])

    def heal(self) -> None:
        """After the faults: resume, reconnect and restart everything."""
        assert self.processes is not None
        for proxy in self.proxies.values():
            proxy.unblock()
        for worker in list(self.processes.workers.values()):
            worker.resume()
            if not worker.alive:
                worker.start()


def run_soak(config: SoakConfig) -> SoakResult:
    """Run the soak described by ``config``; see the package docstring."""
    run = Run(config)
    rng = random.Random(config.seed)
    stop = threading.Event()
    print(f"soak {run.id}: seed {config.seed}, duration {config.duration:.0f}s, logs in {run.logdir}", flush=True)
    try:
        procs = run.start()
        time.sleep(3.0)  # let the consumers connect and the Kafka group form
        producer = Producer(run.ledger, Targets(config.rabbitmq_url, run.queues["celery"], run.queues["rabbitmq"],
                                                run.queues["replay"], f"127.0.0.1:{run.proxies['kafka'].port}"
                                                if "kafka" in run.proxies else "", run.topic),
                            list(config.integrations), random.Random(rng.random()), config.rate)
        producer.ledger = Ledger(config.postgres_dsn, run.id)  # its own connection
        producer.connect()
        scheduler = FaultScheduler(procs, run.proxies, list(config.integrations), config.seed, config.lease,
                                   gap=config.fault_gap, add_kafka_consumer=run.add_kafka_consumer,
                                   ledger=Ledger(config.postgres_dsn, run.id), work=config.work)
        began = time.monotonic()
        until = began + config.duration
        threads = [threading.Thread(target=producer.run, args=(config.duration, stop), daemon=True),
                   threading.Thread(target=scheduler.run, args=(until,), daemon=True)]
        for t in threads:
            t.start()
        while time.monotonic() < until:
            if "replay" in config.integrations:
                run.replay_once()
            time.sleep(5.0)
        for t in threads:
            t.join(120)
        seconds = time.monotonic() - began
        producer.close()
        run.heal()
        drain_until = time.monotonic() + config.drain_timeout
        while time.monotonic() < drain_until:
            left = run.unapplied()
            dlq = run.dlq_depth() if "replay" in config.integrations else 0
            queued = run.queued()
            print(f"drain: {left} operations not applied yet, {dlq} dead letters, {queued} queued", flush=True)
            if left == 0 and dlq == 0 and queued == 0:
                break
            if dlq:
                run.replay_once()
            time.sleep(3.0)
        time.sleep(config.lease * 2 + 1)  # a late zombie or re-run would show now
        figures = collect(run.ledger, list(config.integrations), scheduler.log, config.lease, producer.sent)
        return SoakResult(config, figures, scheduler.log, seconds, run.replays, producer.errors, run.logdir)
    finally:
        stop.set()
        if run.processes is not None:
            run.processes.close()
        for proxy in run.proxies.values():
            proxy.close()
        try:
            run.delete_queues()
        except Exception:
            log.exception("could not delete the soak's queues")
        if not config.keep:
            run.ledger.drop()
        run.ledger.close()
