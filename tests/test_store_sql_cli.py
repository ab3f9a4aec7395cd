"""``dedupe-worker doctor / inspect / stats / forget`` take a database URL (the SQL store)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from dedupe_worker import Deduplicator

from .replay_fixtures import cli
from .store_fixtures import mariadb_store, postgres_store


@pytest.fixture(params=["postgresql", "mariadb"])
def sql_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "postgresql":
        yield from postgres_store(request.getfixturevalue("postgres_dsn"))
    else:
        yield from mariadb_store(request.getfixturevalue("mysql_url"))


def test_operator_commands_on_a_database_url(sql_url: str) -> None:
    namespace = f"ops{uuid.uuid4().hex[:8]}"
    common = ["--store-url", sql_url, "--namespace", namespace]
    dedupe = Deduplicator.from_url(sql_url, namespace=namespace, lease=30)
    dedupe.run("paid", lambda: {"order": 7})
    held = dedupe.begin("busy")

    status, out = cli(["doctor", *common])
    assert status == 0, out
    assert "schema version 1" in out and "durability" in out and "connections" in out

    status, out = cli(["inspect", "paid", "busy", "never", *common])
    assert status == 0
    assert "paid: done" in out and '{"order":7}' in out and f"busy: in_progress, token {held.token}" in out
    assert "never: free, token 0" in out

    status, out = cli(["stats", *common, "--json"])
    assert status == 0 and '"done": 1' in out and '"in_progress": 1' in out

    status, out = cli(["forget", "busy", *common])
    assert status == 1 and "refused: a live lease" in out
    status, out = cli(["forget", "paid", "--dry-run", *common])
    assert "would be removed (done" in out
    status, out = cli(["forget", "paid", *common])
    assert status == 0 and "paid: removed" in out
    assert dedupe.run("paid", lambda: "again") == "again"
    dedupe.close()


def test_doctor_says_when_the_schema_is_missing(postgres_dsn: str) -> None:
    schema = f"nothing_{uuid.uuid4().hex[:8]}"
    url = "postgresql://" + postgres_dsn.split("://", 1)[1] + f"?options=-csearch_path%3D{schema}"
    status, out = cli(["doctor", "--store-url", url])
    assert status == 1 and "no dedupe schema" in out and "sql init" in out
