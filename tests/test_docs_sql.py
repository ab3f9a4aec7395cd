"""The Django block of docs/sql.md (marked ``run by tests/test_docs_sql.py (django)``: it needs
Django's settings, as a project has them), against real PostgreSQL (a schema of the test's own), a
private Redis, and Django configured on the same database. tests/test_docs.py runs the others."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from dedupe_worker.sql import SqlOutcomes

from .services import RedisServer

DOC = Path(__file__).resolve().parent.parent / "docs" / "sql.md"


def block(name: str) -> str:
    """The block of docs/sql.md marked ``<!-- docs-test: run by tests/test_docs_sql.py (name) -->``."""
    marker = f"<!-- docs-test: run by tests/test_docs_sql.py ({name}) -->\n```python\n"
    found = re.search(re.escape(marker) + r"(.*?)```", DOC.read_text(), flags=re.S)
    assert found, f"docs/sql.md has no block {name!r}"
    return found.group(1)


@pytest.fixture
def schema(postgres_dsn: str) -> Iterator[str]:
    name = f"docs_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
        conn.execute(f"CREATE TABLE {name}.accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        conn.execute(f"INSERT INTO {name}.accounts VALUES (1, 0)")
    yield name
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {name} CASCADE")


def configure_django(dsn: str, schema: str) -> None:
    from urllib.parse import urlsplit

    import django
    from django.conf import settings

    url = urlsplit(dsn)
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"),
                "USER": url.username or "", "HOST": url.hostname or "", "PORT": str(url.port or 5432),
                "OPTIONS": {"options": f"-c search_path={schema}"}}
    if settings.configured:
        settings.DATABASES["default"] = database
    else:
        settings.configure(DATABASES={"default": database})
        django.setup()


def test_the_django_example_runs(schema: str, postgres_dsn: str, private_redis: RedisServer,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    configure_django(postgres_dsn, schema)
    dsn = f"{postgres_dsn}?options={quote(f'-csearch_path={schema}')}"
    SqlOutcomes(dsn).create_table()  # what `dedupe-worker sql init` or a migration does in the project
    code = block("django").replace("postgresql://app@localhost/app", dsn).replace(
        "redis://localhost:6379/0", private_redis.url)
    for _ in range(2):  # the second run is a duplicate, answered from Redis
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs_sql"})  # the docs' own example
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["{'account': 1, 'credited': 2}"] * 2
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute(f"SELECT balance FROM {schema}.accounts").fetchone() == (2,)
        assert conn.execute(f"SELECT count(*) FROM {schema}.dedupe_outcome").fetchone() == (1,)
