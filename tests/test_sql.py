"""``dedupe_worker.sql`` on real PostgreSQL: ``atomic()`` commits a key's effect once, whatever
Redis remembers, whoever runs it (a redelivery, a zombie, copies run under ``fail_open``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis

from dedupe_worker import AlreadyApplied, Deduplicator, LeaseLost, Reason, decide
from dedupe_worker.sql import SqlOutcomes, atomic, ddl
from dedupe_worker.sql._statements import stored_key

from .services import RedisServer, free_port
from .sql_fixtures import Tables, pg, pg_balance

__all__ = ["pg"]  # fixtures used by name


@pytest.fixture
def dedupe(redis_client: redis.Redis, namespace: str, pg: Tables) -> Iterator[Deduplicator]:
    d = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0, outcomes=pg.outcomes)
    yield d
    d.close()


def credit(dsn: str, accounts: str, amount: int, runs: list[int]) -> Any:
    """The handler: a plain, non-idempotent UPDATE inside atomic()."""
    runs.append(amount)
    with psycopg.connect(dsn) as conn, atomic(conn) as outcome:
        conn.execute(f"UPDATE {accounts} SET balance = balance + %s WHERE id = 1", (amount,))
        outcome.result = {"credited": amount, "run": len(runs)}
    return outcome.result


def row(dsn: str, table: str, stem: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT token, status, result FROM {table} WHERE dedupe_key = %s",
                            (stored_key(stem),)).fetchone()


def test_atomic_commits_the_effect_and_its_outcome_together(dedupe: Deduplicator, pg: Tables,
                                                           postgres_dsn: str) -> None:
    runs: list[int] = []
    assert dedupe.run("order-1", credit, postgres_dsn, pg.accounts, 5, runs) == {"credited": 5, "run": 1}
    assert dedupe.run("order-1", credit, postgres_dsn, pg.accounts, 5, runs) == {"credited": 5, "run": 1}
    assert runs == [5] and pg_balance(postgres_dsn, pg.accounts) == 5
    recorded = row(postgres_dsn, pg.outcomes.table, dedupe.request("order-1").stem)
    assert recorded is not None and recorded[1] == "c" and bytes(recorded[2]) == b'{"credited":5,"run":1}'


def test_a_handler_error_inside_the_block_commits_nothing(dedupe: Deduplicator, pg: Tables,
                                                          postgres_dsn: str) -> None:
    def failing() -> None:
        with psycopg.connect(postgres_dsn) as conn, atomic(conn):
            conn.execute(f"UPDATE {pg.accounts} SET balance = balance + 1 WHERE id = 1")
            raise ValueError("boom")

    with pytest.raises(ValueError):
        dedupe.run("order-2", failing)
    assert pg_balance(postgres_dsn, pg.accounts) == 0
    assert row(postgres_dsn, pg.outcomes.table, dedupe.request("order-2").stem) is None
    runs: list[int] = []
    assert dedupe.run("order-2", credit, postgres_dsn, pg.accounts, 1, runs)["credited"] == 1  # the retry applies
    assert pg_balance(postgres_dsn, pg.accounts) == 1


def test_atomic_outside_a_handler_is_a_clear_error(pg: Tables, postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn) as conn, pytest.raises(RuntimeError, match="no current claim"):
        atomic(conn)


@pytest.mark.parametrize("driver", ["psycopg", "sqlalchemy-session", "sqlalchemy-connection"])
def test_redis_losing_every_record_applies_nothing_again(driver: str, private_redis: RedisServer, pg: Tables,
                                                         postgres_dsn: str, namespace: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    engine = create_engine(postgres_dsn.replace("postgresql://", "postgresql+psycopg://"))
    client = redis.Redis.from_url(private_redis.url)
    dedupe = Deduplicator(client, namespace=namespace, outcomes=pg.outcomes)
    runs: list[int] = []

    def handler() -> Any:
        runs.append(1)
        if driver == "psycopg":
            return credit(postgres_dsn, pg.accounts, 7, [])
        update = text(f"UPDATE {pg.accounts} SET balance = balance + 7 WHERE id = 1")
        if driver == "sqlalchemy-session":
            with Session(engine) as session, atomic(session) as outcome:
                session.execute(update)
                outcome.result = {"credited": 7}
        else:
            with engine.connect() as conn, atomic(conn) as outcome:
                conn.execute(update)
                outcome.result = {"credited": 7}
        return outcome.result

    first = dedupe.run("order-3", handler)
    client.flushall()  # Redis forgets everything: the redelivery is claimed as new
    decision = decide(dedupe, "order-3", handler)
    assert decision.reason is Reason.DUPLICATE and decision.value == first
    assert len(runs) == 2 and pg_balance(postgres_dsn, pg.accounts) == 7  # ran, refused by the row
    assert dedupe.status("order-3").state == "done"  # the committed result is in Redis again
    assert decide(dedupe, "order-3", handler).reason is Reason.DUPLICATE and len(runs) == 2
    dedupe.close()
    engine.dispose()


def test_a_reclaim_after_a_crash_is_answered_from_the_row_without_running_the_handler(
        redis_client: redis.Redis, namespace: str, pg: Tables, postgres_dsn: str) -> None:
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=0.3, renew_interval=60, outcomes=pg.outcomes)
    runs: list[int] = []
    claim = dedupe.begin("order-4")
    assert claim.acquired and not claim.reclaimed
    with dedupe.hold(claim):  # the handler commits, then the worker dies before complete()
        credit(postgres_dsn, pg.accounts, 3, runs)
    time.sleep(0.4)  # its lease runs out
    decision = decide(dedupe, "order-4", lambda: credit(postgres_dsn, pg.accounts, 3, runs))
    assert decision.reason is Reason.DUPLICATE and decision.value == {"credited": 3, "run": 1}
    assert decision.claim is not None and decision.claim.reclaimed
    assert runs == [3] and pg_balance(postgres_dsn, pg.accounts) == 3
    assert dedupe.status("order-4").state == "done"
    dedupe.close()


def test_a_zombie_that_commits_first_wins_and_its_successor_commits_nothing(
        redis_client: redis.Redis, namespace: str, pg: Tables, postgres_dsn: str) -> None:
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=0.4, renew_interval=60, outcomes=pg.outcomes)
    inside, go = threading.Event(), threading.Event()
    answers: dict[str, Any] = {}

    def zombie() -> Any:
        with psycopg.connect(postgres_dsn) as conn, atomic(conn) as outcome:
            conn.execute(f"UPDATE {pg.accounts} SET balance = balance + 1 WHERE id = 1")
            outcome.result = "zombie"
            inside.set()
            go.wait(10)  # paused past its lease, its row uncommitted
        return outcome.result

    def run_zombie() -> None:
        try:
            answers["zombie"] = dedupe.run("order-5", zombie)
        except LeaseLost as exc:
            answers["zombie"] = exc

    a = threading.Thread(target=run_zombie)
    a.start()
    assert inside.wait(10)
    time.sleep(0.5)
    successor_ran = threading.Event()

    def successor() -> Any:
        successor_ran.set()
        return credit(postgres_dsn, pg.accounts, 1, [])

    b = threading.Thread(target=lambda: answers.setdefault("successor", decide(dedupe, "order-5", successor)))
    b.start()
    assert successor_ran.wait(10)
    time.sleep(0.3)  # the successor's INSERT now waits on the zombie's uncommitted row
    go.set()
    a.join(10)
    b.join(10)
    assert isinstance(answers["zombie"], LeaseLost)  # its Redis outcome is refused...
    assert answers["successor"].reason is Reason.DUPLICATE and answers["successor"].value == "zombie"
    assert pg_balance(postgres_dsn, pg.accounts) == 1  # ...but its effect is the one that committed
    dedupe.close()


def test_a_zombie_reaching_atomic_after_its_successor_committed_commits_nothing(
        redis_client: redis.Redis, namespace: str, pg: Tables, postgres_dsn: str) -> None:
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=0.3, renew_interval=60, outcomes=pg.outcomes)
    started, go = threading.Event(), threading.Event()
    answers: dict[str, Any] = {}

    def zombie() -> Any:
        started.set()
        go.wait(10)  # paused before its block, past its lease
        return credit(postgres_dsn, pg.accounts, 1, [])

    a = threading.Thread(target=lambda: answers.setdefault("zombie", decide(dedupe, "order-6", zombie)))
    a.start()
    assert started.wait(10)
    time.sleep(0.4)
    assert dedupe.run("order-6", credit, postgres_dsn, pg.accounts, 1, []) == {"credited": 1, "run": 1}
    go.set()
    a.join(10)
    assert answers["zombie"].reason is Reason.DUPLICATE and answers["zombie"].value == {"credited": 1, "run": 1}
    assert pg_balance(postgres_dsn, pg.accounts) == 1
    dedupe.close()


def test_fail_open_with_redis_down_twenty_concurrent_copies_apply_once(pg: Tables, postgres_dsn: str,
                                                                       namespace: str) -> None:
    down = redis.Redis(port=free_port(), socket_connect_timeout=0.2, socket_timeout=0.2)
    dedupe = Deduplicator(down, namespace=namespace, fail_open=True, outcomes=pg.outcomes)
    barrier = threading.Barrier(20)
    answers: list[Any] = []

    def copy() -> None:
        barrier.wait(10)
        answers.append(decide(dedupe, "order-7", lambda: credit(postgres_dsn, pg.accounts, 1, [])))

    threads = [threading.Thread(target=copy) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(a.reason.value for a in answers) == ["applied"] + ["duplicate"] * 19
    assert all(answer.value == answers[0].value for answer in answers)
    assert pg_balance(postgres_dsn, pg.accounts) == 1
    dedupe.close()


def test_inside_an_open_transaction_atomic_is_a_savepoint(dedupe: Deduplicator, pg: Tables,
                                                          postgres_dsn: str) -> None:
    def handler() -> Any:
        with psycopg.connect(postgres_dsn) as conn:
            with conn.transaction():
                conn.execute(f"UPDATE {pg.accounts} SET balance = balance + 10 WHERE id = 1")
                with atomic(conn) as outcome:
                    conn.execute(f"UPDATE {pg.accounts} SET balance = balance + 1 WHERE id = 1")
                    outcome.result = "joined"
        return outcome.result

    assert dedupe.run("order-8", handler) == "joined"
    assert pg_balance(postgres_dsn, pg.accounts) == 11
    dedupe.forget("order-8")  # Redis forgets: the whole transaction is refused, outer writes included
    assert decide(dedupe, "order-8", handler).reason is Reason.DUPLICATE
    assert pg_balance(postgres_dsn, pg.accounts) == 11


def test_a_long_key_is_stored_by_its_hash(dedupe: Deduplicator, pg: Tables, postgres_dsn: str) -> None:
    key = "x" * 600  # hashed by the client (max_key_length) and fits the key column
    runs: list[int] = []
    dedupe.run(key, credit, postgres_dsn, pg.accounts, 2, runs)
    dedupe.forget(key)
    assert decide(dedupe, key, lambda: credit(postgres_dsn, pg.accounts, 2, runs)).reason is Reason.DUPLICATE
    assert pg_balance(postgres_dsn, pg.accounts) == 2


def test_already_applied_carries_the_committed_result(pg: Tables, postgres_dsn: str, redis_client: redis.Redis,
                                                      namespace: str) -> None:
    dedupe = Deduplicator(redis_client, namespace=namespace, outcomes=pg.outcomes)
    dedupe.run("order-9", credit, postgres_dsn, pg.accounts, 4, [])
    dedupe.forget("order-9")
    seen: list[AlreadyApplied] = []

    def handler() -> Any:
        try:
            return credit(postgres_dsn, pg.accounts, 4, [])
        except AlreadyApplied as exc:
            seen.append(exc)
            raise

    assert dedupe.run("order-9", handler) == {"credited": 4, "run": 1}
    assert seen[0].result == {"credited": 4, "run": 1} and seen[0].token > 0
    assert type(seen[0])(*seen[0].args).result == seen[0].result  # rebuilds from its args
    dedupe.close()


def test_purge_deletes_expired_rows_in_batches(redis_client: redis.Redis, namespace: str, pg: Tables,
                                               postgres_dsn: str) -> None:
    dedupe = Deduplicator(redis_client, namespace=namespace, result_ttl=60, outcomes=pg.outcomes)
    for i in range(5):
        dedupe.run(f"order-p{i}", credit, postgres_dsn, pg.accounts, 1, [])
    assert pg.outcomes.purge(batch=2) == 0  # none expired yet
    assert pg.outcomes.purge(batch=2, now=time.time() + 120) == 5
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {pg.outcomes.table}").fetchone() == (0,)
    dedupe.close()


def test_the_ddl_files_name_the_table_and_its_index() -> None:
    assert "CREATE TABLE IF NOT EXISTS app.outcomes (" in ddl("postgresql", "app.outcomes")
    assert "outcomes_expires_at ON app.outcomes" in ddl("postgresql", "app.outcomes")
    assert "utf8mb4_bin" in ddl("mariadb")
    with pytest.raises(ValueError):
        SqlOutcomes("postgresql://x", table="bad name; drop")


class CountingOutcomes(SqlOutcomes):
    """SqlOutcomes that count the engine's look-ups."""

    lookups = 0

    def lookup(self, claim: Any) -> AlreadyApplied | None:
        self.lookups += 1
        return super().lookup(claim)


def test_first_claims_pay_no_lookup_and_reclaims_one(redis_client: redis.Redis, namespace: str, pg: Tables,
                                                     postgres_dsn: str) -> None:
    outcomes = CountingOutcomes(postgres_dsn, table=pg.outcomes.table)
    dedupe = Deduplicator(redis_client, namespace=namespace, outcomes=outcomes)
    for i in range(5):
        dedupe.run(f"first-{i}", credit, postgres_dsn, pg.accounts, 1, [])
    assert outcomes.lookups == 0
    with pytest.raises(ValueError):
        dedupe.run("retried", lambda: (_ for _ in ()).throw(ValueError("first attempt fails")))
    assert dedupe.run("retried", credit, postgres_dsn, pg.accounts, 1, []) == {"credited": 1, "run": 1}
    assert outcomes.lookups == 1 and pg_balance(postgres_dsn, pg.accounts) == 6
    dedupe.close()


def test_sql_command_inits_prints_and_purges(postgres_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dedupe_worker.cli import main

    table = f"cli_outcome_{int(time.time() * 1000) % 10**9}"
    try:
        assert main(["sql", "init", "--dsn", postgres_dsn, "--table", table]) == 0
        assert main(["sql", "init", "--dsn", postgres_dsn, "--table", table]) == 0  # idempotent
        assert main(["sql", "purge", "--dsn", postgres_dsn, "--table", table]) == 0
        assert main(["sql", "ddl", "--dialect", "mysql"]) == 0
        out = capsys.readouterr().out
        assert f"{table}: ready (postgresql)" in out and "purged 0 expired" in out and "LONGBLOB" in out
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


def test_settings_give_the_deduplicator_its_outcomes(monkeypatch: pytest.MonkeyPatch, postgres_dsn: str) -> None:
    monkeypatch.setenv("DEDUPE_SQL_DSN", postgres_dsn)
    monkeypatch.setenv("DEDUPE_SQL_TABLE", "my_outcomes")
    dedupe = Deduplicator.from_settings()
    assert isinstance(dedupe.outcomes, SqlOutcomes) and dedupe.outcomes.table == "my_outcomes"
    dedupe.close()
    outcomes = SqlOutcomes(postgres_dsn, table="url_outcomes")
    from_url = Deduplicator.from_url("redis://127.0.0.1:6379/0", namespace="t-from-url", outcomes=outcomes)
    assert from_url.outcomes is outcomes
    from_url.close()


def test_a_none_outcome_needs_no_exit_statement_and_reads_back_as_none(dedupe: Deduplicator, pg: Tables,
                                                                       postgres_dsn: str) -> None:
    def handler() -> None:
        with psycopg.connect(postgres_dsn) as conn, atomic(conn):
            conn.execute(f"UPDATE {pg.accounts} SET balance = balance + 1 WHERE id = 1")

    assert dedupe.run("order-n", handler) is None
    assert row(postgres_dsn, pg.outcomes.table, dedupe.request("order-n").stem)[1:] == ("c", None)  # type: ignore[index]
    dedupe.forget("order-n")
    decision = decide(dedupe, "order-n", handler)
    assert decision.reason is Reason.DUPLICATE and decision.value is None
    assert pg_balance(postgres_dsn, pg.accounts) == 1


def test_a_transaction_still_open_when_the_handler_returns_is_not_stored_until_it_commits(
        dedupe: Deduplicator, pg: Tables, postgres_dsn: str) -> None:
    from dedupe_worker.sql import NotCommitted

    runs: list[int] = []
    with psycopg.connect(postgres_dsn) as conn:
        def handler() -> Any:
            runs.append(1)
            with atomic(conn) as outcome:  # a savepoint in the caller's transaction, open around run()
                conn.execute(f"UPDATE {pg.accounts} SET balance = balance + 6 WHERE id = 1")
                outcome.result = {"credited": 6}
            return outcome.result

        with conn.transaction():
            with pytest.raises(NotCommitted):  # the confirmation does not wait on the open transaction
                dedupe.run("order-open", handler)
            assert dedupe.status("order-open").state == "free"
        # ...which the caller commits after all: the redelivery is answered from its row
    decision = decide(dedupe, "order-open", handler)
    assert decision.reason is Reason.DUPLICATE and decision.value == {"credited": 6}
    assert runs == [1] and pg_balance(postgres_dsn, pg.accounts) == 6


def test_a_dsn_keeps_one_connection_per_thread_and_replaces_a_broken_one(
        dedupe: Deduplicator, pg: Tables, postgres_dsn: str) -> None:
    dedupe.run("order-c", credit, postgres_dsn, pg.accounts, 1, [])
    claim = dedupe.begin("order-c2")
    assert not pg.outcomes.committed(claim)
    backend = pg.outcomes._connection().info.backend_pid
    assert pg.outcomes._connection().info.backend_pid == backend  # the same connection, kept
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
    with pytest.raises(psycopg.OperationalError):
        pg.outcomes.committed(claim)  # the engine treats this as "not confirmed": released, runs again
    assert not pg.outcomes.committed(claim)  # a new connection
    assert pg.outcomes._connection().info.backend_pid != backend
    dedupe.release(claim)
