"""The soak's ledger in PostgreSQL: one account row per business operation, the append-only log
of every handler invocation, and the events the consumers' hooks report.

Tables are named after the run (``soak_<run>_accounts``, ``_invocations``, ``_events``) so runs
and engineers sharing the database never meet. The handler's write is the fenced update of docs/guarantees.md::

    UPDATE accounts SET balance = balance + :a, fence = :token WHERE id = :id AND fence < :token

preceded, in the same transaction, by ``SELECT fence ... FOR UPDATE``: a fence already set by a
*smaller* token means an earlier run's effect committed but its outcome never reached Redis (a
crash or a Redis outage between the handler and ``complete``), and the handler skips the write
instead of adding the amount again (docs/guarantees.md: "make such a write idempotent"). The fence alone
cannot tell that case apart: the re-run holds a *larger* token, so its write passes the fence.
``SOAK_WRITE=fenced`` (``--write fenced``) leaves the guard out to measure exactly that.

``SOAK_WRITE=plain`` (``--writes plain``) asks the handler for nothing: a plain, non-idempotent
``UPDATE accounts SET balance = balance + :amount`` inside :func:`dedupe_worker.sql._atomic`, whose
row in ``soak_<run>_outcomes`` (same transaction) makes the effect commit once; a re-run that finds
an earlier run's row committed gets :class:`~dedupe_worker.AlreadyApplied` and is logged as
``already_applied``.

Every invocation writes a ``started`` row before its work (autocommit: it survives a SIGKILL)
and, in the transaction of the write, one of ``applied`` / ``fenced`` (0 rows: a newer token wrote
first) / ``already_applied``.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any

import psycopg

__all__ = ["Ledger", "Operation", "apply_operation"]


@dataclass(frozen=True)
class Operation:
    """One business operation: ``charge <id> <amount>``, for one integration."""

    id: str
    integration: str
    amount: int


class Ledger:
    """The run's tables; ``create()`` makes them, ``drop()`` removes them."""

    def __init__(self, dsn: str, run: str) -> None:
        if not re.fullmatch(r"[a-z0-9_]+", run):
            raise ValueError(f"run id must be [a-z0-9_]+, got {run!r}")
        self.dsn, self.run = dsn, run
        self.accounts, self.invocations, self.events, self.outcomes = (
            f"soak_{run}_{t}" for t in ("accounts", "invocations", "events", "outcomes"))
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        return self._conn

    def create(self) -> None:
        self.conn.execute(
            f"CREATE TABLE {self.accounts} (id text PRIMARY KEY, integration text NOT NULL, amount int NOT NULL, "
            "balance int NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0, sends int NOT NULL DEFAULT 0, "
            "published_at double precision, applied_at double precision)")
        self.conn.execute(
            f"CREATE TABLE {self.invocations} (seq bigserial PRIMARY KEY, key text NOT NULL, token bigint NOT NULL, "
            "pid int NOT NULL, at double precision NOT NULL, phase text NOT NULL)")
        self.conn.execute(
            f"CREATE TABLE {self.events} (seq bigserial PRIMARY KEY, kind text NOT NULL, key text, pid int NOT NULL, "
            "at double precision NOT NULL, detail text)")

    def drop(self) -> None:
        for table in (self.accounts, self.invocations, self.events, self.outcomes):
            self.conn.execute(f"DROP TABLE IF EXISTS {table}")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def open_account(self, op: Operation) -> None:
        self.conn.execute(f"INSERT INTO {self.accounts} (id, integration, amount, published_at) "
                          "VALUES (%s, %s, %s, %s)", (op.id, op.integration, op.amount, time.time()))

    def count_send(self, op_id: str) -> None:
        self.conn.execute(f"UPDATE {self.accounts} SET sends = sends + 1 WHERE id = %s", (op_id,))

    def event(self, kind: str, key: str | None, detail: str = "") -> None:
        """Record what a consumer hook saw (``lease_lost``, ``dead_letter``)."""
        self.conn.execute(f"INSERT INTO {self.events} (kind, key, pid, at, detail) VALUES (%s, %s, %s, %s, %s)",
                          (kind, key, os.getpid(), time.time(), detail))

    def started(self, key: str, token: int) -> None:
        self.log(key, token, "started")

    def write(self, key: str, amount: int, token: int, idempotent: bool = True) -> str:
        """The fenced write, idempotent unless ``idempotent=False`` (the bare fenced increment);
        see the module docstring. Return the phase recorded."""
        with self.conn.transaction():
            row = self.conn.execute(f"SELECT fence FROM {self.accounts} WHERE id = %s FOR UPDATE",
                                    (key,)).fetchone()
            if row is None:
                raise LookupError(f"no account {key!r}")
            if idempotent and 0 < row[0] < token:
                phase = "already_applied"
            else:
                cur = self.conn.execute(
                    f"UPDATE {self.accounts} SET balance = balance + %s, fence = %s, applied_at = %s "
                    "WHERE id = %s AND fence < %s", (amount, token, time.time(), key, token))
                phase = "applied" if cur.rowcount == 1 else "fenced"
            self.log(key, token, phase)
        return phase

    def write_plain(self, key: str, amount: int, token: int) -> dict[str, Any]:
        """The plain increment inside ``atomic()`` (``SOAK_WRITE=plain``); return the outcome it
        committed. Raises :class:`~dedupe_worker.AlreadyApplied` (logged) when an earlier run of
        the key committed first."""
        from dedupe_worker import AlreadyApplied
        from dedupe_worker.sql import atomic

        try:
            with atomic(self.conn) as outcome:
                self.conn.execute(f"UPDATE {self.accounts} SET balance = balance + %s, fence = %s, applied_at = %s "
                                  "WHERE id = %s", (amount, token, time.time(), key))
                self.log(key, token, "applied")
                outcome.result = {"id": key, "phase": "applied", "token": token}
        except AlreadyApplied:
            self.log(key, token, "already_applied")
            raise
        return dict(outcome.result)

    def log(self, key: str, token: int, phase: str) -> None:
        self.conn.execute(f"INSERT INTO {self.invocations} (key, token, pid, at, phase) VALUES (%s, %s, %s, %s, %s)",
                          (key, token, os.getpid(), time.time(), phase))

    def busy(self, pids: tuple[int, ...]) -> bool:
        """Whether one of ``pids`` logged a handler start it has not finished yet."""
        row = self.conn.execute(f"SELECT phase FROM {self.invocations} WHERE pid = ANY(%s) ORDER BY seq DESC LIMIT 1",
                                (list(pids),)).fetchone()
        return row is not None and row[0] == "started"

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql.format(accounts=self.accounts, invocations=self.invocations, events=self.events),
                                 params).fetchall()


def apply_operation(ledger: Ledger, key: str, amount: int, token: int, work: float, idempotent: bool = True) -> str:
    """What every soak handler does: log the start, work ``work`` seconds, write the ledger."""
    ledger.started(key, token)
    time.sleep(work)
    return ledger.write(key, amount, token, idempotent)
