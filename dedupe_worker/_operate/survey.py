"""A namespace at a glance, read with a bounded ``SCAN`` that never blocks Redis."""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

from redis.exceptions import ResponseError

from .._protocol import KeyLayout
from .._transport import queue_size_read, size_from_replies

__all__ = ["UNREADABLE", "Survey", "survey"]

#: The state of a record the scripts cannot read (another type under the name, a malformed
#: outcome): ``claim.lua`` answers UNREADABLE for its key, ``forget KEY --force`` removes it.
UNREADABLE = "unreadable"


@dataclass
class Survey:
    """Counts by state, stored-result sizes, TTL spread and bytes per key (on a sample)."""

    keys: int = 0
    states: Counter[str] = field(default_factory=Counter)
    result_bytes: list[int] = field(default_factory=list)
    ttls_ms: list[int] = field(default_factory=list)
    #: The remaining TTLs of the sampled outcomes (result records) alone.
    result_ttls_ms: list[int] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)

    @property
    def bytes_per_key(self) -> int:
        """Mean ``MEMORY USAGE`` of a key's records over the sample (0 when none)."""
        return int(statistics.mean(self.memory)) if self.memory else 0

    def projection(self, rate: float, result_ttl: float) -> int:
        """Bytes needed at ``rate`` messages/s kept ``result_ttl`` s: R x T x bytes per key."""
        return int(rate * result_ttl * self.bytes_per_key)

    def retention(self, result_ttl: float) -> tuple[float, str]:
        """Seconds the projection assumes each outcome is kept, and where that comes from:
        ``result_ttl``, unless a sampled outcome still has longer to live (per-message ttls above
        it), then the longest remaining TTL sampled (``"sampled"``), a floor of the longest ttl
        in use. A remaining TTL never says how long its outcome was kept in all: outcomes written
        in a burst just now have nearly their whole ttl left, at a steady rate half of it."""
        longest = max(self.result_ttls_ms, default=0) / 1000
        return (longest, "sampled") if longest > result_ttl else (result_ttl, "result_ttl")

    def as_dict(self, rate: float, result_ttl: float) -> dict[str, Any]:
        def spread(values: list[int]) -> dict[str, int]:
            if not values:
                return {}
            ordered = sorted(values)
            return {"min": ordered[0], "p50": ordered[len(ordered) // 2], "max": ordered[-1]}

        retention, source = self.retention(result_ttl)
        return {"keys": self.keys, "states": dict(self.states), "result_bytes": spread(self.result_bytes),
                "ttl_ms": spread(self.ttls_ms), "result_ttl_ms": spread(self.result_ttls_ms),
                "bytes_per_key": self.bytes_per_key, "rate": rate, "result_ttl": result_ttl,
                "retention": retention, "retention_from": source,
                "projection_bytes": self.projection(rate, retention)}


def survey(client: Any, namespace: str, *, sample: int = 1000, count: int = 500,
           progress: TextIO | None = sys.stderr) -> Survey:
    """``SCAN MATCH <namespace>:* COUNT count`` (each call bounded, so Redis never blocks); the
    first ``sample`` records are looked at closely (state, sizes, TTL, memory). An outcome is
    counted in either record format: a format-2 string at the stem (a name ending in ``}``) or a
    format-1 hash at ``<stem>:result``; ``keys`` counts every key of the namespace. A record the
    scripts cannot read (another Redis type under one of a key's names, a malformed outcome) is
    counted as :data:`UNREADABLE`, never raised."""
    found = Survey()
    looked = 0
    for name in client.scan_iter(match=f"{namespace}:*", count=count):
        name = name.decode() if isinstance(name, bytes) else name
        found.keys += 1
        if progress is not None and found.keys % 1000 == 0:
            progress.write(f"\rscanned {found.keys:,} keys")
            progress.flush()
        kind = KeyLayout.kind(name)
        if looked >= sample or kind == "notice":
            continue
        looked += 1
        pipe = client.pipeline(transaction=False)
        is_result = kind in ("record", "result")
        if is_result:
            queue_size_read(pipe, name)
        else:
            pipe.hget(name, "owner")
        pipe.pttl(name)
        pipe.memory_usage(name)
        *reads, ttl, memory = pipe.execute(raise_on_error=False)
        if is_result:
            try:
                status, size = size_from_replies(*reads)
            except (ResponseError, ValueError):  # WRONGTYPE, or a record the scripts cannot read
                found.states[UNREADABLE] += 1
            else:
                if status:  # else it expired since the SCAN
                    found.states[{b"f": "failed", b"o": "done (omitted)"}.get(status, "done")] += 1
                    found.result_bytes.append(size)
                    found.result_ttls_ms.append(int(ttl))
        elif kind in ("started", "sent") and isinstance(reads[0], ResponseError):
            found.states[UNREADABLE] += 1  # another program's key of another type under the name
        elif kind == "started":
            owner = reads[0]
            if isinstance(owner, Exception):
                raise owner
            found.states["in_progress" if owner not in (None, b"0", "0") else "free"] += 1
        found.ttls_ms.append(int(ttl))
        found.memory.append(int(memory or 0))
    if progress is not None and found.keys >= 1000:
        progress.write("\n")
    return found
