"""The seeded fault scheduler: real faults at random instants, one at a time, logged.

Kinds (each needs what it acts on to be part of the run):

==================  ===========================================================================
sigkill             SIGKILL a worker or consumer (a Celery worker with its pool children) while
                    it is handling messages, then start it again after a short pause
sigstop             SIGSTOP a consumer for longer than the lease, then SIGCONT: a zombie
redis_restart       SIGKILL the private Redis (AOF, ``appendfsync always``), start it again on
                    the same port and data directory
broker_cut          close every connection through the RabbitMQ or the Kafka proxy
kafka_rebalance     a Kafka consumer joins the group, and a few seconds later an older one leaves
redis_unreachable   the Redis proxy drops every connection and refuses new ones for 2-4 s
redis_flush         SIGKILL the private Redis, delete its data, start it again empty on the same
                    port: Redis forgets every claim and outcome (a restart without persistence)
==================  ===========================================================================

The order is a shuffled cycle of the kinds (so every kind recurs evenly) and every choice comes
from one ``random.Random(seed)``: the same seed gives the same sequence of faults and targets.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .ledger import Ledger
from .processes import Processes, Worker
from .proxy import TcpProxy

__all__ = ["KINDS", "Fault", "FaultScheduler", "session_pids"]

log = logging.getLogger(__name__)

KINDS = ("sigkill", "sigstop", "redis_restart", "broker_cut", "kafka_rebalance", "redis_unreachable", "redis_flush")


@dataclass
class Fault:
    """One fault: when it began and ended (``time.time()``), what it hit."""

    kind: str
    target: str
    integrations: tuple[str, ...]
    start: float
    end: float = 0.0
    pids: tuple[int, ...] = ()
    detail: str = ""


def session_pids(sid: int) -> tuple[int, ...]:
    """Every live process whose session id is ``sid`` (a worker and its pool children)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                found.append(int(entry))
    return tuple(found)


@dataclass
class FaultScheduler:
    processes: Processes
    proxies: dict[str, TcpProxy]
    integrations: list[str]
    seed: int
    lease: float
    gap: tuple[float, float] = (4.0, 10.0)
    log: list[Fault] = field(default_factory=list)
    add_kafka_consumer: Callable[[], Worker] | None = None
    ledger: Ledger | None = None
    work: float = 0.15

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.stop = threading.Event()

    def kinds(self) -> list[str]:
        has = set(self.integrations)
        kinds = ["sigkill", "sigstop", "redis_restart", "redis_unreachable", "redis_flush"]
        if has & {"rabbitmq", "celery", "replay", "kafka"}:
            kinds.append("broker_cut")
        if "kafka" in has:
            kinds.append("kafka_rebalance")
        if not has & {"rabbitmq", "kafka", "replay"}:
            kinds.remove("sigstop")  # only consumers are paused
        return kinds

    def run(self, until: float) -> None:
        """Inject faults until ``time.monotonic() >= until`` or ``stop`` is set."""
        while not self.stop.is_set():
            cycle = self.kinds()
            self.rng.shuffle(cycle)
            for kind in cycle:
                if self.stop.wait(self.rng.uniform(*self.gap)) or time.monotonic() >= until:
                    return
                try:
                    fault = getattr(self, kind)()
                except Exception as exc:  # a fault that could not be injected is reported, not fatal
                    log.exception("fault %s failed", kind)
                    fault = Fault(kind, "-", (), time.time(), detail=f"failed: {exc!r}")
                fault.end = fault.end or time.time()
                self.log.append(fault)
                print(f"[fault {len(self.log):3d}] {time.strftime('%H:%M:%S')} {fault.kind:17s} "
                      f"{fault.target:12s} {fault.detail}", flush=True)

    def served_by(self, worker: Worker) -> tuple[str, ...]:
        """The integrations whose traffic ``worker`` handles (the RabbitMQ consumers also consume
        the queue the replay republishes to)."""
        if worker.integration == "rabbitmq":
            return tuple(i for i in ("rabbitmq", "replay") if i in self.integrations)
        return (worker.integration,)

    def workers(self, *integrations: str) -> list[Worker]:
        return sorted((w for w in self.processes.workers.values() if w.integration in integrations and w.alive),
                      key=lambda w: w.name)

    def mid_handler(self, pids: tuple[int, ...], wait: float = 5.0) -> str:
        """Wait (up to ``wait`` s) until one of ``pids`` is inside a handler; say whether it was."""
        deadline = time.monotonic() + wait
        while self.ledger is not None and time.monotonic() < deadline:
            if self.ledger.busy(pids):
                time.sleep(self.rng.uniform(0.0, self.work * 1.2))  # anywhere in it, or just after
                return "mid-handler"
            time.sleep(0.005)
        return "idle"

    def sigkill(self) -> Fault:
        target = self.rng.choice(self.workers("celery", "rabbitmq", "kafka"))
        assert target.proc is not None
        pids = session_pids(target.proc.pid)
        moment = self.mid_handler(pids)
        fault = Fault("sigkill", target.name, self.served_by(target), time.time(), pids=pids)
        target.kill()
        if self.ledger is not None and moment == "mid-handler" and not self.ledger.busy(pids):
            moment = "just after a handler"
        time.sleep(self.rng.uniform(0.5, 2.0))
        target.start()
        fault.detail = f"{moment}, pids {list(pids)}, restarted as {target.proc.pid}"
        return fault

    def sigstop(self) -> Fault:
        target = self.rng.choice(self.workers("rabbitmq", "kafka"))
        assert target.proc is not None
        pause = self.lease + self.rng.uniform(1.0, 3.0)
        moment = self.mid_handler((target.proc.pid,))
        fault = Fault("sigstop", target.name, self.served_by(target), time.time(), pids=(target.proc.pid,))
        target.pause()
        self.stop.wait(pause)
        target.resume()
        fault.detail = f"{moment}, pid {target.proc.pid} stopped {pause:.1f}s (lease {self.lease}s)"
        return fault

    def redis_restart(self) -> Fault:
        down = self.rng.uniform(0.5, 2.0)
        fault = Fault("redis_restart", "redis", tuple(self.integrations), time.time())
        self.processes.restart_redis(down)
        fault.detail = f"down {down:.1f}s"
        return fault

    def redis_flush(self) -> Fault:
        down = self.rng.uniform(0.5, 2.0)
        fault = Fault("redis_flush", "redis", tuple(self.integrations), time.time())
        self.processes.restart_redis(down, forget=True)
        fault.detail = f"down {down:.1f}s, every record lost"
        return fault

    def redis_unreachable(self) -> Fault:
        seconds = self.rng.uniform(2.0, 4.0)
        fault = Fault("redis_unreachable", "redis-proxy", tuple(self.integrations), time.time())
        cut = self.proxies["redis"].block(seconds)
        self.stop.wait(seconds)
        self.proxies["redis"].unblock()
        fault.detail = f"{seconds:.1f}s, {cut} connections dropped"
        return fault

    def broker_cut(self) -> Fault:
        name = self.rng.choice(sorted(p for p in ("amqp", "kafka") if p in self.proxies))
        hit = ("kafka",) if name == "kafka" else tuple(i for i in self.integrations if i != "kafka")
        fault = Fault("broker_cut", f"{name}-proxy", hit, time.time())
        fault.detail = f"{self.proxies[name].cut()} connections cut"
        return fault

    def kafka_rebalance(self) -> Fault:
        assert self.add_kafka_consumer is not None
        fault = Fault("kafka_rebalance", "kafka-group", ("kafka",), time.time())
        older = self.workers("kafka")
        joined = self.add_kafka_consumer()
        self.stop.wait(self.rng.uniform(3.0, 6.0))
        leaving = self.rng.choice(older)
        leaving.terminate(20)
        del self.processes.workers[leaving.name]
        fault.detail = f"{joined.name} joined, {leaving.name} left"
        assert leaving.proc is not None
        fault.pids = (leaving.proc.pid,)
        return fault
