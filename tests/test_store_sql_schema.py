"""The SQL store's schema and operations: ``dedupe-worker sql init|purge --store``, the schema's
version, and a claim path that stays on the primary key however many expired rows pile up."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from dedupe_worker import Deduplicator, Outcome
from dedupe_worker._sqlstore import SCHEMA_VERSION, connect, installed_version
from dedupe_worker.cli import main

from .store_fixtures import mariadb_store, postgres_store


@pytest.fixture
def pg_store(postgres_dsn: str) -> Iterator[str]:
    yield from postgres_store(postgres_dsn)


@pytest.fixture
def empty_pg_schema(postgres_dsn: str) -> Iterator[str]:
    """A PostgreSQL URL on a fresh schema with nothing installed."""
    schema = f"dedupe_empty_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    yield "postgresql+psycopg://" + postgres_dsn.split("://", 1)[1] + f"?options=-csearch_path%3D{schema}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def test_sql_init_creates_the_store_schema_once_and_records_its_version(
        empty_pg_schema: str, capsys: pytest.CaptureFixture[str]) -> None:
    pool = connect(empty_pg_schema)
    assert installed_version(pool) is None
    with pytest.raises(Exception, match="dedupe_v1_claim"):  # nothing installed: the claim says what is missing
        Deduplicator.from_url(empty_pg_schema).begin("k")
    assert main(["sql", "init", "--store", empty_pg_schema, "--print"]) == 0
    assert "CREATE OR REPLACE FUNCTION dedupe_v1_claim" in capsys.readouterr().out
    assert installed_version(pool) is None  # --print touches nothing
    assert main(["sql", "init", "--store", empty_pg_schema]) == 0
    assert main(["sql", "init", "--store", empty_pg_schema]) == 0  # idempotent
    assert installed_version(pool) == SCHEMA_VERSION
    assert Deduplicator.from_url(empty_pg_schema).run("k", lambda: "ok") == "ok"
    pool.close()


def test_sql_init_on_mariadb(mysql_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    for url in mariadb_store(mysql_url):
        assert main(["sql", "init", "--store", url]) == 0  # already installed by the fixture: idempotent
        assert "schema version 1 ready (mysql)" in capsys.readouterr().out
        assert main(["sql", "ddl", "--store", "", "--dialect", "mariadb"]) == 0
        assert "VARBINARY" in capsys.readouterr().out


def test_purge_deletes_expired_rows_in_batches_and_tokens_still_increase(pg_store: str) -> None:
    dedupe = Deduplicator.from_url(pg_store, lease=5)
    first = dedupe.begin("kept-briefly", ttl=0.2)
    dedupe.complete(first, 1)
    for i in range(5):
        dedupe.run(f"short-{i}", lambda: 1, ttl=0.2)
    dedupe.run("long", lambda: 1)
    time.sleep(0.3)
    assert main(["sql", "purge", "--store", pg_store, "--batch", "2"]) == 0
    with psycopg.connect(connect(pg_store).conninfo) as conn:  # type: ignore[attr-defined]
        assert conn.execute("SELECT count(*) FROM dedupe_claims").fetchone() == (1,)
    again = dedupe.begin("kept-briefly")
    assert again.outcome is Outcome.ACQUIRED and again.token > first.token
    assert dedupe.run("long", lambda: 2) == 1
    dedupe.close()


def test_a_claim_on_a_million_expired_rows_reads_by_index(pg_store: str) -> None:
    conninfo = connect(pg_store).conninfo  # type: ignore[attr-defined]
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("INSERT INTO dedupe_claims (stem, next_token, expires_at) "
                      "SELECT convert_to('dedupe:{old-' || i || '}', 'UTF8'), i, now() - interval '1 day' "
                      "FROM generate_series(1, 1000000) AS i")
        conn.execute("ANALYZE dedupe_claims")
        dedupe = Deduplicator.from_url(pg_store)
        assert dedupe.begin("old-42").outcome is Outcome.ACQUIRED  # an expired row counts as absent
        assert dedupe.run("fresh", lambda: "ok") == "ok"
        dedupe.close()
        # the statements the functions run, planned as PL/pgSQL plans them (a parameter, not a literal)
        conn.execute("PREPARE by_stem(bytea) AS SELECT * FROM dedupe_claims c WHERE c.stem = $1 FOR UPDATE")
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN EXECUTE by_stem('dedupe:{old-7}')").fetchall())
        assert "Index Scan using dedupe_claims_pkey" in plan and "Seq Scan" not in plan
        conn.execute("PREPARE expired(int) AS SELECT stem FROM dedupe_claims WHERE expires_at <= clock_timestamp() "
                     "ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED")
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN EXECUTE expired(1000)").fetchall())
        assert "dedupe_claims_expires_at" in plan


def test_a_row_with_a_status_the_transitions_cannot_read_is_refused(pg_store: str, mysql_url: str) -> None:
    """The schema keeps out what claim.lua would answer UNREADABLE: a status letter not ours."""
    import pymysql

    dedupe = Deduplicator.from_url(pg_store)
    dedupe.run("letters", lambda: "ok")
    conninfo = connect(pg_store).conninfo  # type: ignore[attr-defined]
    with psycopg.connect(conninfo) as conn, pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE dedupe_claims SET status = 'x'")
    assert dedupe.run("letters", lambda: "again") == "ok"
    dedupe.close()
    for url in mariadb_store(mysql_url):
        on_maria = Deduplicator.from_url(url)
        on_maria.run("letters", lambda: "ok")
        conn = pymysql.connect(**connect(url).arguments)  # type: ignore[attr-defined]
        with conn.cursor() as cursor, pytest.raises(pymysql.err.OperationalError, match="CONSTRAINT"):
            cursor.execute("UPDATE dedupe_claims SET status = 'x'")
        conn.close()
        assert on_maria.run("letters", lambda: "again") == "ok"
        on_maria.close()
