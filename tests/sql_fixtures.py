"""Fixtures for ``dedupe_worker.sql`` tests: an outcome table and an accounts table of the test's
own on real PostgreSQL and MariaDB, dropped afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dedupe_worker.sql import SqlOutcomes


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


class Tables:
    """Names of the test's tables and how to read the balance its handlers update."""

    def __init__(self, outcomes: SqlOutcomes, accounts: str) -> None:
        self.outcomes, self.accounts = outcomes, accounts


@pytest.fixture
def pg(postgres_dsn: str) -> Iterator[Tables]:
    outcomes = SqlOutcomes(postgres_dsn, table=unique("dedupe_outcome"))
    outcomes.create_table()
    accounts = unique("accounts")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {accounts} (id int PRIMARY KEY, balance bigint NOT NULL)")
        conn.execute(f"INSERT INTO {accounts} VALUES (1, 0)")
    yield Tables(outcomes, accounts)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {outcomes.table}")
        conn.execute(f"DROP TABLE IF EXISTS {accounts}")


def pg_balance(dsn: str, accounts: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT balance FROM {accounts} WHERE id = 1").fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture
def my(mysql_url: str) -> Iterator[tuple[Any, Tables]]:
    from sqlalchemy import create_engine, text

    engine = create_engine(mysql_url, pool_size=25)
    outcomes = SqlOutcomes(engine, table=unique("dedupe_outcome"))
    outcomes.create_table()
    accounts = unique("accounts")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {accounts} (id int PRIMARY KEY, balance bigint NOT NULL) ENGINE=InnoDB"))
        conn.execute(text(f"INSERT INTO {accounts} VALUES (1, 0)"))
    yield engine, Tables(outcomes, accounts)
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {outcomes.table}"))
        conn.execute(text(f"DROP TABLE IF EXISTS {accounts}"))
    engine.dispose()


class Database:
    """One database the tests run on (PostgreSQL through psycopg, MariaDB through SQLAlchemy):
    its :class:`SqlOutcomes`, a handler crediting the accounts table inside ``atomic()``, and
    reads of the balance and of a key's row."""

    def __init__(self, name: str, outcomes: SqlOutcomes, accounts: str, dsn: str, engine: Any = None) -> None:
        self.name, self.outcomes, self.accounts, self.dsn, self.engine = name, outcomes, accounts, dsn, engine

    def credit(self, amount: int, *, rollback: bool = False, isolation: str | None = None,
               pause: float = 0.0) -> Any:
        """The handler: ``UPDATE balance + amount`` and the outcome in one ``atomic()`` block;
        with ``rollback``, the block runs inside an outer transaction the caller then rolls back;
        ``isolation``: the transaction's isolation level; ``pause``: seconds the block waits
        before it commits (so that concurrent copies meet its uncommitted row)."""
        import time

        from dedupe_worker.sql import atomic

        update = f"UPDATE {self.accounts} SET balance = balance + {int(amount)} WHERE id = 1"
        if self.engine is None:
            with psycopg.connect(self.dsn) as conn:
                if isolation is not None:
                    conn.isolation_level = psycopg.IsolationLevel[isolation.replace(" ", "_")]
                if not rollback:
                    with atomic(conn) as outcome:
                        conn.execute(update)  # type: ignore[arg-type]
                        outcome.result = {"credited": amount}
                        time.sleep(pause)
                    return outcome.result
                with conn.transaction():  # the caller's own transaction, which it rolls back
                    with atomic(conn) as outcome:
                        conn.execute(update)  # type: ignore[arg-type]
                        outcome.result = {"credited": amount}
                    raise psycopg.Rollback
            return outcome.result
        from sqlalchemy import text

        with self.engine.connect() as conn:
            if isolation is not None:
                conn = conn.execution_options(isolation_level=isolation)
            outer = conn.begin() if rollback else None
            with atomic(conn) as outcome:
                conn.execute(text(update))
                outcome.result = {"credited": amount}
                time.sleep(pause)
            if outer is not None:
                outer.rollback()
        return outcome.result

    def balance(self) -> int:
        if self.engine is None:
            return pg_balance(self.dsn, self.accounts)
        from sqlalchemy import text

        with self.engine.connect() as conn:
            return int(conn.execute(text(f"SELECT balance FROM {self.accounts} WHERE id = 1")).scalar_one())

    def row(self, stem: str) -> tuple[Any, ...] | None:
        """``(token, status, fingerprint, expires_at)`` of the key with this stem, else ``None``."""
        from dedupe_worker.sql._statements import stored_key

        sql = f"SELECT token, status, fingerprint, expires_at FROM {self.outcomes.table} WHERE dedupe_key = %s"
        if self.engine is None:
            with psycopg.connect(self.dsn) as conn:
                return conn.execute(sql, (stored_key(stem),)).fetchone()  # type: ignore[arg-type]
        raw = self.engine.raw_connection()
        try:
            cur = raw.cursor()
            cur.execute(sql, (stored_key(stem),))
            found = cur.fetchone()
            return None if found is None else tuple(found)
        finally:
            raw.close()


def database(request: pytest.FixtureRequest, name: str) -> Database:
    """The :class:`Database` named ``name`` (``postgresql`` or ``mariadb``), with fresh tables."""
    if name == "postgresql":
        tables = request.getfixturevalue("pg")
        return Database(name, tables.outcomes, tables.accounts, request.getfixturevalue("postgres_dsn"))
    engine, tables = request.getfixturevalue("my")
    return Database(name, tables.outcomes, tables.accounts, "", engine)


@pytest.fixture(params=["postgresql", "mariadb"])
def db(request: pytest.FixtureRequest) -> Database:
    """Each test once on PostgreSQL and once on MariaDB."""
    return database(request, request.param)
