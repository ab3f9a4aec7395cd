"""Every ``python`` block of docs/sql.md, run in order as one session against real PostgreSQL (a
schema of the test's own), a private Redis, and Django configured on the same database."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from .services import RedisServer

DOC = Path(__file__).resolve().parent.parent / "docs" / "sql.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


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


def test_every_example_of_docs_sql_runs(schema: str, postgres_dsn: str, private_redis: RedisServer,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    configure_django(postgres_dsn, schema)
    dsn = f"{postgres_dsn}?options={quote(f'-csearch_path={schema}')}"
    code = blocks()
    assert len(code) == 6
    session: dict[str, object] = {"__name__": "docs_sql"}
    for block in code:
        block = block.replace("postgresql://app@localhost/app", dsn).replace(
            "redis://localhost:6379/0", private_redis.url)
        exec(compile(block, str(DOC), "exec"), session)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == printed[1] == "{'account': 1, 'credited': 50}"
    assert printed[-1] == "{'account': 1, 'refunded': 7}"
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute(f"SELECT balance FROM {schema}.accounts").fetchone() == (50 + 20 + 5 + 2 - 7,)
        assert conn.execute(f"SELECT count(*) FROM {schema}.dedupe_outcome").fetchone() == (5,)
