"""``atomic(conn)`` on the SQL store's own database: the effect and the key's outcome commit in the
handler's transaction, on the claim's row (no outcome table)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psycopg
import pytest

from dedupe_worker import Deduplicator, LeaseLost, Reason, current_claim, decide_many
from dedupe_worker.sql import NotCommitted, atomic

from .store_fixtures import postgres_store


@pytest.fixture
def pg_url(postgres_dsn: str) -> Iterator[str]:
    for url in postgres_store(postgres_dsn):
        with psycopg.connect(_conninfo(url), autocommit=True) as conn:
            conn.execute("CREATE TABLE ledger (key text NOT NULL, token bigint NOT NULL)")
        yield url


def _conninfo(url: str) -> str:
    return "postgresql://" + url.split("://", 1)[1]


def ledger(url: str) -> list[tuple[str, int]]:
    with psycopg.connect(_conninfo(url)) as conn:
        return [(k, int(t)) for k, t in conn.execute("SELECT key, token FROM ledger ORDER BY token").fetchall()]


def book(url: str, key: str) -> dict[str, object]:
    """A handler: the ledger row and the outcome, one transaction."""
    claim = current_claim()
    assert claim is not None
    with psycopg.connect(_conninfo(url)) as conn, atomic(conn) as outcome:
        conn.execute("INSERT INTO ledger VALUES (%s, %s)", (key, claim.token))
        outcome.result = {"booked": key, "token": claim.token}
    return outcome.result  # type: ignore[return-value]


def test_the_effect_and_the_outcome_commit_together_on_the_claims_row(pg_url: str) -> None:
    dedupe = Deduplicator.from_url(pg_url, lease=5)
    first = dedupe.run("pay-1", book, pg_url, "pay-1")
    assert dedupe.run("pay-1", book, pg_url, "pay-1") == first
    assert ledger(pg_url) == [("pay-1", first["token"])]
    with psycopg.connect(_conninfo(pg_url)) as conn:  # the outcome is on the claim's own row
        assert conn.execute("SELECT status, token FROM dedupe_claims WHERE stem = %s",
                            (b"dedupe:{pay-1}",)).fetchone() == ("c", first["token"])
    dedupe.close()


def test_a_failing_block_commits_nothing_and_the_key_runs_again(pg_url: str) -> None:
    dedupe = Deduplicator.from_url(pg_url, lease=5)

    def fails() -> None:
        with psycopg.connect(_conninfo(pg_url)) as conn, atomic(conn):
            conn.execute("INSERT INTO ledger VALUES ('broken', 0)")
            raise RuntimeError("after the write")

    with pytest.raises(RuntimeError):
        dedupe.run("broken", fails)
    assert ledger(pg_url) == []
    assert dedupe.run("broken", book, pg_url, "broken")["booked"] == "broken"
    dedupe.close()


def test_a_zombie_past_its_lease_commits_nothing(pg_url: str) -> None:
    zombie = Deduplicator.from_url(pg_url, lease=0.2, renew_interval=60)
    successor = Deduplicator.from_url(pg_url, lease=5)
    old = zombie.begin("late")
    time.sleep(0.3)
    new = successor.begin("late")
    with zombie.hold(old), pytest.raises(LeaseLost):
        book(pg_url, "late")
    assert ledger(pg_url) == []
    successor.complete(new, "done")
    zombie.close()
    successor.close()


def book_in_outer(url: str, key: str, rollback: bool) -> dict[str, object]:
    """A handler whose ``atomic()`` block joins the caller's own transaction, which the caller
    then rolls back (``rollback``) or commits."""
    claim = current_claim()
    assert claim is not None
    with psycopg.connect(_conninfo(url)) as conn:
        with conn.transaction():
            with atomic(conn) as outcome:
                conn.execute("INSERT INTO ledger VALUES (%s, %s)", (key, claim.token))
                outcome.result = {"booked": key, "token": claim.token}
            if rollback:
                raise psycopg.Rollback
    return outcome.result  # type: ignore[return-value]


def test_an_outer_transaction_rolled_back_stores_no_outcome_and_the_redelivery_applies(pg_url: str) -> None:
    dedupe = Deduplicator.from_url(pg_url, lease=5)
    with pytest.raises(NotCommitted):  # the handler returned, its effect did not commit
        dedupe.run("outer", book_in_outer, pg_url, "outer", True)
    assert ledger(pg_url) == [] and dedupe.status("outer").state == "free"  # released, no outcome
    first = dedupe.run("outer", book_in_outer, pg_url, "outer", False)  # the redelivery applies
    assert dedupe.run("outer", book_in_outer, pg_url, "outer", False) == first
    assert ledger(pg_url) == [("outer", first["token"])]

    keys = ["b1", "b2", "b1"]  # the batch engine: a rolled-back key is released, the other stored
    decisions = decide_many(dedupe, [(k, None, lambda k=k: book_in_outer(pg_url, k, k == "b1")) for k in keys])
    assert [d.reason for d in decisions] == [Reason.HANDLER_ERROR, Reason.APPLIED, Reason.IN_PROGRESS]
    assert isinstance(decisions[0].error, NotCommitted) and dedupe.status("b1").state == "free"
    assert [k for k, _ in ledger(pg_url)] == ["outer", "b2"]
    dedupe.close()


_KILLED = """
import os, signal, sys
import psycopg
from dedupe_worker import Deduplicator, current_claim
from dedupe_worker.sql import atomic
url = sys.argv[1]
def handler():
    with psycopg.connect("postgresql://" + url.split("://", 1)[1]) as conn, atomic(conn) as outcome:
        conn.execute("INSERT INTO ledger VALUES ('killed', %s)", (current_claim().token,))
        outcome.result = {"booked": "killed"}
    os.kill(os.getpid(), signal.SIGKILL)  # right after the block committed, before complete()
Deduplicator.from_url(url, lease=30).run("killed", handler)
"""


def test_killed_right_after_the_block_commits_the_redelivery_is_answered_from_the_row(pg_url: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _KILLED, pg_url], env={**os.environ, "PYTHONPATH": os.getcwd()},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    dedupe = Deduplicator.from_url(pg_url, lease=5)
    ran: list[int] = []
    assert dedupe.run("killed", lambda: ran.append(1)) == {"booked": "killed"}
    assert ran == [] and [k for k, _ in ledger(pg_url)] == ["killed"]
    dedupe.close()


def test_async_with_atomic_on_the_store_s_row(pg_url: str) -> None:
    import asyncio

    from dedupe_worker.asyncio import AsyncDeduplicator

    async def main() -> None:
        dedupe = AsyncDeduplicator.from_url(pg_url, lease=5)

        async def handler() -> str:
            async with await psycopg.AsyncConnection.connect(_conninfo(pg_url)) as conn, atomic(conn) as outcome:
                await conn.execute("INSERT INTO ledger VALUES ('async', 1)")
                outcome.result = "booked"
            return str(outcome.result)

        try:
            assert [await dedupe.run("async", handler) for _ in range(2)] == ["booked", "booked"]
        finally:
            await dedupe.aclose()

    asyncio.run(main())
    assert ledger(pg_url) == [("async", 1)]


def test_async_an_outer_transaction_rolled_back_releases_the_claim(pg_url: str) -> None:
    import asyncio

    from dedupe_worker.asyncio import AsyncDeduplicator

    async def handler(rollback: bool) -> str:
        async with await psycopg.AsyncConnection.connect(_conninfo(pg_url)) as conn:
            async with conn.transaction():
                async with atomic(conn) as outcome:
                    await conn.execute("INSERT INTO ledger VALUES ('async-outer', 1)")
                    outcome.result = "booked"
                if rollback:
                    raise psycopg.Rollback
        return str(outcome.result)

    async def main() -> None:
        dedupe = AsyncDeduplicator.from_url(pg_url, lease=5)
        try:
            with pytest.raises(NotCommitted):
                await dedupe.run("async-outer", handler, True)
            assert (await dedupe.status("async-outer")).state == "free"
            assert [await dedupe.run("async-outer", handler, False) for _ in range(2)] == ["booked", "booked"]
        finally:
            await dedupe.aclose()

    asyncio.run(main())
    assert ledger(pg_url) == [("async-outer", 1)]
