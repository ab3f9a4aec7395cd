"""Handlers for the consumer processes of ``test_sql_crash.py``: each credits an account inside
``atomic()`` (psycopg, SQLAlchemy or Django, from ``$TEST_SQL_DRIVER``) and, in the first process
to get there, SIGKILLs its own process right after the block committed, before ``complete()``.

Every run appends ``started:<id>:<pid>`` to the Redis list ``$TEST_EFFECTS`` before its work.
"""

from __future__ import annotations

import os
import signal
from functools import cache
from typing import Any

import redis

_clients: dict[str, redis.Redis] = {}


@cache
def _engine() -> Any:
    from sqlalchemy import create_engine

    return create_engine(os.environ["DEDUPE_SQL_DSN"].replace("postgresql://", "postgresql+psycopg://"))


@cache
def _django() -> None:
    from urllib.parse import urlsplit

    import django
    from django.conf import settings

    url = urlsplit(os.environ["DEDUPE_SQL_DSN"])
    settings.configure(DATABASES={"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"), "USER": url.username or "",
        "HOST": url.hostname or "", "PORT": str(url.port or 5432)}})
    django.setup()


def _credit(ident: str, amount: int) -> Any:
    accounts, driver = os.environ["TEST_ACCOUNTS"], os.environ["TEST_SQL_DRIVER"]
    update = f"UPDATE {accounts} SET balance = balance + {int(amount)} WHERE id = 1"
    result = {"id": ident, "credited": amount, "pid": os.getpid()}
    if driver == "psycopg":
        import psycopg

        from dedupe_worker.sql import atomic

        with psycopg.connect(os.environ["DEDUPE_SQL_DSN"]) as conn, atomic(conn) as outcome:
            conn.execute(update)
            outcome.result = result
    elif driver == "sqlalchemy":
        from sqlalchemy import text
        from sqlalchemy.orm import Session

        from dedupe_worker.sql import atomic

        with Session(_engine()) as session, atomic(session) as outcome:
            session.execute(text(update))
            outcome.result = result
    else:
        _django()
        from django.db import connection

        from dedupe_worker.django import atomic as django_atomic

        with django_atomic() as outcome:
            with connection.cursor() as cur:
                cur.execute(update)
            outcome.result = result
    return outcome.result


def rabbit_credit(body: Any, message: Any) -> Any:
    url = os.environ["TEST_REDIS_URL"]
    client = _clients.setdefault(url, redis.Redis.from_url(url))
    client.rpush(os.environ["TEST_EFFECTS"], f"started:{body['id']}:{os.getpid()}")
    result = _credit(body["id"], int(body["amount"]))
    if client.set(os.environ["TEST_EFFECTS"] + ":killed", "1", nx=True):
        os.kill(os.getpid(), signal.SIGKILL)  # committed, and dead before complete()
    return result
