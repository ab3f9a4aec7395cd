"""Checks of the Redis settings the guarantees depend on, each with what to change.

``diagnose(client)`` returns one :class:`Check` per topic; ``ok`` is False for what breaks a
guarantee, ``warn`` marks what weakens one. ``warn_once`` logs the failing and weakening ones
once per process and Redis, for the consumers' start-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

__all__ = ["Check", "diagnose", "warn_once"]

log = logging.getLogger(__name__)
_warned: set[str] = set()


@dataclass(frozen=True)
class Check:
    """One topic: ``ok`` (nothing breaks), ``warn`` (a guarantee is weaker), what was seen and what to do."""

    name: str
    ok: bool
    detail: str
    advice: str = ""
    warn: bool = False

    @property
    def mark(self) -> str:
        return "FAIL" if not self.ok else ("WARN" if self.warn else "ok")


def _config(client: Any, name: str) -> str | None:
    try:
        value = client.config_get(name).get(name)
    except redis.RedisError:
        return None  # CONFIG may be disabled (managed services)
    return value if isinstance(value, str) or value is None else str(value)


def diagnose(client: redis.Redis | RedisCluster, *, rate: float = 0.0, result_ttl: float = 86400.0,
             bytes_per_key: int = 200) -> list[Check]:
    """Check ``client``'s Redis; ``rate`` (messages/s) and ``result_ttl`` give the memory projection."""
    checks: list[Check] = []
    policy = _config(client, "maxmemory-policy")
    if policy is None:
        checks.append(Check("eviction", True, "CONFIG GET is not allowed here", "make sure maxmemory-policy is "
                            "noeviction: every record has a TTL, so volatile-* policies evict them too", warn=True))
    else:
        checks.append(Check("eviction", policy == "noeviction", f"maxmemory-policy {policy}",
                            "" if policy == "noeviction" else "set maxmemory-policy noeviction: an evicted claim or "
                            "result lets a duplicate apply again (all our keys have a TTL, so volatile-* evict them)"))
    info = client.info()
    used, limit = int(info.get("used_memory", 0)), int(_config(client, "maxmemory") or 0)
    need = int(rate * result_ttl * bytes_per_key)
    if limit:
        headroom = limit - used
        checks.append(Check("memory", headroom > need, f"{used:,} of {limit:,} bytes used; "
                            f"projection {need:,} bytes ({rate:g} msg/s x {result_ttl:g} s x {bytes_per_key} B)",
                            "" if headroom > need else "raise maxmemory or lower result_ttl"))
    else:
        checks.append(Check("memory", True, f"{used:,} bytes used, no maxmemory; projection {need:,} bytes "
                            f"({rate:g} msg/s x {result_ttl:g} s x {bytes_per_key} B)", "set maxmemory above the "
                            "projection so Redis refuses writes (the engine defers) instead of the OS killing it",
                            warn=True))
    aof, fsync, save = _config(client, "appendonly"), _config(client, "appendfsync"), _config(client, "save")
    if aof == "yes":
        checks.append(Check("persistence", True, f"AOF on, appendfsync {fsync}",
                            "" if fsync == "always" else "appendfsync always loses no acknowledged write on a crash "
                            f"({fsync} can lose about a second)", warn=fsync != "always"))
    else:
        checks.append(Check("persistence", False, f"AOF off, RDB save '{save or ''}'",
                            "turn on appendonly yes (appendfsync always or everysec): a restart without it forgets "
                            "every claim and result, and duplicates apply again"))
    repl = client.info("replication")
    replicas = int(repl.get("connected_slaves", 0))
    min_replicas = _config(client, "min-replicas-to-write")
    unguarded = min_replicas in (None, "0")
    if repl.get("role") == "master" and replicas:
        checks.append(Check("replication", True, f"{replicas} replica(s); min-replicas-to-write {min_replicas}",
                            "" if not unguarded else "a failover can lose the last writes: set "
                            "min-replicas-to-write and use wait_replicas (see README)", warn=unguarded))
    else:
        checks.append(Check("replication", True, f"role {repl.get('role')}, {replicas} replica(s)",
                            "no replica: a lost primary loses everything not on disk", warn=True))
    try:
        client.script_load("return 1")
        sha = client.script_load("return redis.call('TIME')[1]")
        client.evalsha(sha, 0)
        checks.append(Check("scripts", True, "SCRIPT LOAD, EVALSHA and TIME inside scripts work"))
    except redis.RedisError as exc:
        checks.append(Check("scripts", False, f"scripts cannot run: {exc}",
                            "allow EVAL, EVALSHA and SCRIPT for this user (ACL: +@scripting)"))
    if isinstance(client, RedisCluster):
        slot = client.cluster_keyslot("dedupe:{k}:started") == client.cluster_keyslot("dedupe:{k}:result")
        checks.append(Check("cluster", slot, "cluster mode; a key's records share a hash slot" if slot
                            else "records of one key land in different slots", "" if slot else "report a bug"))
    else:
        checks.append(Check("cluster", True, "standalone (or Sentinel-managed) primary"))
    seconds, micros = client.time()
    skew = abs(seconds + micros / 1e6 - time.time())
    checks.append(Check("clock", skew < 1.0, f"Redis TIME is {skew * 1000:.0f} ms from this host's clock",
                        "" if skew < 1.0 else "leases use Redis' clock only, but tokens after a failover assume the "
                        "primaries' clocks agree: run NTP on them", warn=skew >= 0.1))
    return checks


def warn_once(client: redis.Redis | RedisCluster, **projection: Any) -> None:
    """Log the checks that fail or warn, once per process and Redis (for consumers' start-up)."""
    where = repr(client)
    if where in _warned:
        return
    _warned.add(where)
    try:
        checks = diagnose(client, **projection)
    except redis.RedisError as exc:
        log.warning("could not check Redis settings: %s", exc)
        return
    for check in checks:
        if not check.ok:
            log.error("Redis check %s failed: %s. %s", check.name, check.detail, check.advice)
        elif check.warn:
            log.warning("Redis check %s: %s. %s", check.name, check.detail, check.advice)
