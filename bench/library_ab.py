"""Redis' own time per call of the function library: this tree's ``lua/`` against another's.

    python -m bench.library_ab --baseline DIR [--redis-url URL] [--keys N] [--rounds R]

Both sets of scripts are loaded as the function library the runner loads on Redis 7+
(:class:`bench.lua_cost.Version` with ``functions``; the two names differ by their texts' hash)
and sent the store's own calls with ``FCALL``, writing record format 2. Each round runs, for ``N``
new keys, one key a call: their claims (a new key), the same claims again (in progress), the
completions, and the claims once more (duplicates), each priced by ``INFO commandstats``
(:func:`bench.lua_cost.priced`). The two sides take turns round by round on the same server;
the medians are printed with their ratio. It is :mod:`bench.lua_cost`'s measure cut to the four
calls a message makes, on keys set up by the cases before them, so a run takes seconds.
``DIR`` is another commit's ``lua/`` (``git archive REF lua | tar -x -C /tmp/ref``: ``/tmp/ref/lua``),
whose scripts take this release's calls. It resets the server's statistics: run it on a private
server (``make bench``'s or one of your own), never a shared one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import uuid
from pathlib import Path

import redis

from bench.lua_cost import LEASE_MS, RESULT_TTL_MS, RETENTION_MS, VALUE, Version, _tokens, priced, server_usec
from dedupe_worker._protocol import Stored

CASES = ("claim new", "claim in progress", "complete", "claim duplicate")


def one_round(v: Version, keys: int) -> dict[str, float]:
    """Redis' µs per call of each of :data:`CASES`, on ``keys`` new keys."""
    c = v.calls
    stems = [f"ab-{uuid.uuid4().hex[:8]}:{{order-{i}}}" for i in range(keys)]
    claims = [call for stem in stems for call in c.claim_calls([(stem, "", "")], LEASE_MS, RETENTION_MS)]
    usec, replies = priced(v, claims)
    spent = {"claim new": usec / keys, "claim in progress": server_usec(v, claims) / keys}
    tokens = _tokens(replies)
    completions = [call for stem, token in zip(stems, tokens, strict=True)
                   for call in c.complete_calls([(stem, token, Stored.COMPLETED, VALUE)], RESULT_TTL_MS)]
    spent["complete"] = server_usec(v, completions) / keys
    spent["claim duplicate"] = server_usec(v, claims) / keys
    for start in range(0, keys, 1000):
        v.client.unlink(*[name for stem in stems[start:start + 1000] for name in (stem, f"{stem}:started")])
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--baseline", type=Path, required=True, help="another commit's lua/ folder")
    parser.add_argument("--keys", type=int, default=10_000, help="keys per case and round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    client = redis.Redis.from_url(args.redis_url)
    sides = {label: Version.from_dir(client, label, folder, 2, functions=True, earlier=False)
             for label, folder in (("baseline", args.baseline), ("this", None))}
    runs: dict[tuple[str, str], list[float]] = {}
    for n in range(args.rounds):
        for side in (("baseline", "this") if n % 2 else ("this", "baseline")):
            for case, usec in one_round(sides[side], args.keys).items():
                runs.setdefault((side, case), []).append(usec)
    print(f"Redis time per FCALL (INFO commandstats, median of {args.rounds} rounds of {args.keys} keys, one key a "
          f"call, taking turns; record format 2)")
    for case in CASES:
        base, this = statistics.median(runs["baseline", case]), statistics.median(runs["this", case])
        print(f"  {case:18} baseline {base:6.2f} µs   this tree {this:6.2f} µs   ratio {this / base:.2f}")


if __name__ == "__main__":
    main()
