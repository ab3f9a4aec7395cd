"""Which store a URL names, and the SQL store's connection arguments.

``postgresql://``, ``postgres://`` and the SQLAlchemy forms with a driver
(``postgresql+psycopg://``, ``postgresql+psycopg2://``) name the PostgreSQL store; ``mysql://``,
``mariadb://`` and ``mysql+pymysql://``, ``mariadb+pymysql://`` the MySQL/MariaDB store. Every
other URL is Redis's (:mod:`dedupe_worker._transport.connection`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["MYSQL", "POSTGRESQL", "dialect_of", "is_sql_url", "mysql_arguments", "postgresql_conninfo"]

POSTGRESQL, MYSQL = "postgresql", "mysql"
_DIALECTS = {"postgresql": POSTGRESQL, "postgres": POSTGRESQL, "mysql": MYSQL, "mariadb": MYSQL}


def dialect_of(url: str) -> str | None:
    """``"postgresql"``, ``"mysql"``, or ``None`` for a URL that is not a SQL store's."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    return _DIALECTS.get(scheme.split("+", 1)[0])


def is_sql_url(url: str) -> bool:
    """Whether ``url`` names a SQL store (PostgreSQL or MySQL/MariaDB)."""
    return dialect_of(url) is not None


def postgresql_conninfo(url: str) -> str:
    """``url`` as libpq takes it: the driver part of a SQLAlchemy scheme dropped."""
    return "postgresql://" + url.split("://", 1)[1]


def mysql_arguments(url: str) -> dict[str, Any]:
    """``pymysql.connect``'s arguments for ``url`` (``mysql://user:password@host:port/database``;
    ``?unix_socket=...`` and ``?charset=...`` in the query)."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    arguments: dict[str, Any] = {
        "host": parts.hostname or "127.0.0.1", "port": parts.port or 3306,
        "user": unquote(parts.username) if parts.username else "root",
        "password": unquote(parts.password) if parts.password else "",
        "database": parts.path.lstrip("/") or None, "autocommit": True,
        "connect_timeout": float(query.pop("connect_timeout", 5)),
    }
    arguments.update(query)
    return arguments
