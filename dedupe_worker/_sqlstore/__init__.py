"""The claim store on PostgreSQL or MySQL/MariaDB, selected by the URL (see :mod:`.store`).

``Deduplicator.from_url("postgresql://...")`` (and ``mysql://``, ``mariadb://``, the SQLAlchemy
forms with a driver) builds its client on :func:`connect`'s pool instead of a Redis client; the
asyncio deduplicator on :func:`connect_async`'s.
"""

from __future__ import annotations

from typing import Any

from .pool import SqlPool
from .schema import SCHEMA_VERSION, ddl, install, installed_version, purge
from .urls import MYSQL, POSTGRESQL, dialect_of, is_sql_url, mysql_arguments, postgresql_conninfo

__all__ = ["SCHEMA_VERSION", "SqlPool", "connect", "connect_async", "ddl", "dialect_of", "install", "installed_version",
           "is_sql_url", "purge", "store_for"]


def connect(url: str) -> SqlPool:
    """The pool of the SQL store ``url`` names (nothing is connected yet)."""
    dialect = dialect_of(url)
    if dialect == POSTGRESQL:
        from .postgres import PgPool

        return PgPool(postgresql_conninfo(url))
    if dialect == MYSQL:
        from .mysql import MySqlPool

        return MySqlPool(mysql_arguments(url))
    raise ValueError(f"not a SQL store URL: {url!r}")


def connect_async(url: str) -> SqlPool:
    """:func:`connect` for the asyncio client."""
    dialect = dialect_of(url)
    if dialect == POSTGRESQL:
        from .postgres import AsyncPgPool

        return AsyncPgPool(postgresql_conninfo(url))
    if dialect == MYSQL:
        from .mysql import AsyncMySqlPool

        return AsyncMySqlPool(mysql_arguments(url))
    raise ValueError(f"not a SQL store URL: {url!r}")


def store_for(pool: SqlPool, asynchronous: bool) -> Any:
    """The store class factory for ``pool``: ``functools.partial``-like, called with the layout."""
    from .store import AsyncSqlStore, SqlStore

    store = AsyncSqlStore if asynchronous else SqlStore
    return lambda layout: store(pool, layout)
