"""``dedupe-worker doctor`` on a SQL store: what the guarantees depend on there, with what to do.

* ``schema``: the schema's version is the one this release runs (``dedupe-worker sql init``);
* ``durability``: a claim or outcome acknowledged is on disk (PostgreSQL ``fsync`` and
  ``synchronous_commit``; MySQL ``innodb_flush_log_at_trx_commit``): off, a database crash can
  forget a key's outcome and its work runs again (as after a Redis failover);
* ``clock``: leases are timed by the database's clock alone; a far-off local clock is only noted
  (``retry_after`` and waits are computed from the database's answers);
* ``connections``: each worker process holds up to 16 connections (its pool) and a listener.
"""

from __future__ import annotations

import time
from typing import Any

from .._sqlstore import SCHEMA_VERSION, SqlPool, installed_version
from .._sqlstore.urls import POSTGRESQL
from .check import Check

__all__ = ["diagnose_sql"]


def diagnose_sql(pool: SqlPool) -> list[Check]:
    """One :class:`Check` per topic (see the module doc); a database that cannot be reached is one
    failing ``connection`` check."""
    try:
        version = installed_version(pool)
        settings = _settings(pool)
    except Exception as exc:  # any driver error: say it, do not crash a consumer's start
        return [Check("connection", False, f"cannot reach the {pool.dialect} store: {exc}",
                      "check the URL and that the database runs")]
    return [_schema(version), _durability(pool.dialect, settings), _clock(settings), _connections(settings)]


def _settings(pool: SqlPool) -> dict[str, Any]:
    with pool.connection() as conn:
        if pool.dialect == POSTGRESQL:
            row = conn.execute(
                "SELECT current_setting('fsync'), current_setting('synchronous_commit'), "
                "extract(epoch FROM clock_timestamp()), current_setting('max_connections')::int, "
                "(SELECT count(*) FROM pg_stat_activity)").fetchone()
        else:
            with conn.cursor() as cursor:
                cursor.execute("SELECT 'on', @@innodb_flush_log_at_trx_commit, UNIX_TIMESTAMP(NOW(6)), "
                               "@@max_connections, (SELECT count(*) FROM information_schema.processlist)")
                row = cursor.fetchone()
    fsync, commit, now, limit, used = row
    return {"fsync": str(fsync), "commit": str(commit), "skew": float(now) - time.time(), "limit": int(limit),
            "used": int(used)}


def _schema(version: int | None) -> Check:
    if version is None:
        return Check("schema", False, "no dedupe schema in this database", "run: dedupe-worker sql init --store <url>")
    if version < SCHEMA_VERSION:
        return Check("schema", False, f"schema version {version}, this release runs {SCHEMA_VERSION}",
                     "run: dedupe-worker sql init --store <url> (adds this version beside the old one)")
    return Check("schema", True, f"schema version {version}")


def _durability(dialect: str, s: dict[str, Any]) -> Check:
    if dialect == POSTGRESQL:
        if s["fsync"] != "on":
            return Check("durability", False, "fsync is off: a crash can corrupt or lose the claims table",
                         "set fsync = on")
        if s["commit"] == "off":
            return Check("durability", True, "synchronous_commit = off: a crash loses the last moments of "
                         "acknowledged claims and outcomes (their work may run again)",
                         "set synchronous_commit = on for the dedupe role if that matters", warn=True)
        return Check("durability", True, f"synchronous_commit = {s['commit']}")
    if s["commit"] != "1":
        return Check("durability", True, f"innodb_flush_log_at_trx_commit = {s['commit']}: a crash loses up to "
                     "a second of acknowledged claims and outcomes (their work may run again)",
                     "set innodb_flush_log_at_trx_commit = 1 if that matters", warn=True)
    return Check("durability", True, "innodb_flush_log_at_trx_commit = 1")


def _clock(s: dict[str, Any]) -> Check:
    skew = s["skew"]
    detail = f"database clock {skew:+.3f} s from this host's; leases are timed by the database's alone"
    return Check("clock", True, detail, "sync this host's clock (NTP)", warn=abs(skew) > 5)


def _connections(s: dict[str, Any]) -> Check:
    used, limit = s["used"], s["limit"]
    detail = f"{used} of max_connections {limit} in use; each worker process takes up to 16 and a listener"
    return Check("connections", True, detail, "raise max_connections or put a pooler in front",
                 warn=used > 0.8 * limit)
