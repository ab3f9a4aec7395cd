"""The client's instructions per message on the single-message paths, counted by callgrind.

    python -m bench.single_cpu [--redis-url URL] [--messages N] [--cases NAME ...]

Where :mod:`bench.frameworks` times whole apps on a broker (and a noisy machine moves its figures
by tens of per cent), this counts the instructions our code adds to one message, which the machine
does not disturb. Each case runs under ``valgrind --tool=callgrind`` on N and 2N new keys (and, in
two more runs, the same keys twice: the second pass all duplicates); the difference of the totals
over N is one message's cost (start-up, imports, the first script loads and the messages' own
construction cancel: every run builds 2N of them). Counted: the main thread only (the sync
renewer's thread runs by the clock, which valgrind slows), with the collector off. A real Redis
(``--redis-url``, default the private bench server on vCPU 0) answers every round trip.

Cases, each with a handler that returns at once:

- ``dramatiq``: :class:`~dedupe_worker.dramatiq.DedupeMiddleware`'s per-message path as a worker
  thread runs it: ``before_process_message``, the wrapped actor function (key from the argument,
  default fingerprint), ``after_process_message``; on a ``StubBroker`` (nothing is sent);
- ``faststream``: :func:`~dedupe_worker.faststream.dedupe_middleware`'s ``handle`` awaited on a
  RabbitMQ message built in memory (``field_key("id")``, default fingerprint; acks are no-ops),
  the rest of the chain a coroutine that returns;
- ``run``: :meth:`Deduplicator.run() <dedupe_worker.Deduplicator.run>`, for reference;
- ``async run``: :meth:`AsyncDeduplicator.run() <dedupe_worker.asyncio.AsyncDeduplicator.run>`;
- ``round trips``, ``async round trips``: no dedupe, two ``EVALSHA`` of ``return 1`` a message on
  a ``redis.Redis`` / ``redis.asyncio.Redis`` (what :mod:`bench.frameworks`' round-trip apps send):
  the instructions any dedupe that claims and completes through redis-py spends on its two round
  trips alone. Each dedupe path is printed beside the one on its client type (:data:`BESIDE`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio

#: What ``bench.frameworks``' round-trip apps send per message, twice.
TRIVIAL_SCRIPT = "return 1"

CASES = ("dramatiq", "faststream", "run", "async run", "round trips", "async round trips")


def run_dramatiq(redis_url: str, namespace: str, passes: int, count: int, made: int) -> None:
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from dedupe_worker import Deduplicator
    from dedupe_worker.dramatiq import DedupeMiddleware

    broker = StubBroker()
    middleware = DedupeMiddleware(Deduplicator(redis.Redis.from_url(redis_url), namespace=namespace,
                                               result_ttl=300))
    broker.add_middleware(middleware)

    def work(i: int) -> int:
        return i

    actor = dramatiq.actor(work, broker=broker, queue_name="bench", idempotency_key=lambda i: f"bench:{i}")
    messages = [actor.message(i) for i in range(made)]
    for _ in range(passes):
        for message in messages[:count]:
            middleware.before_process_message(broker, message)
            result = actor.fn(*message.args, **message.kwargs)
            middleware.after_process_message(broker, message, result=result)


def run_faststream(redis_url: str, namespace: str, passes: int, count: int, made: int) -> None:
    import aio_pika
    from aiormq.abc import DeliveredMessage
    from faststream.rabbit.message import RabbitMessage
    from pamqp.commands import Basic
    from pamqp.header import ContentHeader

    from dedupe_worker.asyncio import AsyncDeduplicator
    from dedupe_worker.faststream import dedupe_middleware
    from dedupe_worker.keys import field_key

    class Offline(RabbitMessage):
        """A message whose acknowledgements go nowhere (there is no channel)."""

        async def ack(self, **kwargs: Any) -> None:
            self.committed = "ack"

        async def nack(self, **kwargs: Any) -> None:
            self.committed = "nack"

        async def reject(self, **kwargs: Any) -> None:
            self.committed = "reject"

    def message(i: int) -> Offline:
        body = json.dumps({"id": i}).encode()
        delivered = DeliveredMessage(
            delivery=Basic.Deliver(consumer_tag="bench", delivery_tag=i + 1, exchange="", routing_key="bench"),
            header=ContentHeader(body_size=len(body), properties=Basic.Properties(message_id=f"m{i}")),
            body=body, channel=None)  # type: ignore[arg-type]
        return Offline(aio_pika.IncomingMessage(delivered, no_ack=False), body=body, message_id=f"m{i}")

    class Subscriber:
        class queue:  # the attribute FastStream's subscribers have
            name = "bench"

    async def call_next(msg: Any) -> Any:
        return None

    async def main() -> None:
        client = AsyncDeduplicator(redis.asyncio.Redis.from_url(redis_url), namespace=namespace, result_ttl=300)
        middleware = dedupe_middleware(client, key_strategy=field_key("id"))
        messages = [message(i) for i in range(made)]
        subscriber = Subscriber()
        for _ in range(passes):
            for msg in messages[:count]:
                try:
                    await middleware.handle(call_next, msg, subscriber)
                except Exception as exc:  # a duplicate acks and raises AckMessage: FastStream's no-op
                    if type(exc).__name__ != "AckMessage":
                        raise

    asyncio.run(main())


def run_sync(redis_url: str, namespace: str, passes: int, count: int, made: int) -> None:
    from dedupe_worker import Deduplicator

    client = Deduplicator(redis.Redis.from_url(redis_url), namespace=namespace, result_ttl=300)
    keys = [f"bench:{i}" for i in range(made)]

    def handler() -> None:
        return None

    for _ in range(passes):
        for key in keys[:count]:
            client.run(key, handler)


def run_async(redis_url: str, namespace: str, passes: int, count: int, made: int) -> None:
    from dedupe_worker.asyncio import AsyncDeduplicator

    async def handler() -> None:
        return None

    async def main() -> None:
        client = AsyncDeduplicator(redis.asyncio.Redis.from_url(redis_url), namespace=namespace, result_ttl=300)
        keys = [f"bench:{i}" for i in range(made)]
        for _ in range(passes):
            for key in keys[:count]:
                await client.run(key, handler)

    asyncio.run(main())


def run_round_trips(redis_url: str, namespace: str, passes: int, count: int, made: int) -> None:
    client = redis.Redis.from_url(redis_url)
    sha = client.script_load(TRIVIAL_SCRIPT)
    keys = [f"bench:{i}" for i in range(made)]
    for _ in range(passes):
        for _key in keys[:count]:
            client.evalsha(sha, 0)
            client.evalsha(sha, 0)


def run_async_round_trips(redis_url: str, namespace: str, passes: int, count: int, made: int) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        sha = await client.script_load(TRIVIAL_SCRIPT)
        keys = [f"bench:{i}" for i in range(made)]
        for _ in range(passes):
            for _key in keys[:count]:
                await client.evalsha(sha, 0)
                await client.evalsha(sha, 0)

    asyncio.run(main())


RUNS: dict[str, Callable[[str, str, int, int, int], None]] = {
    "dramatiq": run_dramatiq, "faststream": run_faststream, "run": run_sync, "async run": run_async,
    "round trips": run_round_trips, "async round trips": run_async_round_trips}


#: Each dedupe path and the two plain round trips on the same client type it is set beside.
BESIDE = {"dramatiq": "round trips", "run": "round trips", "faststream": "async round trips",
          "async run": "async round trips"}


def run_only(case: str, mode: str, redis_url: str, count: int, made: int) -> None:
    """One counted process: ``count`` new keys (``dup``: then the same keys again) through ``case``,
    ``made`` messages built whatever ``count``; the collector off, no teardown."""
    gc.disable()
    RUNS[case](redis_url, f"bench-single-{uuid.uuid4().hex[:8]}", 2 if mode == "dup" else 1, count, made)
    os._exit(0)


def instructions(case: str, mode: str, redis_url: str, count: int, made: int) -> int:
    """The main thread's instructions (callgrind) of one :func:`run_only` process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
                        sys.executable, "-m", "bench.single_cpu", "--run-only", case, mode, "--messages", str(count),
                        "--made", str(made), "--redis-url", redis_url],
                       check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "0"})
        with open(out + "-01") as f:  # thread 1: the main thread
            totals = re.search(r"^(?:totals|summary):\s+(\d+)", f.read(), re.MULTILINE)
        assert totals is not None, "callgrind wrote no totals"
        return int(totals.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_BENCH_REDIS_URL", "redis://127.0.0.1:6390/0"))
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--run-only", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--made", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_only:
        case, mode = args.run_only
        run_only(case, mode, args.redis_url, args.messages, max(args.made, args.messages))
    if not shutil.which("valgrind"):
        sys.exit("bench.single_cpu needs valgrind")
    count = args.messages
    print(f"Instructions per message on the single-message paths (valgrind, main thread, gc off; runs of "
          f"{count:,} and {2 * count:,} messages; Redis {args.redis_url})")
    print(f"  {'case':<17} {'new key':>10} {'duplicate':>10}")
    counted: dict[str, tuple[float, float]] = {}
    for case in args.cases:
        modes = ("new",) if case in BESIDE.values() else ("new", "dup")  # no dedupe: no duplicates
        runs = {(mode, n): instructions(case, mode, args.redis_url, n, 2 * count)
                for mode in modes for n in (count, 2 * count)}
        new = (runs["new", 2 * count] - runs["new", count]) / count
        if "dup" not in modes:
            counted[case] = new, new
            print(f"  {case:<17} {new:10,.0f} {'-':>10}", flush=True)
            continue
        duplicate = (runs["dup", 2 * count] - runs["dup", count]) / count - new
        counted[case] = new, duplicate
        print(f"  {case:<17} {new:10,.0f} {duplicate:10,.0f}", flush=True)
    for case, baseline in BESIDE.items():
        if case in counted and baseline in counted:
            (new, duplicate), (trips, _) = counted[case], counted[baseline]
            print(f"  {case} against {baseline}: {new / trips:.2f}x per new key ({new - trips:+,.0f}), "
                  f"{duplicate / trips:.2f}x per duplicate ({duplicate - trips:+,.0f})")


if __name__ == "__main__":
    main()
