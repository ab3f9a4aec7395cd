"""Client CPU per message of the Kafka consumer's own work, without a broker in the measured span.

    python -m bench.kafka_cpu [--redis-url URL] [--messages N] [--rounds R] [--gc on|off|frozen] [--callgrind]

Where :mod:`bench.kafka_consumer` times the whole loop against a broker, this prices the parts:
``consumer`` is :meth:`DedupeKafkaConsumer.process` on records built in memory (batches of 500
over 4 partitions, the default key header and body fingerprint; the commit is not sent), and
``engine`` is :func:`~dedupe_worker.decide_many` alone on the same keys (one pacing kept across
batches, as the consumer keeps one). Each is timed on new keys, then again on the same keys
(all duplicates), with ``time.process_time``; the handler does nothing. Besides the medians it
counts the garbage collections that ran in the measured spans and their time: a full collection
walks every object of the process, so its cost depends on the heap of the application as much
as on what a message allocates. ``--gc off`` runs the measured spans with the collector off
(the cost of the code alone); ``--gc frozen`` calls ``gc.freeze()`` once before them, as a server
may after start-up, so full collections skip everything that existed then.

``--callgrind``: the consumer's instructions per message instead of its time, which a shared
machine does not disturb, in all and by library (the interpreter running our Python and redis-py's,
hiredis, the packer, the rest; ``callgrind_annotate``'s self counts).
The consumer runs under ``valgrind --tool=callgrind`` on N and 2N new keys (and, in two more runs,
the same again as duplicates); the difference of the totals over N is one message's cost
(start-up, imports and the first batches cancel). Counted: the main thread only (the lease
renewer and librdkafka's threads run by the clock, which valgrind slows), with the collector off
and whole batches claimed at once (``flush_after`` 1 s: under valgrind handlers look slow, which
would change the chunking from run to run).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis
from confluent_kafka import Message

from dedupe_worker import Deduplicator, decide_many
from dedupe_worker._engine import Pacing
from dedupe_worker.kafka import DedupeKafkaConsumer
from dedupe_worker.kafka._positions import PartitionState

PARTITIONS = 4
BATCH = 500


class Offline(DedupeKafkaConsumer):
    """The consumer with its commit left out (there is no group to commit to)."""

    def _commit(self, offsets: list[Any]) -> None:
        self.stats["committed"] += 1


class Collections:
    """Counts garbage collections by generation, and their time, while ``on``."""

    def __init__(self) -> None:
        self.count: Counter[int] = Counter()
        self.seconds: Counter[int] = Counter()
        self.on = False
        self._began = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._began = time.process_time()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.process_time() - self._began


def records(namespace: str, count: int, first_offset: int) -> list[Message]:
    return [Message(topic="bench", partition=i % PARTITIONS, offset=first_offset + i // PARTITIONS,
                    key=str(i).encode(), value=b'{"amount": 1}',
                    headers=[("idempotency-key", f"{namespace}-{i}".encode())]) for i in range(count)]


def timed(run: Callable[[], None], count: int, collections: Collections, mode: str) -> float:
    """Client CPU µs per message of ``run()``."""
    if mode == "off":
        gc.disable()
    collections.on = True
    began = time.process_time()
    try:
        run()
    finally:
        spent = time.process_time() - began
        collections.on = False
        gc.enable()
    return 1e6 * spent / count


def run_only(mode: str, redis_url: str, bootstrap: str, count: int, made: int) -> None:
    """One run for ``--callgrind``: ``count`` new keys through the consumer, then (``dup``) the same
    keys again; the collector off, whole batches claimed at once (see the module doc). ``made``
    records are built, whatever ``count``: building them is not counted."""
    gc.disable()
    client = redis.Redis.from_url(redis_url)
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    dedupe = Deduplicator(client, namespace=namespace, result_ttl=300)
    consumer = Offline({"bootstrap.servers": bootstrap, "group.id": "bench-kafka-cpu", "log_level": 0}, ["bench"],
                       lambda message: None, dedupe)
    consumer.pacing.flush_after = 1.0
    for partition in range(PARTITIONS):
        consumer._partitions[("bench", partition)] = PartitionState()
    batch = records(namespace, made, 0)
    for _ in range(2 if mode == "dup" else 1):
        for start in range(0, count, BATCH):
            consumer.process(batch[start:start + BATCH])
    os._exit(0)  # no teardown in the count


def instructions(mode: str, redis_url: str, bootstrap: str, count: int, made: int) -> tuple[int, Counter[str]]:
    """The main thread's instructions (callgrind) of one :func:`run_only` process, in all and by
    library (:func:`by_library`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
                        sys.executable, "-m", "bench.kafka_cpu", "--run-only", mode, "--messages", str(count),
                        "--made", str(made), "--redis-url", redis_url, "--bootstrap", bootstrap],
                       check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "0"})
        with open(out + "-01") as f:  # thread 1: the main thread
            totals = re.search(r"^(?:totals|summary):\s+(\d+)", f.read(), re.MULTILINE)
        assert totals is not None, "callgrind wrote no totals"
        return int(totals.group(1)), by_library(out + "-01")


#: What each shared object's instructions are, in the consumer's path; the rest is "other": OpenSSL's
#: SHA-256 of each body (about 4,100 instructions a message), libc's memory copies and allocation, and
#: whatever else runs on the main thread (a few thousand instructions a message move between OpenSSL's
#: and libc's rows from one run to the next, so they are counted together).
LIBRARIES = {"libpython": "the interpreter: our Python and redis-py's", "hiredis": "reading replies (hiredis)",
             "_resp": "packing commands (the compiled packer)",
             "cimpl": "confluent-kafka's Message accessors"}
OTHER = "other: SHA-256 of each body (OpenSSL), libc"


def by_library(path: str) -> Counter[str]:
    """Self instructions of a callgrind file by what :data:`LIBRARIES` calls each shared object
    (code inlined into the interpreter, without an object name, counted as the interpreter's);
    empty when ``callgrind_annotate`` is missing."""
    if not shutil.which("callgrind_annotate"):
        return Counter()
    listing = subprocess.run(["callgrind_annotate", "--threshold=100", "--auto=no", path], check=True,
                             capture_output=True, text=True).stdout
    counts: Counter[str] = Counter()
    for line in listing.splitlines():
        found = re.match(r"\s*([\d,]+) \([^)]*\)\s+\S+:\S+(?: \[(\S+)\])?$", line)
        if found:
            library = os.path.basename(found.group(2) or "libpython")
            label = next((v for k, v in LIBRARIES.items() if library.startswith(k)), OTHER)
            counts[label] += int(found.group(1).replace(",", ""))
    return counts


def callgrind(redis_url: str, bootstrap: str, count: int) -> None:
    runs = {(mode, n): instructions(mode, redis_url, bootstrap, n, 2 * count)
            for mode in ("new", "dup") for n in (count, 2 * count)}
    new = (runs["new", 2 * count][0] - runs["new", count][0]) / count
    duplicate = (runs["dup", 2 * count][0] - runs["dup", count][0]) / count - new
    packer = "compiled" if direct_packer_name() == "compiled" else "hiredis"
    print(f"Kafka consumer instructions per message without a broker (valgrind, main thread, gc off, batches of "
          f"{BATCH}, whole batches claimed; runs of {count:,} and {2 * count:,} messages; packer: {packer})")
    print(f"  consumer, new keys         {new:9,.0f} instructions/msg")
    print(f"  consumer, duplicates       {duplicate:9,.0f} instructions/msg")
    libraries = runs["new", count][1]
    if libraries:
        print("  by library, new keys / duplicates (a duplicate: the second pass of the dup runs):")
        for label in [*LIBRARIES.values(), OTHER]:
            first = (runs["new", 2 * count][1][label] - runs["new", count][1][label]) / count
            second = (runs["dup", 2 * count][1][label] - runs["dup", count][1][label]) / count - first
            print(f"    {label:46} {first:7,.0f} / {second:7,.0f}")


def direct_packer_name() -> str:
    """Which packer the script runner uses here: ``compiled`` (``dedupe_worker._resp``) or ``hiredis``.
    The held connection's module is in ``_transport``, and was in ``_protocol`` before (b977d1e)."""
    try:
        from dedupe_worker._transport import held
    except ImportError:  # the module's home before the _transport package
        from dedupe_worker._protocol import held  # type: ignore[no-redef]

    connection = redis.Connection()
    packer = held.direct_packer(connection)
    return "compiled" if packer is not None and packer.__module__ == "dedupe_worker._resp" else "hiredis"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--bootstrap", default="127.0.0.1:1",
                        help="only given to librdkafka's constructor (nothing is consumed)")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gc", choices=("on", "off", "frozen"), default="on")
    parser.add_argument("--callgrind", action="store_true", help="count instructions with valgrind instead")
    parser.add_argument("--run-only", choices=("new", "dup"), help=argparse.SUPPRESS)  # one run under callgrind
    parser.add_argument("--made", type=int, default=0, help=argparse.SUPPRESS)  # records built by that run
    args = parser.parse_args()
    if args.run_only:
        run_only(args.run_only, args.redis_url, args.bootstrap, args.messages, max(args.made, args.messages))
    if args.callgrind:
        if not shutil.which("valgrind"):
            sys.exit("--callgrind needs valgrind")
        callgrind(args.redis_url, args.bootstrap, min(args.messages, 4000))
        return
    client = redis.Redis.from_url(args.redis_url)
    count = args.messages
    collections = Collections()
    samples: dict[str, list[float]] = {}
    config = {"bootstrap.servers": args.bootstrap, "group.id": "bench-kafka-cpu", "log_level": 0}
    if args.gc == "frozen":
        gc.collect()
        gc.freeze()
    for round_ in range(args.rounds):
        namespace = f"bench-{uuid.uuid4().hex[:8]}"
        dedupe = Deduplicator(client, namespace=namespace, result_ttl=300)
        consumer = Offline(config, ["bench"], lambda message: None, dedupe)
        for partition in range(PARTITIONS):
            consumer._partitions[("bench", partition)] = PartitionState()
        batch = records(namespace, count, round_ * count)

        def consume(batch: list[Message] = batch, consumer: Offline = consumer) -> None:
            for start in range(0, count, BATCH):
                consumer.process(batch[start:start + BATCH])

        for case in ("consumer, new keys", "consumer, duplicates"):
            samples.setdefault(case, []).append(timed(consume, count, collections, args.gc))
        assert consumer.stats["applied"] == count and consumer.stats["duplicate"] == count, consumer.stats
        consumer.consumer.close()
        dedupe.close()

        engine = Deduplicator(client, namespace=namespace + "-engine", result_ttl=300)
        pacing = Pacing()
        items = [(f"{namespace}-{i}", None, (lambda: None)) for i in range(count)]

        def decide(items: list[Any] = items, engine: Deduplicator = engine, pacing: Pacing = pacing) -> None:
            for start in range(0, count, BATCH):
                decide_many(engine, items[start:start + BATCH], pacing=pacing)

        for case in ("engine alone, new keys", "engine alone, duplicates"):
            samples.setdefault(case, []).append(timed(decide, count, collections, args.gc))
        engine.close()
    print(f"Kafka consumer client CPU without a broker (pid {os.getpid()}, cpus {sorted(os.sched_getaffinity(0))}, "
          f"gc {args.gc}, {count} messages in batches of {BATCH}, median of {args.rounds})")
    for case, values in samples.items():
        print(f"  {case:26} {statistics.median(values):5.2f} µs/msg  ({' / '.join(f'{v:.2f}' for v in values)})")
    spans = sum(len(values) for values in samples.values()) * count
    print("  garbage collections in the measured spans: "
          + ", ".join(f"gen {g}: {collections.count[g]} ({1e6 * collections.seconds[g] / spans:.2f} µs/msg)"
                      for g in sorted(collections.count)))


if __name__ == "__main__":
    main()
