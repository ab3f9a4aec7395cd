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
