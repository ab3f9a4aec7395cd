""":class:`SqlOutcomes`: the table ``atomic()`` commits outcomes in, and what the engine reads back.

One row per key (its Redis stem), written only inside the handler's transaction by
:func:`~dedupe_worker.sql._atomic`. The engine reads a row (one query) only when a key is claimed
again after an earlier claim, to answer a re-run from the committed outcome without running the
handler, and when an ``atomic()`` block joined a transaction it did not open, to confirm that its
row committed before storing the outcome in Redis. Each row expires after the ttl of the
claim that wrote it (the message's own ``ttl``, else its client's ``result_ttl``); past it the row
is absent, as the Redis record is, and :meth:`SqlOutcomes.purge` deletes expired rows in bounded
batches (cron: ``dedupe-worker sql purge``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from importlib import resources
from typing import Any

from .._errors import AlreadyApplied
from .._extras import require
from .._protocol import Claim, ClaimCodec
from ._statements import (
    Dialect,
    Statement,
    check_table,
    conflicts,
    dialect_named,
    expired,
    now_ms,
    recorded,
    stored_key,
)

__all__ = ["SqlOutcomes", "attached", "ddl", "namespace_of", "register"]

log = logging.getLogger(__name__)

#: namespace -> (where ``atomic()`` records, the client's codec): how ``atomic()`` finds its table
#: from a claim. Where it records is a :class:`SqlOutcomes`, or the SQL store's recorder of the
#: claim's own row (any object with ``block(connection, codec)``; it registers itself here).
_attached: dict[str, tuple[Any, ClaimCodec]] = {}
_lock = threading.Lock()


def ddl(dialect: str, table: str = "dedupe_outcome") -> str:
    """The ``CREATE TABLE`` (and index) statements for ``dialect`` (``postgresql``, ``mysql``,
    ``mariadb``), from the files shipped in ``dedupe_worker/sql/ddl/`` (copy those into your
    migrations as they are)."""
    d = dialect_named(dialect, table)
    text = resources.files(__package__).joinpath("ddl", "mysql.sql" if d.mysql else "postgresql.sql").read_text()
    name = check_table(table)
    return text.replace("dedupe_outcome_expires_at", name.split(".")[-1] + "_expires_at").replace(
        "dedupe_outcome", name)


def _isolation(statement: Statement) -> dict[str, str]:
    """Reads in autocommit: one statement that sees the latest committed row, never a locking read
    (MySQL's SERIALIZABLE turns a SELECT inside a transaction into one, which would wait on a
    transaction of the handler's still open in this thread)."""
    return {"isolation_level": "AUTOCOMMIT"} if statement.reads else {}


def _upgraded_already(exc: Exception) -> None:
    """Re-raise ``exc`` unless it is MySQL's "Duplicate column name" (1060): the upgrade, which MySQL
    cannot write with ``IF NOT EXISTS``, was done before."""
    if "1060" not in str(exc):
        raise exc


def _statements(text: str) -> list[str]:
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return [part.strip() for part in body.split(";") if part.strip()]


class SqlOutcomes:
    """Outcomes committed in the handlers' own database, for ``Deduplicator(outcomes=...)``.

    :param target: a PostgreSQL DSN (``postgresql://...``, used through psycopg 3: one connection
        per thread, kept open), a SQLAlchemy
        URL with a driver (``mysql+pymysql://...``), or a SQLAlchemy ``Engine`` or ``AsyncEngine``
        (PostgreSQL, MySQL or MariaDB). Used by the engine's look-ups and by :meth:`create_table`
        and :meth:`purge`; ``atomic()`` uses the handler's own connection.
    :param table: the table's name (optionally ``schema.table``).
    """

    def __init__(self, target: Any, *, table: str = "dedupe_outcome") -> None:
        self.table = check_table(table)
        if isinstance(target, str) and "+" in target.split("://", 1)[0]:
            target = require("sqlalchemy", "sql").create_engine(target, pool_pre_ping=True)
        self.target = target
        self._codec: ClaimCodec | None = None
        self._held = threading.local()  # a DSN's connection per thread (_connection)

    def __repr__(self) -> str:
        return f"SqlOutcomes(table={self.table!r}, dialect={self.dialect!r})"

    # -- the client's side ----------------------------------------------------------------------

    def attach(self, client: ClaimCodec) -> None:
        """Called by a client given these outcomes: ``atomic()`` in a handler of that client's
        namespace records into this table, encoding results as that client does."""
        register(client.layout.namespace, self, client)
        self._codec = self._codec or client

    @property
    def dialect(self) -> str:
        """``postgresql``, ``mysql`` or ``mariadb``."""
        if isinstance(self.target, str):
            return "postgresql"
        engine = getattr(self.target, "sync_engine", self.target)
        return str(engine.dialect.name)

    def _sql(self) -> Dialect:
        return dialect_named(self.dialect, self.table)

    def _run(self, statement: Statement) -> Any:
        """Execute one statement in its own transaction; the first row or the row count."""
        if isinstance(self.target, str):
            conn = self._connection()
            try:
                cur = conn.execute(statement.sql, statement.params)
            except require("psycopg", "sql").OperationalError:
                self._held.conn = None  # broken: the next statement connects again
                conn.close()
                raise
            return cur.fetchone() if statement.reads else cur.rowcount
        if hasattr(self.target, "sync_engine"):
            raise TypeError("this SqlOutcomes has an AsyncEngine: use its asyncio methods (lookup_async)")
        from sqlalchemy import text

        from ._drivers import _named

        with self.target.connect() as conn:
            with conn.execution_options(**_isolation(statement)).begin():
                result = conn.execute(text(_named(statement.sql)), statement.params)
                return result.first() if statement.reads else result.rowcount

    def _connection(self) -> Any:
        """This thread's autocommit psycopg connection to the DSN, opened on first use (again in a
        forked child, which must not share its parent's socket): a look-up costs one query, not a
        connection."""
        held = self._held
        if getattr(held, "conn", None) is None or held.conn.closed or held.pid != os.getpid():
            held.conn, held.pid = require("psycopg", "sql").connect(self.target, autocommit=True), os.getpid()
        return held.conn

    async def _run_async(self, statement: Statement) -> Any:
        if isinstance(self.target, str):
            psycopg = require("psycopg", "sql")
            async with await psycopg.AsyncConnection.connect(self.target, autocommit=True) as conn:
                cur = await conn.execute(statement.sql, statement.params)
                return await cur.fetchone() if statement.reads else cur.rowcount
        if not hasattr(self.target, "sync_engine"):
            return self._run(statement)  # a sync Engine: a short blocking query
        from sqlalchemy import text

        from ._drivers import _named

        async with self.target.connect() as conn:
            await conn.execution_options(**_isolation(statement))
            async with conn.begin():
                result = await conn.execute(text(_named(statement.sql)), statement.params)
                return result.first() if statement.reads else result.rowcount

    def _found(self, claim: Claim, row: Any) -> AlreadyApplied | None:
        # an expired row is absent; one of another payload is answered by atomic() (KeyConflict)
        if row is None or expired(row, now_ms()) or conflicts(claim, row):
            return None
        return recorded(self._codec_for(claim), claim, row)

    def _codec_for(self, claim: Claim) -> ClaimCodec:
        return attached(claim, self)[1]

    def lookup(self, claim: Claim) -> AlreadyApplied | None:
        """The committed outcome of ``claim``'s key as an :class:`AlreadyApplied`, else ``None``
        (one query, outside any handler transaction)."""
        return self._found(claim, self._run(self._sql().read(stored_key(claim.stem), locking=False)))

    async def lookup_async(self, claim: Claim) -> AlreadyApplied | None:
        """:meth:`lookup` on asyncio."""
        return self._found(claim, await self._run_async(self._sql().read(stored_key(claim.stem), locking=False)))

    def committed(self, claim: Claim) -> bool:
        """Whether ``claim``'s own row (its fencing token) is committed: one query, outside any
        transaction of the handler's, after an ``atomic()`` block that joined one returned."""
        return self._mine(claim, self._run(self._sql().read(stored_key(claim.stem), locking=False)))

    async def committed_async(self, claim: Claim) -> bool:
        """:meth:`committed` on asyncio."""
        return self._mine(claim, await self._run_async(self._sql().read(stored_key(claim.stem), locking=False)))

    @staticmethod
    def _mine(claim: Claim, row: Any) -> bool:
        # an expired row of the same token is an older run's (Redis lost the key's counter), left
        # in place because the replacement of it rolled back
        return (row is not None and int(row[0]) == claim.token and not expired(row, now_ms())
                and (row[3] or "") == (claim.fingerprint or ""))

    # -- operations -----------------------------------------------------------------------------

    def create_table(self) -> None:
        """Create the table and its index if missing, and upgrade a table created by an earlier
        release (``dedupe-worker sql init``; see :meth:`_upgrade`)."""
        for sql in _statements(ddl(self.dialect, self.table)):
            self._run(Statement(sql, {}))
        try:
            self._run(self._sql().add_fingerprint())
        except Exception as exc:
            _upgraded_already(exc)
        log.info("outcome table %s ready (%s)", self.table, self.dialect)

    async def create_table_async(self) -> None:
        """:meth:`create_table` on asyncio (for an ``AsyncEngine``)."""
        for sql in _statements(ddl(self.dialect, self.table)):
            await self._run_async(Statement(sql, {}))
        try:
            await self._run_async(self._sql().add_fingerprint())
        except Exception as exc:
            _upgraded_already(exc)

    def purge(self, *, batch: int = 1000, now: float | None = None) -> int:
        """Delete rows past their ttl, ``batch`` rows per statement (each its own short
        transaction) until none is left; return how many were deleted. Safe to run from cron
        while workers run: a key's row is only deleted once its ``result_ttl`` (or its message's
        ``ttl``) passed."""
        now_ms = int((time.time() if now is None else now) * 1000)
        total = 0
        while True:
            deleted = int(self._run(self._sql().purge(now_ms, batch)))
            total += deleted
            if deleted < batch:
                break
        if total:
            log.info("purged %d expired outcome row(s) from %s", total, self.table)
        return total

    async def purge_async(self, *, batch: int = 1000, now: float | None = None) -> int:
        """:meth:`purge` on asyncio."""
        now_ms = int((time.time() if now is None else now) * 1000)
        total = 0
        while True:
            deleted = int(await self._run_async(self._sql().purge(now_ms, batch)))
            total += deleted
            if deleted < batch:
                return total


def namespace_of(stem: str) -> str:
    """The namespace of a claim's stem (``<namespace>:{<key>}``)."""
    return stem[:stem.index(":{")] if ":{" in stem else ""


def register(namespace: str, recorder: Any, codec: ClaimCodec) -> None:
    """``atomic()`` in a handler of ``namespace`` records with ``recorder``, encoding as ``codec``."""
    with _lock:
        _attached[namespace] = (recorder, codec)


def attached(claim: Claim, outcomes: SqlOutcomes | None = None) -> tuple[Any, ClaimCodec]:
    """The outcomes (``outcomes``, else those of the client of ``claim``'s namespace) and the codec
    that encodes ``claim``'s results. Raises ``RuntimeError`` when no client was given outcomes."""
    namespace = namespace_of(claim.stem)
    found = _attached.get(namespace)
    if outcomes is None:
        if found is None:
            raise RuntimeError(f"no SqlOutcomes for namespace {namespace!r}: give the Deduplicator "
                               "outcomes=SqlOutcomes(...) (or DEDUPE_SQL_DSN), or pass atomic(conn, outcomes=...)")
        return found
    if found is not None:
        return outcomes, found[1]
    if outcomes._codec is None:
        raise RuntimeError("this SqlOutcomes is not attached to a client: give it to a Deduplicator first")
    return outcomes, outcomes._codec
