"""Checks of the Redis settings the guarantees depend on, each with what to change.

``diagnose(client)`` returns one :class:`Check` per topic (on a Redis Cluster, of every primary);
``ok`` is False for what breaks a guarantee, ``warn`` marks what weakens one. ``check_at_start``
is the consumers' start-up: it refuses an evicting Redis, then ``warn_once`` logs the failing and
weakening checks once per process and Redis.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from redis.cluster import RedisCluster

from .._errors import StoreUnavailable
from .._settings import ClientOptions
from .._sqlstore import SqlPool
from .._transport import (
    LIBRARY_PREFIX,
    SCRIPT_NAMES,
    SENDER_SCRIPTS,
    ClaimClient,
    is_evicting,
    library_name,
    load_script,
)
from .check import Check

__all__ = ["DEFAULT_RATE", "check_at_start", "diagnose", "warn_once"]

log = logging.getLogger(__name__)
#: The SHA1 of ``claim.lua`` as releases before record format 2 load it (``SCRIPT LOAD``, then
#: ``EVALSHA``; the text has no flags line, so the SHA is the same on every server). Such a worker
#: reads only format 1's ``:result`` hash: it takes a key whose outcome is a format-2 string for
#: a new one. ``tests/test_operate.py`` checks these against ``tests/data/lua_*/claim.lua``.
EARLIER_CLAIM_SHAS = {"63bed40012503e0109b491fa9551359b4bbc4b6a": "0.1.0",
                      "0fd57312c11b266df90e727eff381ec80a3c13c2": "before 0.1.0"}
#: How many keys the record-format check scans at most on each node, looking for a format-2 outcome.
FORMAT_SCAN_LIMIT = 10_000
#: Messages/s the memory projection assumes unless told (``doctor --rate``, consumers' start-up).
DEFAULT_RATE = 100.0
_warned: set[str] = set()


def _config(client: Any, name: str) -> str | None:
    try:
        value = client.config_get(name).get(name)
    except redis.RedisError:
        return None  # CONFIG may be disabled (managed services)
    return value if isinstance(value, str) or value is None else str(value)


def diagnose(client: redis.Redis | RedisCluster | SqlPool, *, rate: float = DEFAULT_RATE,
             result_ttl: float = ClientOptions.result_ttl,
             bytes_per_key: int = 200, namespace: str | None = None) -> list[Check]:
    """Check ``client``'s Redis; ``rate`` (messages/s) and ``result_ttl`` give the memory projection.
    With ``namespace``, also whether format-2 outcomes are stored where a worker of an earlier
    release still runs (a bounded ``SCAN`` of that namespace: the ``records`` check).

    On a Redis Cluster the settings of every primary are checked (each holds its share of the
    projection); a topic fails when it fails on any primary, and its detail names each node."""
    if isinstance(client, SqlPool):  # the SQL store: its own topics
        from .sqldoctor import diagnose_sql

        return diagnose_sql(client)
    if isinstance(client, RedisCluster):
        primaries = client.get_primaries()  # type: ignore[no-untyped-call]
        share = rate / max(1, len(primaries))
        per_node = [(node.name, _node_checks(node.redis_connection, share, result_ttl, bytes_per_key, namespace))
                    for node in primaries]
        checks = _merge(per_node)
    else:
        checks = _node_checks(client, rate, result_ttl, bytes_per_key, namespace)
    try:
        client.script_load("return 1")
        sha = client.script_load("return redis.call('TIME')[1]")
        client.evalsha(sha, 0)
        checks.append(Check("scripts", True, "SCRIPT LOAD, EVALSHA and TIME inside scripts work"))
    except redis.RedisError as exc:
        checks.append(Check("scripts", False, f"scripts cannot run: {exc}",
                            "allow EVAL, EVALSHA and SCRIPT for this user (ACL: +@scripting)"))
    if isinstance(client, RedisCluster):
        slot = (client.cluster_keyslot("dedupe:{k}:started") == client.cluster_keyslot("dedupe:{k}:result")
                == client.cluster_keyslot("dedupe:{k}"))
        checks.append(Check("cluster", slot, f"cluster mode, {len(primaries)} primaries; a key's records share "
                            "a hash slot" if slot else "records of one key land in different slots",
                            "" if slot else "report a bug"))
    else:
        checks.append(Check("cluster", True, "standalone (or Sentinel-managed) primary"))
    seconds, micros = client.time()
    skew = abs(seconds + micros / 1e6 - time.time())
    checks.append(Check("clock", skew < 1.0, f"Redis TIME is {skew * 1000:.0f} ms from this host's clock",
                        "" if skew < 1.0 else "leases use Redis' clock only, but tokens after a failover assume the "
                        "primaries' clocks agree: run NTP on them", warn=skew >= 0.1))
    return checks


def _merge(per_node: list[tuple[str, list[Check]]]) -> list[Check]:
    """One check per topic from each primary's: failed if any failed, warned if any warned."""
    merged = []
    for i, first in enumerate(per_node[0][1]):
        topic = [(node, checks[i]) for node, checks in per_node]
        worst = next((c for _, c in topic if not c.ok), None) or next((c for _, c in topic if c.warn), first)
        details = {c.detail for _, c in topic}
        detail = (f"{first.detail} (every primary)" if len(details) == 1
                  else "; ".join(f"{node}: {c.detail}" for node, c in topic))
        merged.append(Check(first.name, all(c.ok for _, c in topic), detail, worst.advice,
                            any(c.warn for _, c in topic)))
    return merged


def loaded_libraries(client: Any) -> list[str] | None:
    """The names of our function libraries loaded on ``client``'s node (one per release whose
    workers called it), or ``None`` where ``FUNCTION`` is unknown or not allowed (``EVALSHA``)."""
    try:
        reply = client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY_PREFIX + "*")
    except redis.ResponseError:
        return None
    names = []
    for library in reply or []:
        fields = library if isinstance(library, dict) else dict(zip(library[::2], library[1::2], strict=False))
        name = fields.get("library_name", fields.get(b"library_name", b""))
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return sorted(names)


def _functions_check(client: Any) -> Check:
    """Which versions of the protocol's function library the node holds: more than one means
    workers of another release share it (fine through a rolling upgrade, a warning after)."""
    names = loaded_libraries(client)
    ours = library_name({name: load_script(name) for name in (*SENDER_SCRIPTS, *SCRIPT_NAMES)})
    if names is None:
        return Check("functions", True, "FUNCTION is not available here: the scripts run with EVALSHA",
                     "a restart or failover reloads them (NOSCRIPT); allow FUNCTION (ACL +function) to "
                     "have them persisted and replicated", warn=True)
    if len(names) > 1:
        return Check("functions", True, f"{len(names)} library versions loaded: {', '.join(names)} "
                     f"(this release's: {ours})",
                     "workers of another release share this Redis (a rolling upgrade?); once it is over, "
                     "FUNCTION DELETE the old version's library", warn=True)
    if names:
        return Check("functions", True, f"library {names[0]} loaded"
                     + (" (this release's)" if names[0] == ours else f" (this release's is {ours})"))
    return Check("functions", True, f"no library loaded yet (this release's, {ours}, is loaded by the first call)")


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def has_format_2_outcome(client: Any, namespace: str, limit: int = FORMAT_SCAN_LIMIT) -> bool | None:
    """Whether ``client``'s node holds a format-2 outcome of ``namespace`` (a string at a stem,
    ``<namespace>:{<key>}``): ``SCAN MATCH <namespace>:{*}`` until the first one, over at most
    ``limit`` keys; ``None`` when that many were scanned without finding one nor reaching the end."""
    cursor, scanned = 0, 0
    while True:
        cursor, names = client.scan(cursor, match=_glob_escape(namespace) + ":{*}", count=1000)
        if names:
            return True
        scanned += 1000
        if int(cursor) == 0:
            return False
        if scanned >= limit:
            return None


def earlier_releases_loaded(client: Any) -> list[str]:
    """The releases before record format 2 whose ``claim.lua`` is loaded on ``client``'s node
    (``SCRIPT EXISTS``): a worker of that release called it since the node's last restart or
    ``SCRIPT FLUSH``. Empty where ``SCRIPT`` is refused."""
    shas = list(EARLIER_CLAIM_SHAS)
    try:
        found = client.script_exists(*shas)
    except redis.RedisError:
        return []
    return [EARLIER_CLAIM_SHAS[sha] for sha, there in zip(shas, found, strict=True) if there]


def _records_check(client: Any, namespace: str) -> Check:
    """Record format 2 is safe only once no worker of an earlier release shares the namespace:
    those read only format 1 and would run a message whose outcome is stored in format 2 again."""
    earlier = earlier_releases_loaded(client)
    stored = has_format_2_outcome(client, namespace)
    seen = {True: "format-2 outcomes are stored", False: "no format-2 outcome is stored",
            None: f"no format-2 outcome in the first {FORMAT_SCAN_LIMIT:,} keys scanned"}[stored]
    if stored and earlier:
        return Check("records", True, f"namespace {namespace}: {seen}, and scripts of release "
                     f"{', '.join(earlier)} are loaded, which read only format 1",
                     "stop every worker of an earlier release (or set DEDUPE_RECORD_FORMAT=1 until they are "
                     "upgraded; then SCRIPT FLUSH clears this warning): they run a message whose outcome is "
                     "stored in format 2 again", warn=True)
    loaded = f"; scripts of release {', '.join(earlier)} are loaded" if earlier else ""
    return Check("records", True, f"namespace {namespace}: {seen}{loaded}")


def _node_checks(client: Any, rate: float, result_ttl: float, bytes_per_key: int,
                 namespace: str | None = None) -> list[Check]:
    """The settings one Redis node is checked for: eviction, memory, persistence, replication."""
    checks: list[Check] = []
    policy = _config(client, "maxmemory-policy")
    if policy is None:
        checks.append(Check("eviction", True, "CONFIG GET is not allowed here", "make sure maxmemory-policy is "
                            "noeviction: every record has a TTL, so volatile-* policies evict them too", warn=True))
    else:
        checks.append(Check("eviction", not is_evicting(policy), f"maxmemory-policy {policy}",
                            "" if not is_evicting(policy) else "set maxmemory-policy noeviction: an evicted claim or "
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
    checks.append(_functions_check(client))
    if namespace is not None:
        checks.append(_records_check(client, namespace))
    repl = client.info("replication")
    replicas = int(repl.get("connected_slaves", 0))
    min_replicas = _config(client, "min-replicas-to-write")
    unguarded = min_replicas in (None, "0")
    if repl.get("role") == "master" and replicas:
        checks.append(Check("replication", True, f"{replicas} replica(s); min-replicas-to-write {min_replicas}",
                            "" if not unguarded else "a failover can lose the last writes: set "
                            "min-replicas-to-write and use wait_replicas (see docs/guarantees.md)", warn=unguarded))
    else:
        checks.append(Check("replication", True, f"role {repl.get('role')}, {replicas} replica(s)",
                            "no replica: a lost primary loses everything not on disk", warn=True))
    return checks


def check_at_start(dedupe: ClaimClient) -> None:
    """What a consumer runs as it starts: refuse a Redis that may evict our records
    (:meth:`~dedupe_worker._transport.ClaimClient.check_store`, raises
    :class:`~dedupe_worker.EvictionPolicyError` unless ``allow_eviction``), then log the other
    checks that fail or warn (:func:`warn_once`). Redis unreachable at start is only logged: the
    first claim checks again."""
    try:
        if not dedupe.store_checked:
            dedupe.check_store()
    except StoreUnavailable as exc:
        log.warning("could not check Redis settings at start: %s", exc)
        return
    warn_once(dedupe.store.client, result_ttl=dedupe.result_ttl, allow_eviction=dedupe.allow_eviction)


def warn_once(client: redis.Redis | RedisCluster | SqlPool, *, allow_eviction: bool = False, **projection: Any) -> None:
    """Log the checks that fail or warn, once per process and Redis (for consumers' start-up);
    with ``allow_eviction`` an evicting policy is logged as a warning, not an error."""
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
        if not check.ok and check.name == "eviction" and allow_eviction:
            log.warning("Redis check eviction: %s, allowed (allow_eviction): evicted keys run again", check.detail)
        elif not check.ok:
            log.error("Redis check %s failed: %s. %s", check.name, check.detail, check.advice)
        elif check.warn:
            log.warning("Redis check %s: %s. %s", check.name, check.detail, check.advice)
