"""SQL rows mean what Redis means, on real PostgreSQL and MariaDB with a real Redis (issue 36):
a row past its expiry is absent, a row of another payload is a conflict, each row's expiry is the
claim's that wrote it, and an outcome is stored only for an effect that committed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from dedupe_worker import Deduplicator, KeyConflict, Reason, decide, decide_many
from dedupe_worker.sql import NotCommitted, SqlOutcomes

from .sql_fixtures import Database, db, my, pg

__all__ = ["db", "my", "pg"]  # fixtures used by name


@pytest.fixture
def dedupe(redis_client: redis.Redis, namespace: str, db: Database) -> Iterator[Deduplicator]:
    d = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0, outcomes=db.outcomes)
    yield d
    d.close()


def wait_past(seconds: float) -> None:
    time.sleep(seconds + 0.15)


def test_after_the_ttl_the_key_applies_again_with_any_payload(dedupe: Deduplicator, db: Database) -> None:
    asked = [10, 10, 25]
    for n, amount in enumerate(asked):
        decision = decide(dedupe, "acct", lambda a=amount: db.credit(a), fingerprint={"amount": amount}, ttl=0.5)
        assert decision.reason is Reason.APPLIED and decision.value == {"credited": amount}
        assert dedupe.run("acct", db.credit, amount, fingerprint={"amount": amount}) == {"credited": amount}
        if n < len(asked) - 1:
            wait_past(0.5)  # Redis forgets the outcome, and the row expires with it
            assert dedupe.status("acct").state == "free"
    assert db.balance() == 10 + 10 + 25
    token, status, fingerprint, _ = db.row(dedupe.request("acct").stem)  # type: ignore[misc]
    assert status == "c" and fingerprint == dedupe.request("acct", {"amount": 25}).fingerprint and token >= 3


def test_within_the_ttl_another_payload_is_a_conflict_even_when_redis_forgot(dedupe: Deduplicator,
                                                                              db: Database) -> None:
    assert dedupe.run("acct", db.credit, 10, fingerprint={"amount": 10}, ttl=60) == {"credited": 10}
    with pytest.raises(KeyConflict):  # Redis answers
        dedupe.run("acct", db.credit, 25, fingerprint={"amount": 25})
    dedupe.forget("acct")  # Redis loses the key: the row answers, as Redis did
    decision = decide(dedupe, "acct", lambda: db.credit(25), fingerprint={"amount": 25})
    assert decision.reason is Reason.CONFLICT and isinstance(decision.error, KeyConflict)
    assert dedupe.status("acct").state == "free"  # refused without a record, as Redis refuses
    again = decide(dedupe, "acct", lambda: db.credit(10), fingerprint={"amount": 10})
    assert again.reason is Reason.DUPLICATE and again.value == {"credited": 10}
    assert db.balance() == 10


@pytest.mark.parametrize("short_first", [True, False], ids=["short-first", "long-first"])
def test_deduplicators_sharing_outcomes_each_write_their_own_expiry(redis_client: redis.Redis, namespace: str,
                                                                   db: Database, short_first: bool) -> None:
    def build(result_ttl: float) -> Deduplicator:
        return Deduplicator(redis_client, namespace=namespace, result_ttl=result_ttl, outcomes=db.outcomes)

    if short_first:
        short, long = build(1), build(3600)
    else:
        long, short = build(3600), build(1)
    began = time.time() * 1000
    short.run("short-key", db.credit, 1)
    long.run("long-key", db.credit, 2)
    long.run("own-ttl", db.credit, 4, ttl=20)  # a message's own ttl wins over the client's
    ended = time.time() * 1000
    for key, ttl_ms in (("short-key", 1000), ("long-key", 3_600_000), ("own-ttl", 20_000)):
        row = db.row(short.request(key).stem)
        assert row is not None and began + ttl_ms <= row[3] <= ended + ttl_ms, (key, row)
    assert db.outcomes.purge(now=time.time() + 5) == 1  # the short row only
    assert db.row(short.request("short-key").stem) is None
    assert db.row(short.request("long-key").stem) is not None  # still protected: not purged early
    long.forget("long-key")  # Redis loses it: the row answers
    assert decide(long, "long-key", lambda: db.credit(2)).reason is Reason.DUPLICATE
    assert db.balance() == 1 + 2 + 4
    short.close()
    long.close()


def test_a_rolled_back_outer_transaction_stores_nothing_and_the_redelivery_applies_once(
        dedupe: Deduplicator, db: Database) -> None:
    with pytest.raises(NotCommitted):
        dedupe.run("order", db.credit, 5, rollback=True)
    assert db.balance() == 0 and db.row(dedupe.request("order").stem) is None
    assert dedupe.status("order").state == "free"  # released, not "done"
    decision = decide(dedupe, "order", lambda: db.credit(5))  # the redelivery
    assert decision.reason is Reason.APPLIED and decision.value == {"credited": 5}
    assert decide(dedupe, "order", lambda: db.credit(5)).reason is Reason.DUPLICATE
    assert db.balance() == 5


def test_a_rolled_back_outer_transaction_is_never_stored_as_a_permanent_failure(
        redis_client: redis.Redis, namespace: str, db: Database) -> None:
    """NotCommitted says nothing committed: even where ``permanent_errors`` would take it, the
    claim is released (no failure stored for work that did not commit) and the redelivery runs."""
    dedupe = Deduplicator(redis_client, namespace=namespace, outcomes=db.outcomes, permanent_errors=(Exception,))
    decision = decide(dedupe, "order", lambda: db.credit(5, rollback=True))
    assert decision.reason is Reason.HANDLER_ERROR and isinstance(decision.error, NotCommitted)
    assert dedupe.status("order").state == "free"
    assert decide(dedupe, "order", lambda: db.credit(5)).reason is Reason.APPLIED
    assert db.balance() == 5
    dedupe.close()


def test_the_batch_engine_stores_only_what_committed(dedupe: Deduplicator, db: Database) -> None:
    def item(key: str, rollback: bool) -> tuple[str, Any, Any]:
        return key, None, lambda: db.credit(1, rollback=rollback)

    first = decide_many(dedupe, [item("a", False), item("b", True), item("c", False)])
    assert [d.reason for d in first] == [Reason.APPLIED, Reason.HANDLER_ERROR, Reason.APPLIED]
    assert isinstance(first[1].error, NotCommitted) and dedupe.status("b").state == "free"
    again = decide_many(dedupe, [item("a", False), item("b", False), item("c", False)])
    assert [d.reason for d in again] == [Reason.DUPLICATE, Reason.APPLIED, Reason.DUPLICATE]
    assert db.balance() == 3


class CountingOutcomes(SqlOutcomes):
    """SqlOutcomes that count the engine's commit confirmations."""

    confirmations = 0

    def committed(self, claim: Any) -> bool:
        self.confirmations += 1
        return super().committed(claim)


def test_only_a_block_that_joined_a_transaction_costs_a_confirmation(redis_client: redis.Redis, namespace: str,
                                                                     db: Database) -> None:
    outcomes = CountingOutcomes(db.engine or db.dsn, table=db.outcomes.table)
    dedupe = Deduplicator(redis_client, namespace=namespace, outcomes=outcomes)
    dedupe.run("own", db.credit, 1)  # the block's own transaction: committed at its exit
    assert outcomes.confirmations == 0
    with pytest.raises(NotCommitted):
        dedupe.run("joined", db.credit, 1, rollback=True)
    assert outcomes.confirmations == 1
    dedupe.close()


def test_create_table_upgrades_a_table_without_fingerprints(redis_client: redis.Redis, namespace: str,
                                                            db: Database) -> None:
    from dedupe_worker.sql import ddl
    from dedupe_worker.sql._statements import Statement

    old = SqlOutcomes(db.engine or db.dsn, table=db.outcomes.table + "_old")
    # the table as 0.1.0 created it: today's DDL without its fingerprint column
    body = "\n".join(line for line in ddl(old.dialect, old.table).splitlines()
                     if "fingerprint" not in line and not line.lstrip().startswith("--"))
    for sql in filter(str.strip, body.split(";")):
        old._run(Statement(sql, {}))
    try:
        old.create_table()
        old.create_table()  # twice: already upgraded
        dedupe = Deduplicator(redis_client, namespace=namespace, outcomes=old)
        assert dedupe.run("k", db.credit, 3, fingerprint="a") == {"credited": 3}
        dedupe.forget("k")
        assert decide(dedupe, "k", lambda: db.credit(3), fingerprint="b").reason is Reason.CONFLICT
        assert db.balance() == 3
        dedupe.close()
    finally:
        old._run(Statement(f"DROP TABLE IF EXISTS {old.table}", {}))


def test_any_text_fingerprint_is_kept_and_compared_exactly(dedupe: Deduplicator, db: Database) -> None:
    assert dedupe.run("k", db.credit, 1, fingerprint="Åsa-日本") == {"credited": 1}
    row = db.row(dedupe.request("k").stem)
    assert row is not None and row[2] == "Åsa-日本"
    dedupe.forget("k")
    assert decide(dedupe, "k", lambda: db.credit(1), fingerprint="åsa-日本").reason is Reason.CONFLICT  # case counts
    assert decide(dedupe, "k", lambda: db.credit(1), fingerprint="Åsa-日本").reason is Reason.DUPLICATE
    assert db.balance() == 1
