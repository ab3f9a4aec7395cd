"""The connections :func:`~dedupe_worker.sql._atomic` works on, each behind one small driver.

A driver opens the block's transaction (or a savepoint in the one already open) and executes a
:class:`~dedupe_worker.sql._statements.Statement`, answering with the row count or the first row.
Sync: a psycopg ``Connection``, a SQLAlchemy ``Connection`` or ``Session``, a Django connection
alias. Asyncio: a psycopg ``AsyncConnection``, a SQLAlchemy ``AsyncConnection`` or
``AsyncSession``. Nothing here decides anything: the steps are :mod:`._statements`'.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from ._statements import Statement

__all__ = ["AsyncDriver", "Driver", "async_driver", "sync_driver"]

_PYFORMAT = re.compile(r"%\((\w+)\)s")


def _named(sql: str) -> str:
    """``%(name)s`` placeholders as SQLAlchemy's ``:name``."""
    return _PYFORMAT.sub(r":\1", sql)


class Driver:
    """A sync connection: ``transaction()`` (a context manager) and ``execute(statement)``;
    ``joined()`` before it: whether that transaction is a savepoint in one already open, which
    commits (or not) after the block, out of its sight."""

    dialect: str

    def joined(self) -> bool:
        raise NotImplementedError

    def transaction(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def execute(self, statement: Statement) -> Any:
        raise NotImplementedError


class AsyncDriver:
    """An asyncio connection: ``transaction()`` (an async context manager) and ``await execute()``."""

    dialect: str

    def joined(self) -> bool:
        raise NotImplementedError

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    async def execute(self, statement: Statement) -> Any:
        raise NotImplementedError


def _psycopg_joined(conn: Any) -> bool:
    # IDLE: conn.transaction() begins and commits its own; INTRANS (a transaction() block, or
    # statements run outside autocommit): it makes a savepoint
    from psycopg import pq

    return bool(conn.info.transaction_status != pq.TransactionStatus.IDLE)


def _answer(statement: Statement, rowcount: int, first: Callable[[], Any]) -> Any:
    return first() if statement.reads else rowcount


class PsycopgDriver(Driver):
    """psycopg 3 ``Connection``: ``conn.transaction()`` begins, or makes a savepoint inside an
    open transaction."""

    dialect = "postgresql"

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def joined(self) -> bool:
        return _psycopg_joined(self.conn)

    def transaction(self) -> AbstractContextManager[Any]:
        return self.conn.transaction()  # type: ignore[no-any-return]

    def execute(self, statement: Statement) -> Any:
        cur = self.conn.execute(statement.sql, statement.params)
        return _answer(statement, cur.rowcount, cur.fetchone)


class SqlAlchemyDriver(Driver):
    """SQLAlchemy 2 ``Connection`` or ``Session``: ``begin()``, or ``begin_nested()`` (a
    savepoint) when a transaction is already open."""

    def __init__(self, conn: Any, dialect: str) -> None:
        self.conn, self.dialect = conn, dialect

    def joined(self) -> bool:
        return bool(self.conn.in_transaction())

    def transaction(self) -> AbstractContextManager[Any]:
        conn = self.conn
        return conn.begin_nested() if conn.in_transaction() else conn.begin()  # type: ignore[no-any-return]

    def execute(self, statement: Statement) -> Any:
        from sqlalchemy import text

        result = self.conn.execute(text(_named(statement.sql)), statement.params)
        return _answer(statement, result.rowcount, result.first)


class DjangoDriver(Driver):
    """A Django database alias: ``django.db.transaction.atomic(using=...)`` (a savepoint when
    nested), statements through that connection's cursor."""

    def __init__(self, using: str) -> None:
        from .._extras import require

        self.using = using
        self.connection = require("django.db", "django").connections[using]
        self.dialect = self.connection.vendor

    def joined(self) -> bool:
        return bool(self.connection.in_atomic_block or not self.connection.get_autocommit())

    def transaction(self) -> AbstractContextManager[Any]:
        from django.db import transaction

        return transaction.atomic(using=self.using)  # type: ignore[no-any-return]

    def execute(self, statement: Statement) -> Any:
        with self.connection.cursor() as cur:
            cur.execute(statement.sql, statement.params)
            return _answer(statement, cur.rowcount, cur.fetchone)


class AsyncPsycopgDriver(AsyncDriver):
    """psycopg 3 ``AsyncConnection``."""

    dialect = "postgresql"

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def joined(self) -> bool:
        return _psycopg_joined(self.conn)

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        return self.conn.transaction()  # type: ignore[no-any-return]

    async def execute(self, statement: Statement) -> Any:
        cur = await self.conn.execute(statement.sql, statement.params)
        return await cur.fetchone() if statement.reads else cur.rowcount


class AsyncSqlAlchemyDriver(AsyncDriver):
    """SQLAlchemy 2 ``AsyncConnection`` or ``AsyncSession``."""

    def __init__(self, conn: Any, dialect: str) -> None:
        self.conn, self.dialect = conn, dialect

    def joined(self) -> bool:
        return bool(self.conn.in_transaction())

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        conn = self.conn
        return conn.begin_nested() if conn.in_transaction() else conn.begin()  # type: ignore[no-any-return]

    async def execute(self, statement: Statement) -> Any:
        from sqlalchemy import text

        result = await self.conn.execute(text(_named(statement.sql)), statement.params)
        return _answer(statement, result.rowcount, result.first)


def _sqlalchemy_dialect(conn: Any) -> str:
    bind = conn.get_bind() if hasattr(conn, "get_bind") else conn
    return str(bind.dialect.name)


def sync_driver(conn: Any) -> Driver | None:
    """The driver of a sync connection, else ``None``."""
    try:
        import psycopg
    except ImportError:
        pass
    else:
        if isinstance(conn, psycopg.Connection):
            return PsycopgDriver(conn)
    try:
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session
    except ImportError:
        pass
    else:
        if isinstance(conn, (Connection, Session)):
            return SqlAlchemyDriver(conn, _sqlalchemy_dialect(conn))
    return None


def async_driver(conn: Any) -> AsyncDriver | None:
    """The driver of an asyncio connection, else ``None``."""
    try:
        import psycopg
    except ImportError:
        pass
    else:
        if isinstance(conn, psycopg.AsyncConnection):
            return AsyncPsycopgDriver(conn)
    try:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    except ImportError:
        pass
    else:
        if isinstance(conn, AsyncConnection):
            return AsyncSqlAlchemyDriver(conn, conn.dialect.name)
        if isinstance(conn, AsyncSession):
            return AsyncSqlAlchemyDriver(conn, conn.sync_session.get_bind().dialect.name)
    return None
