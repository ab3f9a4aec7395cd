"""The documented pattern: fence downstream writes with the claim's token (PostgreSQL)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import redis

from dedupe_worker import Deduplicator, LeaseLost, Outcome, current_claim


@pytest.fixture
def account(postgres_dsn: str) -> Iterator[tuple[psycopg.Connection[tuple[object, ...]], str]]:
    table = f"accounts_{uuid.uuid4().hex[:8]}"
    conn = psycopg.connect(postgres_dsn, autocommit=True)
    conn.execute(f"CREATE TABLE {table} (id text PRIMARY KEY, balance int NOT NULL, fence bigint NOT NULL DEFAULT 0)")
    conn.execute(f"INSERT INTO {table} (id, balance) VALUES ('acc-1', 100)")
    yield conn, table
    conn.execute(f"DROP TABLE {table}")
    conn.close()


def fenced_write(conn: psycopg.Connection[tuple[object, ...]], table: str, balance: int) -> int:
    """The handler's write: applies only if no newer token has written this row."""
    claim = current_claim()
    assert claim is not None
    cur = conn.execute(
        f"UPDATE {table} SET balance = %s, fence = %s WHERE id = 'acc-1' AND fence < %s",
        (balance, claim.token, claim.token),
    )
    if cur.rowcount == 0:
        raise LeaseLost(claim.key, claim.token)
    return balance


def test_a_zombie_write_is_refused_by_the_database(
    account: tuple[psycopg.Connection[tuple[object, ...]], str], redis_client: redis.Redis, namespace: str
) -> None:
    conn, table = account
    d = Deduplicator(redis_client, namespace=namespace, lease=0.2, renew_interval=10)
    zombie = d.begin("debit-1")
    time.sleep(0.3)  # the zombie stalls past its lease ...
    successor = d.begin("debit-1")
    assert successor.outcome is Outcome.ACQUIRED and successor.token > zombie.token
    assert d.apply(successor, fenced_write, conn, table, 70) == 70  # ... a successor writes and completes
    with pytest.raises(LeaseLost):
        d.apply(zombie, fenced_write, conn, table, 40)  # ... then the zombie wakes and writes
    assert conn.execute(f"SELECT balance, fence FROM {table}").fetchone() == (70, successor.token)
    assert d.begin("debit-1").result == 70
