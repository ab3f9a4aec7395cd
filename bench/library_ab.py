"""Redis' own time per call of the function library: this tree's ``lua/`` against another's.

    python -m bench.library_ab --baseline DIR [--redis-url URL] [--keys N] [--rounds R]

Both sets of scripts are loaded as the function library the runner loads on Redis 7+ (one
``FUNCTION LOAD`` each; their names differ by their texts' hash) and called with ``FCALL`` as the
runner calls them, writing record format 2. Each round runs, for ``N`` new keys: a claim (a new
key), the same claims again (in progress), the completions, and the claims once more
(duplicates), and reads ``INFO commandstats``' ``usec_per_call`` of ``FCALL`` after each. The two
sides take turns round by round on the same server; the medians are printed with their ratio.
``DIR`` is another commit's ``lua/`` (``git archive REF lua | tar -x -C /tmp/ref``: ``/tmp/ref/lua``),
whose scripts take this release's calls. It resets the server's statistics: run it on a private
server (``make bench``'s or one of your own), never a shared one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from dedupe_worker._transport.script_flow import SCRIPT_NAMES, SENDER_SCRIPTS, library_name, library_text
from dedupe_worker._transport.scripts import load_script

CASES = ("claim new", "claim in progress", "complete", "claim duplicate")
LEASE_MS, RETENTION_MS, RESULT_TTL_MS = 30_000, 600_000, 600_000


def load(client: redis.Redis, folder: Path | None) -> str:
    """Load ``folder``'s scripts (``None``: this tree's) as their function library; its name."""
    read = load_script if folder is None else (lambda name: (folder / f"{name}.lua").read_text(encoding="utf-8"))
    source = {name: read(name) for name in (*SENDER_SCRIPTS, *SCRIPT_NAMES)}
    library = library_name(source)
    client.function_load(library_text(source, library), replace=True)
    return library


def usec_per_call(client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> float:
    """Redis' time per ``FCALL`` of ``commands``, pipelined 500 at a time."""
    client.config_resetstat()
    pipe = client.pipeline(transaction=False)
    for n, command in enumerate(commands, 1):
        pipe.execute_command(*command)  # type: ignore[no-untyped-call]
        if n % 500 == 0:
            pipe.execute()
    pipe.execute()
    return float(client.info("commandstats")["cmdstat_fcall"]["usec_per_call"])


def one_round(client: redis.Redis, library: str, keys: int) -> dict[str, float]:
    stems = [f"{{ab-{uuid.uuid4().hex}-{i}}}" for i in range(keys)]
    claims = [("FCALL", f"{library}_claim", 3, f"{s}:started", s, f"{s}:result", LEASE_MS, RETENTION_MS, "", "", "2")
              for s in stems]
    spent = {"claim new": usec_per_call(client, claims), "claim in progress": usec_per_call(client, claims)}
    pipe = client.pipeline(transaction=False)
    for s in stems:
        pipe.hget(f"{s}:started", "owner")
    tokens = [int(t) for t in pipe.execute()]
    spent["complete"] = usec_per_call(client, [
        ("FCALL", f"{library}_complete", 4, f"{s}:started", s, f"{s}:result", f"{s}:notice", RESULT_TTL_MS, t, "c",
         b"c" + t.to_bytes(8, "big") + b"null", "2") for s, t in zip(stems, tokens, strict=True)])
    spent["claim duplicate"] = usec_per_call(client, claims)
    for start in range(0, keys, 1000):
        client.unlink(*[name for s in stems[start:start + 1000] for name in (s, f"{s}:started", f"{s}:result")])
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--baseline", type=Path, required=True, help="another commit's lua/ folder")
    parser.add_argument("--keys", type=int, default=10_000, help="keys per case and round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    client = redis.Redis.from_url(args.redis_url)
    sides = {"baseline": load(client, args.baseline), "this": load(client, None)}
    runs: dict[tuple[str, str], list[float]] = {}
    for n in range(args.rounds):
        for side in (("baseline", "this") if n % 2 else ("this", "baseline")):
            for case, usec in one_round(client, sides[side], args.keys).items():
                runs.setdefault((side, case), []).append(usec)
    print(f"Redis time per FCALL (INFO commandstats usec_per_call, median of {args.rounds} rounds of {args.keys} keys, "
          f"taking turns; record format 2)")
    for case in CASES:
        base, this = statistics.median(runs["baseline", case]), statistics.median(runs["this", case])
        print(f"  {case:18} baseline {base:6.2f} µs   this tree {this:6.2f} µs   ratio {this / base:.2f}")


if __name__ == "__main__":
    main()
