"""What the operator commands read of a SQL store (``inspect``, ``forget --dry-run``, ``stats``):
a key's row times, whether a namespace holds anything, and a namespace's rows counted by state.
Read-only; each is one short query."""

from __future__ import annotations

from typing import Any

from .pool import SqlPool
from .urls import POSTGRESQL

__all__ = ["namespace_is_empty", "row_times", "survey_sql"]

_NOW = {POSTGRESQL: "clock_timestamp()", "mysql": "NOW(6)"}


def _query(pool: SqlPool, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    sql = sql.replace("{now}", _NOW[pool.dialect])
    with pool.connection() as conn:
        if pool.dialect == POSTGRESQL:
            return list(conn.execute(sql, params).fetchall())
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())


def _ms_left(dialect: str) -> str:
    if dialect == POSTGRESQL:
        return "ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000)"
    return "CEIL(TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at) / 1000)"


def row_times(pool: SqlPool, stem: str) -> tuple[int, int, str]:
    """``(claim_ttl_ms, outcome_ttl_ms, original_key)`` of ``stem``'s row as ``inspect`` shows Redis'
    TTLs: the row's time left on the claim or on the outcome, -2 for the one it does not hold
    (both -2: no live row)."""
    rows = _query(pool, f"SELECT status, {_ms_left(pool.dialect)}, orig FROM dedupe_claims "
                        "WHERE stem = %s AND expires_at > {now}", (stem.encode("utf-8"),))
    if not rows:
        return -2, -2, ""
    status, left, orig = rows[0]
    orig = orig.decode("utf-8", "replace") if isinstance(orig, bytes) else (orig or "")
    return (-2, int(left), orig) if status is not None else (int(left), -2, orig)


def namespace_is_empty(pool: SqlPool, namespace: str) -> bool:
    """Whether no row of ``namespace`` exists (expired ones included)."""
    prefix = f"{namespace}:{{".encode()
    return not _query(pool, "SELECT 1 FROM dedupe_claims WHERE stem >= %s AND stem < %s LIMIT 1",
                      (prefix, prefix[:-1] + b"|"))


def survey_sql(pool: SqlPool, namespace: str) -> dict[str, int]:
    """``namespace``'s rows by state: ``done``, ``failed``, ``in_progress``, ``free`` (released or
    lapsed, keeping its token), ``expired`` (counted as gone, awaiting ``sql purge``)."""
    prefix = f"{namespace}:{{".encode()
    rows = _query(pool, """
        SELECT CASE WHEN expires_at <= {now} THEN 'expired'
                    WHEN status = 'f' THEN 'failed'
                    WHEN status IS NOT NULL THEN 'done'
                    WHEN owner > 0 AND deadline > {now} THEN 'in_progress'
                    ELSE 'free' END AS state, count(*)
          FROM dedupe_claims WHERE stem >= %s AND stem < %s GROUP BY 1""", (prefix, prefix[:-1] + b"|"))
    return {str(state): int(count) for state, count in rows}
