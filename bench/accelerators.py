"""Each accelerator against the plain path it replaces, in one process, on a figure a user sees.

    python -m bench.accelerators packer [--redis-url URL] [--seconds S]
    python -m bench.accelerators kafka [--redis-url URL] [--messages N] [--rounds R] [--bootstrap HOST:PORT]
    python -m bench.accelerators claims [--redis-url URL] [--seconds S]

``packer``: the held connection's packer, the compiled ``dedupe_worker._resp`` against
``hiredis.pack_command``, on :mod:`bench.held_connection`'s four cases (``run()``, a duplicate,
``begin_many`` + ``complete_many`` of 100, ``decide_many`` of 100): two deduplicators on two
pools, the second's held connection packing with hiredis, taking turns (:func:`bench.core.rates`).

``kafka``: a Kafka consumer's messages per second against a broker (tansu started unless
``--bootstrap``), :mod:`bench.kafka_consumer`'s ``Timed`` consumer, new keys then the same keys
again, against the same consumer with the step under test replaced; the variants alternate
round by round. Nothing is replaced any more (the compiled identification it measured is
retired): it prints the consumer's figure, the baseline of the next candidate.

``claims``: a batch's claim reply read by ``ClaimCodec._claims`` (its common answers built
straight) against ``claim_of`` each (the general decoding), on :mod:`bench.core`'s batch
(``begin_many`` + ``complete_many`` of 100), taking turns (:func:`bench.core.rates`).

The held connection's own A/B is :mod:`bench.held_connection`; the asyncio direct sender's is
:mod:`bench.asyncio_paths` with and without ``DEDUPE_PURE_PYTHON=1``. The verdicts and figures:
docs/performance.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import uuid
from typing import Any

import redis

from bench.core import rates
from bench.held_connection import cases
from dedupe_worker import Deduplicator
from dedupe_worker._transport.held import HeldConnection, hiredis_pack


def packer(url: str, seconds: float) -> None:
    compiled, plain = redis.Redis.from_url(url), redis.Redis.from_url(url)
    both = {**cases(compiled, "compiled"), **cases(plain, "hiredis")}  # each first use chose a packer
    held = HeldConnection.for_client(plain)
    assert held is not None, "the held path is off here (DEDUPE_PURE_PYTHON, a small pool)"
    held._pack = hiredis_pack
    first = HeldConnection.for_client(compiled)
    print(f"packers: {getattr(getattr(first, '_pack', None), '__module__', None)} against hiredis")
    cpu: dict[str, float] = {}
    m = rates(both, seconds, cpu=cpu)
    for case in ("run", "dup", "batch", "decide_many"):
        a, b = m[f"compiled {case}"], m[f"hiredis {case}"]
        print(f"  {case:<12} compiled {a:10,.0f} msg/s ({1e6 * cpu[f'compiled {case}']:5.1f} µs CPU)  "
              f"hiredis {b:10,.0f} msg/s ({1e6 * cpu[f'hiredis {case}']:5.1f} µs CPU)  compiled/hiredis {a / b:.3f}",
              flush=True)


def kafka(url: str, bootstrap: str | None, count: int, rounds: int) -> None:
    from bench.kafka_consumer import Timed, broker, fill, measure

    logging.basicConfig(level=logging.ERROR)
    client = redis.Redis.from_url(url)
    variants: dict[str, type[Any]] = {"consumer": Timed}
    found: dict[tuple[str, str], list[float]] = {}
    with broker(bootstrap) as servers:
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        fill(servers, topic, count)
        for r in range(rounds):
            for label, cls in (list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]):
                d = Deduplicator(client, namespace=f"bench-{uuid.uuid4().hex[:8]}", result_ttl=300)
                for keys in ("new keys", "duplicates"):
                    found.setdefault((label, keys), []).append(measure(cls, servers, topic, count, 500, d).rate)
                d.close()
    for (label, keys), values in found.items():
        print(f"  {label:<10} {keys:<11} {statistics.median(values):10,.0f} msg/s (median of {len(values)}: "
              + ", ".join(f"{v:,.0f}" for v in values) + ")", flush=True)


def claims(url: str, seconds: float) -> None:
    from dedupe_worker._protocol.codec import ClaimCodec

    fast = ClaimCodec._claims

    def general(self: ClaimCodec, requests: Any, flat: Any) -> list[Any]:
        return [self.claim_of(r, *flat[4 * i:4 * i + 4]) for i, r in enumerate(requests)]

    d = Deduplicator(redis.Redis.from_url(url), namespace=f"bench-{uuid.uuid4().hex[:8]}", lease=30, result_ttl=60)

    def batch(variant: Any) -> Any:
        def run(i: int) -> int:
            ClaimCodec._claims = variant  # type: ignore[method-assign]
            try:
                claims = d.begin_many([f"batch-{variant.__name__}-{i}-{j}" for j in range(100)])
                d.complete_many([(c, j) for j, c in enumerate(claims)])
            finally:
                ClaimCodec._claims = fast  # type: ignore[method-assign]
            return 100
        return run

    cpu: dict[str, float] = {}
    m = rates({"fast": batch(fast), "general": batch(general)}, seconds, cpu=cpu)
    print(f"  batch of 100  _claims {m['fast']:10,.0f} msg/s ({1e6 * cpu['fast']:5.2f} µs CPU)  claim_of each "
          f"{m['general']:10,.0f} msg/s ({1e6 * cpu['general']:5.2f} µs CPU)  "
          f"fast/general {m['fast'] / m['general']:.3f}", flush=True)
    d.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=("packer", "kafka", "claims"))
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--seconds", type=float, default=4.0, help="packer: per case, spread over 15 rounds")
    parser.add_argument("--bootstrap", help="kafka: bootstrap servers (default: start tansu)")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if args.which == "packer":
        packer(args.redis_url, args.seconds)
    elif args.which == "claims":
        claims(args.redis_url, args.seconds)
    else:
        kafka(args.redis_url, args.bootstrap, args.messages, args.rounds)


if __name__ == "__main__":
    main()
