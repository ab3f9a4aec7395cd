"""What the command line says when a command cannot do its work: one line naming the thing.

:func:`~dedupe_worker.cli.main` is the one place that turns an exception into that line and exit
status 2 (with ``-v`` it prints the traceback first). :func:`explain` decides which exceptions
are the user's to fix (a service that cannot be reached, a bad URL or DSN, a missing table, a
handler that does not import, a bad setting) and words them; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import sys
from urllib.parse import urlsplit, urlunsplit

import redis

from .._errors import EvictionPolicyError, StoreUnavailable

__all__ = ["CommandError", "explain", "redacted"]


class CommandError(Exception):
    """A problem the user can fix, already worded as the one line to print."""


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for error lines)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _database_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` comes from a database driver: psycopg's, PyMySQL's or SQLAlchemy's hierarchy
    (looked up only when loaded, so the CLI imports none of them)."""
    for driver in ("psycopg", "pymysql"):
        module = sys.modules.get(driver)
        if module is not None and isinstance(exc, module.Error):
            return True
    sqlalchemy_exc = sys.modules.get("sqlalchemy.exc")
    return sqlalchemy_exc is not None and isinstance(exc, sqlalchemy_exc.SQLAlchemyError)


def _settings_error(exc: BaseException) -> str | None:
    """A ``DEDUPE_*`` value pydantic refused, as ``name: why`` pairs on one line."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is None or not isinstance(exc, pydantic.ValidationError):
        return None
    parts = [f"DEDUPE_{'.'.join(map(str, e['loc'])).upper()}={e.get('input')!r}: {e['msg']}" for e in exc.errors()]
    return "bad setting: " + "; ".join(parts)


def explain(exc: BaseException) -> str | None:
    """The one line for ``exc`` when it is the user's to fix, else ``None`` (a bug: traceback)."""
    if isinstance(exc, CommandError):
        return str(exc)
    if isinstance(exc, EvictionPolicyError):
        return f"refusing to start: {exc} (--allow-eviction)"
    if isinstance(exc, StoreUnavailable) and _database_error(exc.__cause__):
        # the SQL store's transitions name the database and the step ("PostgreSQL failed running ...")
        return f"database: {_first_line(exc)}"
    if isinstance(exc, (StoreUnavailable, redis.ConnectionError, redis.TimeoutError)):
        return f"cannot reach Redis: {_first_line(exc)}"
    if isinstance(exc, ImportError):  # a missing extra: its message says what to install
        return _first_line(exc)
    if _database_error(exc):
        # psycopg and SQLAlchemy put the server's one-line message first ("connection to server
        # at ... failed", 'relation "x" does not exist'); SQLAlchemy adds a background link after it.
        return f"database: {_first_line(exc)}"
    return _settings_error(exc)
