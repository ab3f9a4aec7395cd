"""The I/O-free half of :func:`~dedupe_worker.sql._atomic`: the SQL it sends and what the answers mean.

Every driver (psycopg, SQLAlchemy, Django; sync and asyncio) runs the same steps from here and
only executes the :class:`Statement` objects they yield:

1. at entry, in the handler's transaction: ``INSERT`` the key's row (this run's token, its claim's
   fingerprint, its expiry) unless a row exists. The insert blocks while another transaction
   holds an uncommitted row of the same key, so of two runs the first to commit wins and the
   other sees its committed row;
2. no row inserted: ``SELECT`` it (a locking read on MySQL). Unexpired, it answers as Redis
   would: :class:`~dedupe_worker.KeyConflict` when it was written for another payload, else
   :class:`~dedupe_worker.AlreadyApplied` with its outcome (the driver rolls back what it
   opened). Expired, it is absent, as in Redis: an ``UPDATE`` that matches only an expired row
   makes it this run's, in the same transaction;
3. at exit: ``UPDATE`` the row with the outcome, encoded as the claim client stores results;
   a ``None`` outcome (the common no-op result) needs no statement: the row is inserted as
   "completed, result NULL", which reads back as ``None``.

Rows are keyed by the claim's Redis stem (``<namespace>:{<key or its hash>}``), so the row and the
Redis records of one key have the same name, hashed keys included.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from .._errors import AlreadyApplied, KeyConflict
from .._protocol import OMITTED, Claim, ClaimCodec, Stored

__all__ = ["FINGERPRINT_COLUMN_LIMIT", "KEY_COLUMN_LIMIT", "Dialect", "Row", "Statement", "answer", "conflicts",
           "dialect_named", "enter", "expired", "leave", "now_ms", "recorded", "row_of", "stored_key"]

#: Longest key (UTF-8 bytes) kept as it is in the key column; longer stems are stored hashed.
KEY_COLUMN_LIMIT = 512
#: Longest fingerprint a claim carries (a short string as given, else its sha256 in hex).
FINGERPRINT_COLUMN_LIMIT = 64
#: Status the entry writes: completed with a NULL result (``None``) until the exit records another.
#: (Rows of earlier builds may carry ``'p'``: read the same way.)
ENTERED = Stored.COMPLETED.value

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")


def check_table(table: str) -> str:
    """``table`` if it is a plain (optionally schema-qualified) SQL identifier, else ``ValueError``."""
    if not _IDENTIFIER.match(table):
        raise ValueError(f"table must be a plain SQL identifier such as 'dedupe_outcome', got {table!r}")
    return table


@dataclass(frozen=True)
class Statement:
    """One SQL statement with ``%(name)s`` placeholders; ``reads`` when the driver must answer
    with the first row (else with the row count)."""

    sql: str
    params: dict[str, Any]
    reads: bool = False


@dataclass(frozen=True)
class Dialect:
    """The statements of one database family, for one table."""

    name: str
    table: str

    @property
    def mysql(self) -> bool:
        return self.name in ("mysql", "mariadb")

    def insert(self, key: str, row: Row) -> Statement:
        head = "INSERT IGNORE INTO" if self.mysql else "INSERT INTO"
        tail = "" if self.mysql else " ON CONFLICT (dedupe_key) DO NOTHING"
        return Statement(f"{head} {self.table} (dedupe_key, token, status, fingerprint, expires_at) "
                         f"VALUES (%(key)s, %(token)s, '{ENTERED}', %(fingerprint)s, %(expires_at)s){tail}",
                         {"key": key, **row.params()})

    def replace(self, key: str, row: Row, now_ms: int) -> Statement:
        """Take over ``key``'s row when it expired (by ``now_ms``): this run's, as :meth:`insert`
        writes it. A row another run replaced first no longer matches (PostgreSQL re-reads it
        once that run committed; MySQL waits on its lock)."""
        return Statement(f"UPDATE {self.table} SET token = %(token)s, status = '{ENTERED}', result = NULL, "
                         "fingerprint = %(fingerprint)s, expires_at = %(expires_at)s "
                         "WHERE dedupe_key = %(key)s AND expires_at <= %(now)s",
                         {"key": key, "now": now_ms, **row.params()})

    def read(self, key: str, *, locking: bool) -> Statement:
        # MySQL's REPEATABLE READ answers a plain SELECT from the transaction's first snapshot,
        # which may predate the commit the insert waited for: a locking read sees the latest. A
        # shared lock, as the ignored insert already holds: copies waiting on the same row would
        # deadlock upgrading theirs to FOR UPDATE.
        lock = " LOCK IN SHARE MODE" if locking and self.mysql else ""
        return Statement(f"SELECT token, status, result, fingerprint, expires_at FROM {self.table} "
                         f"WHERE dedupe_key = %(key)s{lock}", {"key": key}, reads=True)

    def record(self, key: str, token: int, status: str, data: bytes | None) -> Statement:
        return Statement(f"UPDATE {self.table} SET status = %(status)s, result = %(result)s "
                         "WHERE dedupe_key = %(key)s AND token = %(token)s",
                         {"status": status, "result": data, "key": key, "token": token})

    def purge(self, now_ms: int, batch: int) -> Statement:
        if self.mysql:
            return Statement(f"DELETE FROM {self.table} WHERE expires_at <= %(now)s LIMIT {int(batch)}",
                             {"now": now_ms})
        return Statement(f"DELETE FROM {self.table} WHERE dedupe_key IN (SELECT dedupe_key FROM {self.table} "
                         f"WHERE expires_at <= %(now)s LIMIT {int(batch)})", {"now": now_ms})

    def columns(self) -> Statement:
        """A statement whose answer names the table's columns (no row read)."""
        return Statement(f"SELECT * FROM {self.table} WHERE 1 = 0", {}, reads=True)

    def add_fingerprint(self) -> Statement:
        """The upgrade of a table created before rows carried their fingerprint (an old row's
        empty fingerprint matches every payload, as a claim made without one does)."""
        exists = "" if self.name == "mysql" else "IF NOT EXISTS "  # MySQL 8 has no IF NOT EXISTS here
        charset = " CHARACTER SET utf8mb4 COLLATE utf8mb4_bin" if self.mysql else ""
        return Statement(f"ALTER TABLE {self.table} ADD COLUMN {exists}fingerprint "
                         f"VARCHAR({FINGERPRINT_COLUMN_LIMIT}){charset} NOT NULL DEFAULT ''", {})


def dialect_named(name: str, table: str) -> Dialect:
    """The :class:`Dialect` of a SQLAlchemy dialect or Django vendor name."""
    name = {"postgres": "postgresql", "psycopg": "postgresql"}.get(name, name)
    if name not in ("postgresql", "mysql", "mariadb"):
        raise ValueError(f"dedupe_worker.sql supports PostgreSQL and MySQL/MariaDB, not {name!r}")
    return Dialect(name, check_table(table))


def stored_key(stem: str) -> str:
    """The key column's value for a claim's stem: the stem, or its sha256 when too long."""
    if len(stem.encode("utf-8")) <= KEY_COLUMN_LIMIT:
        return stem
    namespace = stem[:stem.index(":{")]
    return f"{namespace}:sha256:{hashlib.sha256(stem.encode('utf-8')).hexdigest()}"


def now_ms() -> int:
    """The clock rows are written and compared with (epoch milliseconds): the worker's, as
    :meth:`~dedupe_worker.sql.SqlOutcomes.purge` reads it."""
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Row:
    """What a run writes into its key's row: its fencing token, its claim's fingerprint (``''``
    when the claim has none) and when the row expires (epoch milliseconds)."""

    token: int
    fingerprint: str
    expires_at: int

    def params(self) -> dict[str, Any]:
        return {"token": self.token, "fingerprint": self.fingerprint, "expires_at": self.expires_at}


def row_of(codec: ClaimCodec, claim: Claim, now: int) -> Row:
    """``claim``'s row written at ``now``: it expires after the claim's ``ttl`` (the message's own
    ttl), else after ``codec``'s ``result_ttl`` (the client that claimed it): as long as its
    Redis outcome."""
    return Row(claim.token, claim.fingerprint or "", now + codec.result_ttl_ms(claim.ttl))


def expired(row: Any, now: int) -> bool:
    """Whether a row read by :meth:`Dialect.read` is past its expiry: absent, as in Redis."""
    return int(row[4]) <= now


def conflicts(claim: Claim, row: Any) -> bool:
    """Whether a row read by :meth:`Dialect.read` was written for another payload: both
    fingerprints known and different, as ``claim.lua`` compares them."""
    return bool(claim.fingerprint) and bool(row[3]) and row[3] != claim.fingerprint


def recorded(codec: ClaimCodec, claim: Claim, row: Any) -> AlreadyApplied:
    """The :class:`AlreadyApplied` a committed row ``(token, status, result, ...)`` stands for."""
    token, status, data = row[0], row[1], row[2]
    if isinstance(data, memoryview):
        data = bytes(data)
    if status == Stored.OMITTED.value:
        result: Any = OMITTED
    elif status == Stored.COMPLETED.value and data is not None:
        try:
            result = codec.decode(data)
        except Exception:  # written by something else: still proof the work was done
            result = OMITTED
    else:  # completed with a NULL result: the outcome was None
        result = None
    return AlreadyApplied(claim.key, result, int(token))


def answer(codec: ClaimCodec, claim: Claim, row: Any) -> AlreadyApplied | KeyConflict:
    """What a committed, unexpired row answers ``claim``: :class:`KeyConflict` when it was written
    for another payload, else :class:`AlreadyApplied` with its outcome."""
    return KeyConflict(claim.key) if conflicts(claim, row) else recorded(codec, claim, row)


def enter(dialect: Dialect, codec: ClaimCodec, claim: Claim) -> Generator[Statement, Any, None]:
    """The entry steps: yields statements, is sent each one's answer (row count, or first row),
    returns when this run's row is inserted (or replaces an expired one) and raises
    :class:`AlreadyApplied` (or :class:`KeyConflict`) when an unexpired row is committed."""
    key = stored_key(claim.stem)
    for _ in range(3):
        now = now_ms()
        mine = row_of(codec, claim, now)
        if (yield dialect.insert(key, mine)):
            return
        row = yield dialect.read(key, locking=True)
        if row is None:
            continue  # the committed row was purged between the two statements: insert again
        if not expired(row, now):
            raise answer(codec, claim, row)
        if (yield dialect.replace(key, mine, now)):
            return
        # another run replaced the expired row first: read what it committed
    raise RuntimeError(f"could not insert nor read the outcome row of key={claim.key} token={claim.token}")


def leave(dialect: Dialect, codec: ClaimCodec, claim: Claim, value: Any) -> Statement | None:
    """The exit step: the statement that records ``value`` as this run's outcome, or ``None`` when
    the row as inserted already says it (``value`` is ``None``)."""
    if value is None:
        return None
    status, data, _ = codec.encode(claim, value)
    return dialect.record(stored_key(claim.stem), claim.token, status.value,
                          data if status is Stored.COMPLETED else None)
