"""The claim store on PostgreSQL or MySQL/MariaDB, selected by the URL (see :mod:`.store`).

``Deduplicator.from_url("postgresql://...")`` (and ``mysql://``, ``mariadb://``, the SQLAlchemy
forms with a driver) builds its client on :func:`connect`'s pool instead of a Redis client; the
asyncio deduplicator on :func:`connect_async`'s.
"""

from __future__ import annotations

from .._transport import CONNECTORS
from .pool import SqlPool
from .schema import SCHEMA_VERSION, ddl, install, installed_version, purge
from .urls import MYSQL, POSTGRESQL, dialect_of, is_sql_url, mysql_arguments, postgresql_conninfo

__all__ = ["SCHEMA_VERSION", "SqlPool", "connect", "connect_async", "ddl", "dialect_of", "install", "installed_version",
           "is_sql_url", "purge"]


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


def _connector(url: str, asynchronous: bool) -> SqlPool | None:
    if not is_sql_url(url):
        return None
    return connect_async(url) if asynchronous else connect(url)


CONNECTORS.append(_connector)
