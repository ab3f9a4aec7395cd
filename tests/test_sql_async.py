"""``async with atomic(...)`` on PostgreSQL with :class:`AsyncDeduplicator`: psycopg's
``AsyncConnection`` and SQLAlchemy's ``AsyncSession`` and ``AsyncConnection``."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
import redis
import redis.asyncio

from dedupe_worker import Reason
from dedupe_worker.asyncio import AsyncDeduplicator, decide
from dedupe_worker.sql import SqlOutcomes, atomic

from .async_fixtures import aredis
from .services import RedisServer, free_port
from .sql_fixtures import Tables, pg, pg_balance

__all__ = ["aredis", "pg"]  # fixtures used by name

pytestmark = pytest.mark.asyncio


def async_url(dsn: str) -> str:
    return dsn.replace("postgresql://", "postgresql+psycopg://")


async def credit(driver: str, dsn: str, accounts: str, amount: int, runs: list[int]) -> Any:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    runs.append(amount)
    update = f"UPDATE {accounts} SET balance = balance + {int(amount)} WHERE id = 1"
    if driver == "psycopg":
        async with await psycopg.AsyncConnection.connect(dsn) as conn, atomic(conn) as outcome:
            await conn.execute(update)  # type: ignore[arg-type]
            outcome.result = {"credited": amount}
        return outcome.result
    engine = create_async_engine(async_url(dsn))
    try:
        if driver == "sqlalchemy-session":
            async with AsyncSession(engine) as session, atomic(session) as outcome:
                await session.execute(text(update))
                outcome.result = {"credited": amount}
        else:
            async with engine.connect() as conn, atomic(conn) as outcome:
                await conn.execute(text(update))
                outcome.result = {"credited": amount}
    finally:
        await engine.dispose()
    return outcome.result


@pytest.mark.parametrize("driver", ["psycopg", "sqlalchemy-session", "sqlalchemy-connection"])
async def test_async_redis_losing_every_record_applies_nothing_again(
        driver: str, private_redis: RedisServer, namespace: str, pg: Tables, postgres_dsn: str) -> None:
    client = redis.asyncio.Redis.from_url(private_redis.url)
    dedupe = AsyncDeduplicator(client, namespace=namespace, outcomes=pg.outcomes)
    runs: list[int] = []
    assert await dedupe.run("a1", credit, driver, postgres_dsn, pg.accounts, 6, runs) == {"credited": 6}
    await client.flushall()
    decision = await decide(dedupe, "a1", lambda: credit(driver, postgres_dsn, pg.accounts, 6, runs))
    assert decision.reason is Reason.DUPLICATE and decision.value == {"credited": 6}
    assert runs == [6, 6] and pg_balance(postgres_dsn, pg.accounts) == 6
    assert (await dedupe.status("a1")).state == "done"
    await dedupe.aclose()
    await client.aclose()


async def test_async_a_reclaim_after_a_crash_is_answered_from_the_row(
        aredis: redis.asyncio.Redis, namespace: str, pg: Tables, postgres_dsn: str) -> None:
    dedupe = AsyncDeduplicator(aredis, namespace=namespace, lease=0.3, renew_interval=60,
                               outcomes=pg.outcomes)
    runs: list[int] = []
    claim = await dedupe.begin("a2")
    with dedupe.hold(claim):
        await credit("psycopg", postgres_dsn, pg.accounts, 2, runs)  # committed; dies before complete()
    await asyncio.sleep(0.4)
    decision = await decide(dedupe, "a2", lambda: credit("psycopg", postgres_dsn, pg.accounts, 2, runs))
    assert decision.reason is Reason.DUPLICATE and decision.value == {"credited": 2}
    assert runs == [2] and pg_balance(postgres_dsn, pg.accounts) == 2
    await dedupe.aclose()


async def test_async_fail_open_twenty_concurrent_copies_apply_once(namespace: str, pg: Tables,
                                                                   postgres_dsn: str) -> None:
    down = redis.asyncio.Redis(port=free_port(), socket_connect_timeout=0.2, socket_timeout=0.2)
    dedupe = AsyncDeduplicator(down, namespace=namespace, fail_open=True, outcomes=pg.outcomes)
    answers = await asyncio.gather(*(dedupe.run("a3", credit, "psycopg", postgres_dsn, pg.accounts, 1, [])
                                     for _ in range(20)))
    assert answers == [{"credited": 1}] * 20
    assert pg_balance(postgres_dsn, pg.accounts) == 1
    await dedupe.aclose()


async def test_async_lookups_through_an_async_engine(aredis: redis.asyncio.Redis, namespace: str,
                                                     pg: Tables, postgres_dsn: str) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(async_url(postgres_dsn))
    outcomes = SqlOutcomes(engine, table=pg.outcomes.table)
    dedupe = AsyncDeduplicator(aredis, namespace=namespace, lease=0.3, renew_interval=60, outcomes=outcomes)
    runs: list[int] = []
    claim = await dedupe.begin("a4")
    with dedupe.hold(claim):
        await credit("sqlalchemy-session", postgres_dsn, pg.accounts, 4, runs)
    await asyncio.sleep(0.4)
    decision = await decide(dedupe, "a4", lambda: credit("psycopg", postgres_dsn, pg.accounts, 4, runs))
    assert decision.reason is Reason.DUPLICATE and runs == [4]
    assert await outcomes.purge_async(now=1e12) == 1
    await dedupe.aclose()
    await engine.dispose()


@pytest.mark.parametrize("driver", ["psycopg", "sqlalchemy-session"])
async def test_async_a_rolled_back_outer_transaction_stores_nothing_and_runs_again(
        driver: str, aredis: redis.asyncio.Redis, namespace: str, pg: Tables, postgres_dsn: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from dedupe_worker.sql import NotCommitted

    engine = create_async_engine(async_url(postgres_dsn))
    outcomes = SqlOutcomes(engine if driver != "psycopg" else postgres_dsn, table=pg.outcomes.table)
    dedupe = AsyncDeduplicator(aredis, namespace=namespace, outcomes=outcomes)
    update = f"UPDATE {pg.accounts} SET balance = balance + 8 WHERE id = 1"

    async def rolled_back() -> Any:
        if driver == "psycopg":
            async with await psycopg.AsyncConnection.connect(postgres_dsn) as conn:
                async with conn.transaction():  # the caller's own, rolled back
                    async with atomic(conn) as outcome:
                        await conn.execute(update)  # type: ignore[arg-type]
                        outcome.result = {"credited": 8}
                    raise psycopg.Rollback
        else:
            async with AsyncSession(engine) as session:
                await session.begin()
                async with atomic(session) as outcome:
                    await session.execute(text(update))
                    outcome.result = {"credited": 8}
                await session.rollback()
        return outcome.result

    with pytest.raises(NotCommitted):
        await dedupe.run("a5", rolled_back)
    assert pg_balance(postgres_dsn, pg.accounts) == 0 and (await dedupe.status("a5")).state == "free"
    runs: list[int] = []
    assert await dedupe.run("a5", credit, "psycopg", postgres_dsn, pg.accounts, 8, runs) == {"credited": 8}
    assert await dedupe.run("a5", credit, "psycopg", postgres_dsn, pg.accounts, 8, runs) == {"credited": 8}
    assert runs == [8] and pg_balance(postgres_dsn, pg.accounts) == 8
    await dedupe.aclose()
    await engine.dispose()


async def test_async_an_expired_row_is_absent(aredis: redis.asyncio.Redis, namespace: str, pg: Tables,
                                              postgres_dsn: str) -> None:
    dedupe = AsyncDeduplicator(aredis, namespace=namespace, outcomes=pg.outcomes)
    runs: list[int] = []
    for amount in (10, 10, 25):
        assert await dedupe.run("a6", credit, "psycopg", postgres_dsn, pg.accounts, amount, runs,
                                ttl=0.4) == {"credited": amount}
        await asyncio.sleep(0.55)  # the outcome and the row expire together
    assert runs == [10, 10, 25] and pg_balance(postgres_dsn, pg.accounts) == 45
    await dedupe.aclose()
