"""The stores the protocol's tests run on: Redis, PostgreSQL and MariaDB, each isolated.

``store_url`` (parametrized by ``store_kind``) is a URL ``Deduplicator.from_url`` takes: the test
Redis, a fresh PostgreSQL schema (``search_path`` in the URL) or a fresh MariaDB database, with the
SQL store's schema installed and dropped again after the module.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import quote

import psycopg
import pymysql
import pytest

from dedupe_worker._sqlstore import connect, install

STORES = ("redis", "postgresql", "mariadb")


def postgres_store(dsn: str) -> Iterator[str]:
    schema = f"dedupe_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    base = "postgresql://" + dsn.split("://", 1)[1]
    url = base + ("&" if "?" in base else "?") + "options=" + quote(f"-csearch_path={schema}")
    pool = connect(url)
    install(pool)
    pool.close()
    try:
        yield url
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def mariadb_store(url: str) -> Iterator[str]:
    database = f"dedupe_test_{uuid.uuid4().hex[:10]}"
    server = url.split("://", 1)[1].rsplit("/", 1)[0]
    conn = pymysql.connect(**connect("mysql://" + server + "/").arguments | {"database": None})
    with conn.cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {database}")
    store = f"mariadb://{server}/{database}"
    pool = connect(store)
    install(pool)
    pool.close()
    try:
        yield store
    finally:
        with conn.cursor() as cursor:
            cursor.execute(f"DROP DATABASE {database}")
        conn.close()


@pytest.fixture(scope="module", params=STORES)
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A store URL of each kind in turn (see the module doc)."""
    if request.param == "redis":
        yield request.getfixturevalue("redis_url")
    elif request.param == "postgresql":
        yield from postgres_store(request.getfixturevalue("postgres_dsn"))
    else:
        yield from mariadb_store(request.getfixturevalue("mysql_url"))
