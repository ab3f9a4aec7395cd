"""Redis' own time per script call (``INFO commandstats`` ``usec_per_call`` of EVALSHA), one
script at a time, and memory per completed key.

    python -m bench.lua_cost [--redis-url URL] [--calls N]

Each phase resets the server's statistics (``CONFIG RESETSTAT``), makes ``N`` calls of one
script for one key each, and reads EVALSHA's ``usec_per_call``: the server-side cost of a claim
of a new key, a completion, a duplicate claim (an outcome stored), a renewal and a release.
``make bench`` runs it on the private redis-server it starts, never on a shared one (the reset
would clear everyone's statistics).
"""

from __future__ import annotations

import argparse
import os
import uuid

import redis

from dedupe_worker import Deduplicator, Stored


def usec_per_call(client: redis.Redis) -> float:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return float(stats.get("usec_per_call", 0.0))


def measure(url: str, calls: int) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    ns = f"lua-{uuid.uuid4().hex[:8]}"
    d = Deduplicator(client, namespace=ns, lease=30, result_ttl=600)
    store = d.store
    stems = [d.request(f"order-{i}").stem for i in range(calls)]
    out: dict[str, float] = {}

    def phase(name: str, fn: object) -> list[object]:
        client.config_resetstat()
        results = [fn(stem) for stem in stems]  # type: ignore[operator]
        out[name] = usec_per_call(client)
        return results

    tokens = phase("claim (new key)", lambda s: store.claim_one(s, "", "", d._lease_ms, d._retention_ms).token)
    token_of = dict(zip(stems, tokens, strict=True))
    phase("renew", lambda s: store.renew([(s, token_of[s])], d._lease_ms, d._retention_ms))
    phase("complete", lambda s: store.complete_one(s, token_of[s], Stored.COMPLETED, b'{"status":"charged"}',
                                                   d._result_ttl_ms))
    phase("claim (duplicate)", lambda s: store.claim_one(s, "", "", d._lease_ms, d._retention_ms))
    released = [d.request(f"released-{i}").stem for i in range(calls)]
    held = {s: store.claim_one(s, "", "", d._lease_ms, d._retention_ms).token for s in released}
    stems[:] = released
    phase("release", lambda s: store.release([(s, held[s])], d._retention_ms))

    d.run("memory-probe-order-00012345", lambda: {"status": "charged", "amount": 1250})
    stem = d.layout.stem("memory-probe-order-00012345")
    out["memory"] = float(sum(client.memory_usage(k) or 0 for k in (stem + ":started", stem + ":result")))
    for key in client.scan_iter(f"{ns}:*", count=5000):
        client.unlink(key)
    d.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    m = measure(args.redis_url, args.calls)
    print(f"Redis time per script call (INFO commandstats usec_per_call, {args.calls} calls each)")
    for name, value in m.items():
        if name != "memory":
            print(f"  {name:<20} {value:6.2f} µs")
    print(f"  memory per completed key {m['memory']:.0f} bytes (both records)")


if __name__ == "__main__":
    main()
