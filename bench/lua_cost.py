"""Redis' own time per key of each protocol script (``INFO commandstats`` of EVALSHA), for single
keys and batches, and memory per completed key.

    python -m bench.lua_cost [--redis-url URL] [--keys N] [--rounds R] [--functions]
                             [--baseline DIR [--baseline-format 1|2]]

Each case sets its keys up, resets the server's statistics (``CONFIG RESETSTAT``), sends the
script calls for ``N`` keys (one key per call, or batches of 100 and 500 as ``begin_many`` and
``complete_many`` send them) and reads EVALSHA's total ``usec``: Redis' time per key, AOF
propagation included when the server has ``appendonly yes`` (``make bench`` starts its private
server so). The cases: a claim of a new key (without and with a fingerprint), of a key whose
outcome is stored (duplicate), of a key a live lease holds, of a released key; a completion, a
renewal, a release. This release's scripts run twice, writing results in record format 1 (the
hash at ``<stem>:result`` every release reads: "this f1") and 2 (the compact string at the stem
itself: "this f2"). ``--baseline DIR``
runs every case with the scripts in ``DIR`` too (e.g.
``tests/data/lua_previous``, those of the previous release), alternating round by round on the
same server, and prints both: timings on a shared machine swing, a side-by-side run does not.
``--baseline-format`` says the folder's scripts take this release's calls (another commit's
``lua/``), writing that record format. ``--functions`` loads each set as the function library the
runner loads on Redis 7+ and calls it with FCALL, as the library path runs in production.
``make bench`` runs it on its private redis-server, never on a shared one (the reset would clear
everyone's statistics).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from dedupe_worker._protocol import Stored
from dedupe_worker._protocol.calls import Call
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker._transport.script_flow import SCRIPT_NAMES, library_name, library_text
from dedupe_worker._transport.scripts import load_script
from tests.lua_releases import EarlierCalls, StandaloneCalls

BATCHES = (1, 100, 500)
LEASE_MS, RETENTION_MS, RESULT_TTL_MS = 30_000, 600_000, 600_000
VALUE = b'{"status":"charged","amount":1250}'
FINGERPRINT = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
CASES = ("claim new", "claim new, fp", "claim duplicate", "claim in progress", "claim released",
         "complete", "renew", "release")


class Version:
    """One set of the protocol scripts, loaded on the server, run by name: with EVALSHA, or with
    ``functions`` as the function library our runner loads on Redis 7+ (FCALL)."""

    def __init__(self, client: redis.Redis, label: str, texts: dict[str, str], record_format: int = 1,
                 earlier: bool = False, functions: bool = False) -> None:
        self.client, self.label = client, label
        #: The calls the store sends, writing results in ``record_format`` (``earlier``: the
        #: calls of a release before record format 2).
        self.calls = EarlierCalls() if earlier else StandaloneCalls()
        self.calls.write_format(record_format)
        #: The command each call is (what ``INFO commandstats`` counts it under).
        self.command = "FCALL" if functions else "EVALSHA"
        if functions:
            library = library_name(texts)
            client.function_load(library_text(texts, library), replace=True)
            self.target = {name: f"{library}_{name}" for name in texts}
        else:
            self.target = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in texts.items()}
            for text in texts.values():
                client.script_load(text)

    @classmethod
    def from_dir(cls, client: redis.Redis, label: str, folder: Path | None, record_format: int = 1,
                 functions: bool = False, earlier: bool = True) -> Version:
        """``folder``'s scripts (``None``: this tree's), sent the calls of a release before record
        format 2 when ``earlier`` (a folder only)."""
        read = (lambda n: (folder / f"{n}.lua").read_text(encoding="utf-8")) if folder else load_script
        return cls(client, label, {name: read(name) for name in SCRIPT_NAMES}, record_format,
                   earlier=folder is not None and earlier, functions=functions)

    def run(self, calls: Sequence[Call]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for name, keys, args in calls:
            pipe.execute_command(self.command, self.target[name], len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        return pipe.execute()


def _tokens(replies: list[Any]) -> list[int]:
    return [int(t) for reply in replies for t in reply[1::4]]


def _batched(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def case_calls(v: Version, case: str, stems: list[str], size: int) -> list[Call]:
    """Set ``stems`` up for ``case`` (with ``v``'s scripts) and return the calls to measure."""
    c = v.calls
    fp = FINGERPRINT if case == "claim new, fp" else ""
    claims = [c.claim_calls([(s, fp, "") for s in part], LEASE_MS, RETENTION_MS) for part in _batched(stems, size)]
    if case.startswith("claim new"):
        return [call for calls in claims for call in calls]
    tokens = _tokens(v.run([call for calls in claims for call in calls]))
    held = list(zip(stems, tokens, strict=True))
    if case == "claim duplicate":
        v.run(c.complete_calls([(s, t, Stored.COMPLETED, VALUE) for s, t in held], RESULT_TTL_MS))
    elif case == "claim released":
        v.run(c.release_calls(held, RETENTION_MS))
    if case.startswith("claim"):
        return [call for calls in claims for call in calls]
    parts = _batched(held, size)
    if case == "complete":
        return [call for part in parts
                for call in c.complete_calls([(s, t, Stored.COMPLETED, VALUE) for s, t in part], RESULT_TTL_MS)]
    if case == "renew":
        return [call for part in parts for call in c.renew_calls(part, LEASE_MS, RETENTION_MS)]
    return [call for part in parts for call in c.release_calls(part, RETENTION_MS)]


def server_usec(v: Version, calls: Sequence[Call]) -> float:
    """Redis' total time in EVALSHA (or FCALL) running ``calls``."""
    return priced(v, calls)[0]


def priced(v: Version, calls: Sequence[Call]) -> tuple[float, list[Any]]:
    """:func:`server_usec` of ``calls``, and their replies."""
    client = v.client
    client.config_resetstat()
    replies = v.run(calls)
    return float(client.info("commandstats").get(f"cmdstat_{v.command.lower()}", {}).get("usec", 0.0)), replies


def memory(v: Version, fingerprint: str) -> tuple[float, float]:
    """``MEMORY USAGE`` of every record of one key named as ``bench.core`` names it: while its
    claim is held, and once completed."""
    stem = KeyLayout(f"bench-{uuid.uuid4().hex[:8]}").stem("memory-probe-order-00012345")
    records = KeyLayout.records(stem)
    c = v.calls
    token = _tokens(v.run(c.claim_calls([(stem, fingerprint, "")], LEASE_MS, RETENTION_MS)))[0]
    held = sum(v.client.memory_usage(k) or 0 for k in records)
    v.run(c.complete_calls([(stem, token, Stored.COMPLETED, VALUE)], RESULT_TTL_MS))
    done = sum(v.client.memory_usage(k) or 0 for k in records)
    v.client.delete(*records)
    return float(held), float(done)


def floor_bytes(client: redis.Redis) -> dict[int, float]:
    """``MEMORY USAGE`` of a plain ``SET ... PX`` of the probe's value at the name its outcome
    record takes, by record format (2: the stem, 1: ``<stem>:result``): the floor for a completed
    key on this server."""
    stem = KeyLayout(f"bench-{uuid.uuid4().hex[:8]}").stem("memory-probe-order-00012345")
    floors = {}
    for record_format, name in ((2, KeyLayout.record(stem)), (1, KeyLayout.result(stem))):
        client.set(name, VALUE, px=RESULT_TTL_MS)
        floors[record_format] = float(client.memory_usage(name) or 0)
        client.delete(name)
    return floors


def measure(url: str, keys: int, rounds: int, versions: Sequence[tuple[str, Path | None, int]],
            functions: bool = False, earlier: bool = True) -> dict[str, Any]:
    """µs of Redis time per key, by ``(version, case, batch size)`` (the median of the rounds: a
    round that shared the CPU with another process is an outlier, not a trend); memory by version."""
    client = redis.Redis.from_url(url)
    loaded = [Version.from_dir(client, label, folder, record_format, functions, earlier)
              for label, folder, record_format in versions]
    runs: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(rounds):
        for size in BATCHES:
            for case in CASES:
                for v in loaded:  # alternating: each version meets the same moment of a noisy machine
                    ns = f"lua-{uuid.uuid4().hex[:8]}"
                    stems = [f"{ns}:{{order-{i}}}" for i in range(keys)]
                    calls = case_calls(v, case, stems, size)
                    runs.setdefault((v.label, case, size), []).append(server_usec(v, calls) / keys)
                    for name in client.scan_iter(f"{ns}:*", count=5000):
                        client.unlink(name)
    return {"usec": {key: statistics.median(values) for key, values in runs.items()}, "command": loaded[0].command,
            "memory": {v.label: (memory(v, ""), memory(v, FINGERPRINT)) for v in loaded},
            "floor": floor_bytes(client),
            "aof": client.config_get("append*")}


def report(m: dict[str, Any], labels: Sequence[str], keys: int, rounds: int) -> str:
    aof = m["aof"]
    lines = [f"Redis time per key (INFO commandstats usec of {m['command']} / keys, median of {rounds} rounds of "
             f"{keys} keys; "
             f"appendonly {aof.get('appendonly')}, appendfsync {aof.get('appendfsync')})",
             f"  {'case':<20}" + "".join(f"{f'{lb} x{size}':>16}" for size in BATCHES for lb in labels)]
    for case in CASES:
        lines.append(f"  {case:<20}" + "".join(f"{m['usec'][(lb, case, size)]:>13.2f} µs"
                                                for size in BATCHES for lb in labels))
    for lb in labels:
        (held, done), (held_fp, done_fp) = m["memory"][lb]
        lines.append(f"  memory per key ({lb}, MEMORY USAGE of its records): completed {done:.0f} bytes, "
                     f"{done_fp:.0f} with a fingerprint; claimed {held:.0f}, {held_fp:.0f} with a fingerprint")
    lines.append(f"  floor: a plain SET ... PX of the value at the name the outcome takes: {m['floor'][2]:.0f} "
                 f"bytes at the stem (format 2), {m['floor'][1]:.0f} at <stem>:result (format 1)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--keys", type=int, default=1000, help="keys per case and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="a folder of other scripts to run side by side")
    parser.add_argument("--baseline-format", type=int, choices=(1, 2),
                        help="the baseline's scripts take this release's calls and write this record format "
                             "(e.g. `git archive REF lua | tar -x -C DIR`); without it, a release's before format 2")
    parser.add_argument("--functions", action="store_true",
                        help="load each version as the function library and call it with FCALL (Redis 7+)")
    args = parser.parse_args()
    versions: list[tuple[str, Path | None, int]] = [("this f1", None, 1), ("this f2", None, 2)]
    if args.baseline:
        versions.insert(0, ("baseline", args.baseline, args.baseline_format or 1))
    m = measure(args.redis_url, args.keys, args.rounds, versions, args.functions,
                earlier=args.baseline_format is None)
    print(report(m, [label for label, _, _ in versions], args.keys, args.rounds))


if __name__ == "__main__":
    main()
