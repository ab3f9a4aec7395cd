"""FastStream and Dramatiq on RabbitMQ, each with and without deduplication, in one run.

    python -m bench.frameworks [--rabbitmq-url URL] [--redis-url URL] [--messages N] [--rounds R]

Cases, each in messages/s from the first publish to the last message handled (publishing
included, the same for both sides of a pair), on a queue of its own, every message a new key
(claim + handler + complete: two Lua scripts), the cases taking turns in rounds, each the median
of its rounds:

- ``faststream``: a ``RabbitBroker`` subscriber that returns at once;
- ``faststream + dedupe``: the same with ``dedupe_middleware`` (key: the body's ``id``);
- ``dramatiq``: a ``dramatiq.Worker`` (1 thread) running an actor that returns at once;
- ``dramatiq + dedupe``: the same with ``DedupeMiddleware`` (key from the actor's argument);
- ``faststream + round trips``, ``dramatiq + round trips``: the app without dedupe whose handler
  makes two trivial round trips per message (``EVALSHA`` of ``return 1``, twice) on a client of
  the type the middleware uses (``redis.asyncio.Redis``; ``redis.Redis``), same Redis URL: the
  best ratio any dedupe that makes two round trips a message (claim, complete) can reach.

Printed with the per-message overhead of deduplication in µs, the ratio of each dedupe case to
the plain app and to the app with round trips (all cases measured in the same rounds), and the
process' CPU per message (all its threads: ``time.process_time``) in each case.

**Where a dedupe-message's extra µs go.** The publisher, the consumer and (Dramatiq) the worker
share the client's vCPU, and FastStream handles several messages at once: a message's round trip
overlaps other work, so its wall time cannot be subtracted from the overhead. The overhead is
split instead into the client CPU the dedupe case adds and the wait it adds (overhead minus that
CPU: the vCPU idle, or running another process), and that CPU into:

- ``round trips``: the client's CPU inside the claim's and the completion's round trips (redis-py
  sending and reading, syscalls included), timed by a wrapper the bench installs on every
  connection of the client's pool (``send_packed_command``/``read_response``; the script is told
  by its function name in the packed command). Their wall time, from the first byte sent to the
  reply read, is printed beside it (medians), with the floor;
- ``our code``: the rest of our middleware, entry to exit (FastStream: ``DedupeMiddleware.handle``;
  Dramatiq: ``DedupeMiddleware.process`` and its two per-message hooks), minus the handler (the
  rest of FastStream's chain; the actor's function) and minus the round trips' CPU;
- ``left``: the rest of the added CPU: FastStream's or Dramatiq's code for one more middleware,
  pika/aio-pika, garbage collection.

The round-trip apps are timed the same way in timed rounds of their own: the CPU of the handler's
two calls, and in it their round trips' (the same wrapper). What the two calls spend outside
their round trips is redis-py's command layers (``execute_command``, the pool, the reply's
parsing): what a dedupe built on redis-py's commands would spend beside its round trips. ``our
code`` is printed beside it (``our code beyond those layers``): our middleware, engine and
protocol (key, fingerprint, claim, completion, verdict) less what a user's own two calls cost.

CPU is ``time.thread_time`` on Dramatiq's worker thread; on asyncio, the wall time of each step
our coroutine (or the connection's) runs between two suspensions, which is CPU: nothing blocks
inside a step. The event loop's own work for the Redis socket (``epoll``, the transport's read
callback, waking the coroutine) runs outside those steps: on FastStream it is in ``left``. The
timers run only in ``--timed-rounds`` extra rounds of each dedupe and round-trip case after the
others (their rate is printed: the timers' own cost), never in the rounds of the ratios. The
floor, measured in the same run with the same wrapper on a client of the same type
(``redis.asyncio.Redis``; ``redis.Redis`` on the held connection, Dramatiq's path), nothing else
running: one ``PING`` and one ``EVALSHA`` of ``return 1``, medians of :data:`FLOOR_CALLS`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Generator
from typing import Any

import dramatiq
import pika
import redis
import redis.asyncio
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from faststream.rabbit import RabbitBroker, RabbitQueue

from dedupe_worker import Deduplicator
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.dramatiq import DedupeMiddleware
from dedupe_worker.faststream import dedupe_middleware
from dedupe_worker.keys import field_key

#: A case: handle ``n`` messages, return the seconds it took and the process' CPU seconds.
Case = Callable[[int], tuple[float, float]]

#: Round trips of each kind the floor is the median of.
FLOOR_CALLS = 400


class Timings:
    """What the timed dedupe cases spent (see the module doc): each round trip's wall time and
    client CPU by kind, and per message the CPU inside our middleware with the handler taken out
    (round trips included)."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self.inside: list[float] = []
        self.rates: list[float] = []

    def round_trip(self, kind: str, wall: float, cpu: float) -> None:
        self.wall.setdefault(kind, []).append(wall)
        self.cpu.setdefault(kind, []).append(cpu)

    def per_message_us(self, values: list[float]) -> float:
        return sum(values) / len(self.inside) * 1e6 if self.inside else 0.0

    def median_us(self, kind: str) -> float:
        return statistics.median(self.wall[kind]) * 1e6 if self.wall.get(kind) else 0.0


def _kind(packed: Any) -> str:
    """Which call a packed command is: ``claim``, ``complete``, another script, or ``other``."""
    data = b"".join(packed) if isinstance(packed, list) else packed if isinstance(packed, bytes) else b""
    for name in ("claim", "complete", "release", "renew"):
        if f"_{name}\r\n".encode() in data:
            return name
    return "EVALSHA" if b"EVALSHA" in data else "PING" if b"PING" in data else "other"


def time_sync_pool(pool: Any, timings: Timings) -> None:
    """Time every round trip on the connections ``pool`` makes from now on: wall time and the
    calling thread's CPU from ``send_packed_command`` to the end of the next ``read_response``."""
    make = pool.make_connection

    def make_connection() -> Any:
        connection = make()
        send, read = connection.send_packed_command, connection.read_response
        sent: list[Any] = []

        def send_packed_command(command: Any, check_health: bool = True) -> None:
            sent[:] = [_kind(command), time.perf_counter(), time.thread_time()]
            send(command, check_health)

        def read_response(*args: Any, **kwargs: Any) -> Any:
            try:
                return read(*args, **kwargs)
            finally:
                if sent:
                    timings.round_trip(sent[0], time.perf_counter() - sent[1], time.thread_time() - sent[2])
                    sent.clear()

        connection.send_packed_command = send_packed_command
        connection.read_response = read_response
        return connection

    pool.make_connection = make_connection


class Stepped:
    """Awaits a coroutine and adds the wall time of each of its steps (from a resumption to the
    next suspension: CPU, nothing blocks inside a step) to ``spent[0]``."""

    def __init__(self, coroutine: Any, spent: list[float]) -> None:
        self.coroutine, self.spent = coroutine, spent

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, spent = self.coroutine, self.spent
        value: Any = None
        error: BaseException | None = None
        while True:
            began = time.perf_counter()
            try:
                yielded = coroutine.throw(error) if error is not None else coroutine.send(value)
            except StopIteration as stop:
                spent[0] += time.perf_counter() - began
                return stop.value
            except BaseException:
                spent[0] += time.perf_counter() - began
                raise
            spent[0] += time.perf_counter() - began
            try:
                value, error = (yield yielded), None
            except BaseException as exc:
                value, error = None, exc


def time_async_pool(pool: Any, timings: Timings) -> None:
    """:func:`time_sync_pool` for a ``redis.asyncio`` pool, the CPU of the round trip being the
    steps of ``send_packed_command`` and ``read_response`` (:class:`Stepped`)."""
    make = pool.make_connection

    def make_connection() -> Any:
        connection = make()
        send, read = connection.send_packed_command, connection.read_response
        sent: list[Any] = []

        async def send_packed_command(command: Any, check_health: bool = True) -> None:
            spent = [0.0]
            sent[:] = [_kind(command), time.perf_counter(), spent]
            await Stepped(send(command, check_health), spent)

        async def read_response(*args: Any, **kwargs: Any) -> Any:
            spent = sent[2] if sent else [0.0]
            try:
                return await Stepped(read(*args, **kwargs), spent)
            finally:
                if sent:
                    timings.round_trip(sent[0], time.perf_counter() - sent[1], spent[0])
                    sent.clear()

        connection.send_packed_command = send_packed_command
        connection.read_response = read_response
        return connection

    pool.make_connection = make_connection


def time_faststream_middleware(middleware: Any, timings: Timings) -> None:
    """Time ``middleware.handle``'s steps per message, those of the rest of FastStream's chain
    (``call_next``: the handler) taken out."""
    handle = middleware.handle

    async def timed(call_next: Any, msg: Any, subscriber: Any, broker: Any = None) -> Any:
        inside, handler = [0.0], [0.0]

        async def next_(message: Any) -> Any:
            return await Stepped(call_next(message), handler)

        try:
            return await Stepped(handle(next_, msg, subscriber, broker), inside)
        finally:
            timings.inside.append(inside[0] - handler[0])

    middleware.handle = timed


def time_dramatiq_middleware(middleware: Any, timings: Timings) -> None:
    """Time ``middleware.process``'s CPU per message, the actor's function taken out, and add our
    two per-message hooks (``before_process_message``, ``after_process_message``)."""
    process, before, after = middleware.process, middleware.before_process_message, middleware.after_process_message
    hooks = [0.0]

    def timed(actor: Any, message: Any, fn: Any, args: Any, kwargs: Any) -> Any:
        handler = 0.0

        def fn_(*a: Any, **k: Any) -> Any:
            nonlocal handler
            began = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                handler += time.thread_time() - began

        began = time.thread_time()
        try:
            return process(actor, message, fn_, args, kwargs)
        finally:
            timings.inside.append(time.thread_time() - began - handler + hooks[0])
            hooks[0] = 0.0

    def timed_hook(hook: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            began = time.thread_time()
            try:
                return hook(*args, **kwargs)
            finally:
                hooks[0] += time.thread_time() - began
        return call

    middleware.process = timed
    middleware.before_process_message = timed_hook(before)
    middleware.after_process_message = timed_hook(after)  # counted with the next message


#: A trivial script: what the ``+ round trips`` cases' handlers send twice a message.
TRIVIAL_SCRIPT = "return 1"


def faststream_case(amqp_url: str, redis_url: str, dedupe: bool, timings: Timings | None = None,
                    round_trips: bool = False) -> Case:
    """The FastStream app; ``dedupe``: with the middleware; ``round_trips``: without it, the
    handler making two trivial round trips on the ``redis.asyncio.Redis`` client. ``timings``: time
    the middleware (:func:`time_faststream_middleware`), or the handler's two calls, and their
    round trips."""
    def case(n: int) -> tuple[float, float]:
        async def main() -> tuple[float, float]:
            queue = f"bench-fs-{uuid.uuid4().hex[:8]}"
            redis_client = redis.asyncio.Redis.from_url(redis_url)
            if timings is not None:
                time_async_pool(redis_client.connection_pool, timings)
            client = AsyncDeduplicator(redis_client, namespace=f"bench-{queue}", result_ttl=60.0)
            middlewares = [dedupe_middleware(client, key_strategy=field_key("id"))] if dedupe else []
            if timings is not None and dedupe:
                time_faststream_middleware(middlewares[0], timings)
            broker = RabbitBroker(amqp_url, middlewares=middlewares, logger=None)
            done = asyncio.Event()
            handled = 0
            sha = await redis_client.script_load(TRIVIAL_SCRIPT) if round_trips else ""

            async def two_calls() -> None:
                await redis_client.evalsha(sha, 0)
                await redis_client.evalsha(sha, 0)

            @broker.subscriber(RabbitQueue(queue, auto_delete=True))
            async def handle(body: dict[str, int]) -> int:
                nonlocal handled
                if round_trips and timings is not None:  # timed rounds only: their CPU, steps summed
                    spent = [0.0]
                    await Stepped(two_calls(), spent)
                    timings.inside.append(spent[0])
                elif round_trips:
                    await two_calls()
                handled += 1
                if handled == n:
                    done.set()
                return body["id"]

            await broker.start()
            began, cpu = time.perf_counter(), time.process_time()
            for i in range(n):
                await broker.publish({"id": i}, queue=queue)
            await asyncio.wait_for(done.wait(), 300)
            elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
            await broker.stop()
            await client.aclose()
            await client.store.client.aclose()
            return elapsed, cpu

        return asyncio.run(main())

    return case


def dramatiq_case(amqp_url: str, redis_url: str, dedupe: bool, timings: Timings | None = None,
                  round_trips: bool = False) -> Case:
    """The Dramatiq app; ``dedupe``: with the middleware; ``round_trips``: without it, the actor
    making two trivial round trips on the ``redis.Redis`` client. ``timings``: time the
    middleware (:func:`time_dramatiq_middleware`), or the actor's two calls, and their round trips."""
    def case(n: int) -> tuple[float, float]:
        queue = f"bench-dq-{uuid.uuid4().hex[:8]}"
        broker = RabbitmqBroker(url=amqp_url.rstrip("/") + "/%2F")
        redis_client = redis.Redis.from_url(redis_url)
        if timings is not None:
            time_sync_pool(redis_client.connection_pool, timings)
        client = Deduplicator(redis_client, namespace=f"bench-{queue}", result_ttl=60.0)
        if dedupe:
            middleware = DedupeMiddleware(client)
            if timings is not None:
                time_dramatiq_middleware(middleware, timings)
            broker.add_middleware(middleware)
        done = threading.Event()
        handled = [0]
        lock = threading.Lock()
        sha = redis_client.script_load(TRIVIAL_SCRIPT) if round_trips else ""

        def two_calls() -> None:
            redis_client.evalsha(sha, 0)
            redis_client.evalsha(sha, 0)

        def work(i: int) -> None:
            if round_trips and timings is not None:  # timed rounds only: their CPU
                began = time.thread_time()
                two_calls()
                timings.inside.append(time.thread_time() - began)
            elif round_trips:
                two_calls()
            with lock:
                handled[0] += 1
                if handled[0] == n:
                    done.set()

        options = {"idempotency_key": lambda i: f"bench:{i}"} if dedupe else {}
        actor = dramatiq.actor(work, broker=broker, queue_name=queue, **options)
        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
        worker.start()
        try:
            began, cpu = time.perf_counter(), time.process_time()
            for i in range(n):
                actor.send(i)
            assert done.wait(300), "dramatiq bench did not finish"
            return time.perf_counter() - began, time.process_time() - cpu
        finally:
            worker.stop()
            with pika.BlockingConnection(pika.URLParameters(amqp_url.rstrip("/") + "/%2F")) as conn:
                channel = conn.channel()
                for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
                    channel.queue_delete(queue=name)
            broker.close()
            client.close()

    return case


def sync_floor(redis_url: str) -> dict[str, float]:
    """Median µs of a ``PING`` and of an ``EVALSHA`` of ``return 1`` on a ``redis.Redis``'s held
    connection (the path the Dramatiq worker's claims take), timed as the cases' round trips."""
    from dedupe_worker._transport.held import HeldConnection

    timings = Timings()
    client = redis.Redis.from_url(redis_url)
    time_sync_pool(client.connection_pool, timings)
    sha = client.script_load("return 1")
    held = HeldConnection.for_client(client)
    assert held is not None
    for _ in range(FLOOR_CALLS // 10):  # warm up, then count afresh
        held.execute("PING")
    timings.wall.clear()
    for _ in range(FLOOR_CALLS):
        held.execute("PING")
        held.execute("EVALSHA", sha, 0)
    held.close()
    client.close()
    return {kind: timings.median_us(kind) for kind in ("PING", "EVALSHA")}


def async_floor(redis_url: str) -> dict[str, float]:
    """:func:`sync_floor` on a ``redis.asyncio.Redis``."""
    async def main() -> dict[str, float]:
        timings = Timings()
        client = redis.asyncio.Redis.from_url(redis_url)
        time_async_pool(client.connection_pool, timings)
        sha = await client.script_load("return 1")
        for _ in range(FLOOR_CALLS // 10):
            await client.execute_command("PING")
        timings.wall.clear()
        for _ in range(FLOOR_CALLS):
            await client.execute_command("PING")
            await client.execute_command("EVALSHA", sha, 0)
        await client.aclose()
        return {kind: timings.median_us(kind) for kind in ("PING", "EVALSHA")}

    return asyncio.run(main())


def breakdown(overhead: float, added_cpu: float, timings: Timings, floor: dict[str, float],
              trips: Timings) -> list[str]:
    """The lines that split ``overhead`` (µs a message, ``added_cpu`` of it the process' CPU) as
    the module doc says, and set ``our code`` beside what the round-trip app's two calls spend
    outside their round trips (``trips``)."""
    claim, complete = (timings.per_message_us(timings.cpu.get(kind, [])) for kind in ("claim", "complete"))
    ours = timings.per_message_us(timings.inside) - claim - complete
    calls = trips.per_message_us(trips.inside)
    sent = trips.per_message_us(trips.cpu.get("EVALSHA", []))
    others = sorted(set(timings.wall) - {"claim", "complete"})
    extra = f" (other round trips seen: {', '.join(others)})" if others else ""
    return [f"      {overhead:+.0f} µs = CPU {added_cpu:+.0f} [round trips' client CPU: claim {claim:.0f} + complete "
            f"{complete:.0f}; our code {ours:.0f}; left {added_cpu - claim - complete - ours:.0f}] "
            f"+ wait {overhead - added_cpu:+.0f}",
            f"      round trips' wall time, medians: claim {timings.median_us('claim'):.0f} µs, complete "
            f"{timings.median_us('complete'):.0f} µs; floor PING {floor['PING']:.0f} µs, EVALSHA 'return 1' "
            f"{floor['EVALSHA']:.0f} µs{extra}; {len(timings.inside)} timed messages at "
            f"{statistics.median(timings.rates):.0f} msg/s",
            f"      the round-trip app's two calls: client CPU {calls:.0f} µs = round trips {sent:.0f} + redis-py's "
            f"command layers {calls - sent:.0f}; our code beyond those layers {ours - (calls - sent):+.0f} µs "
            f"({len(trips.inside)} timed messages at {statistics.median(trips.rates):.0f} msg/s)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rabbitmq-url",
                        default=os.environ.get("DEDUPE_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"))
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timed-rounds", type=int, default=1,
                        help="rounds of each dedupe and round-trip case with the breakdown's timers, after the others")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    amqp = args.rabbitmq_url.rstrip("/") + "/"
    cases = {
        "faststream": faststream_case(amqp, args.redis_url, False),
        "faststream + dedupe": faststream_case(amqp, args.redis_url, True),
        "dramatiq": dramatiq_case(amqp, args.redis_url, False),
        "dramatiq + dedupe": dramatiq_case(amqp, args.redis_url, True),
        "faststream + round trips": faststream_case(amqp, args.redis_url, False, round_trips=True),
        "dramatiq + round trips": dramatiq_case(amqp, args.redis_url, False, round_trips=True),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    cpu_samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            elapsed, cpu = case(args.messages)
            samples[name].append(args.messages / elapsed)
            cpu_samples[name].append(cpu / args.messages * 1e6)
    rates = {name: statistics.median(values) for name, values in samples.items()}
    cpus = {name: statistics.median(values) for name, values in cpu_samples.items()}
    timings = {"faststream": Timings(), "dramatiq": Timings()}
    trip_timings = {"faststream": Timings(), "dramatiq": Timings()}  # the round-trip apps, timed alike
    timed = [(timings["faststream"], faststream_case(amqp, args.redis_url, True, timings["faststream"])),
             (timings["dramatiq"], dramatiq_case(amqp, args.redis_url, True, timings["dramatiq"])),
             (trip_timings["faststream"],
              faststream_case(amqp, args.redis_url, False, trip_timings["faststream"], round_trips=True)),
             (trip_timings["dramatiq"],
              dramatiq_case(amqp, args.redis_url, False, trip_timings["dramatiq"], round_trips=True))]
    for _ in range(args.timed_rounds):
        for timing, case in timed:
            timing.rates.append(args.messages / case(args.messages)[0])
    floors = {"faststream": async_floor(args.redis_url), "dramatiq": sync_floor(args.redis_url)}
    print(f"FastStream and Dramatiq on RabbitMQ, {args.messages} messages x {args.rounds} rounds"
          f"{' (' + args.label + ')' if args.label else ''}")
    for plain in ("faststream", "dramatiq"):
        ours = plain + " + dedupe"
        overhead = (1 / rates[ours] - 1 / rates[plain]) * 1e6
        print(f"  {plain:<11} {rates[plain]:8.0f} msg/s   + dedupe {rates[ours]:8.0f} msg/s   "
              f"{overhead:+7.0f} µs/msg   ratio {rates[ours] / rates[plain]:.2f}   "
              f"process CPU {cpus[plain]:.0f} / {cpus[ours]:.0f} µs/msg")
        trips = plain + " + round trips"
        print(f"  {'':<11} + round trips {rates[trips]:8.0f} msg/s (ratio {rates[trips] / rates[plain]:.2f}: the "
              f"best two round trips allow)   dedupe / round trips {rates[ours] / rates[trips]:.2f}   "
              f"process CPU {cpus[trips]:.0f} µs/msg")
        if timings[plain].inside:
            for line in breakdown(overhead, cpus[ours] - cpus[plain], timings[plain], floors[plain],
                                  trip_timings[plain]):
                print(line)


if __name__ == "__main__":
    main()
