"""``dedupe-worker sql init|purge|ddl``: the table ``dedupe_worker.sql.atomic()`` commits outcomes in.

::

    dedupe-worker sql init  --dsn postgresql://app@db/app     # create the table and index if missing
    dedupe-worker sql purge --dsn postgresql://app@db/app     # delete expired rows (cron-safe)
    dedupe-worker sql ddl   --dialect mysql                   # print the DDL for your migrations

With ``--store URL`` (a PostgreSQL or MySQL/MariaDB URL, default ``DEDUPE_STORE_URL``) the same
actions work on the claim store's schema instead (``dedupe_worker._sqlstore``): ``init`` creates
it (``--print``: only print its DDL, for one's own migrations), ``purge`` deletes expired rows in
bounded batches, ``ddl`` prints it for ``--dialect``.

``--dsn`` defaults to ``DEDUPE_SQL_DSN`` and ``--table`` to ``DEDUPE_SQL_TABLE``. Exit status 0 on
success, 2 when no DSN is given, the DSN is not one we take, the database cannot be reached or
the table does not exist (one line naming it).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from .._settings import DedupeSettings
from ._fail import CommandError, redacted

__all__ = ["register", "run"]

T = TypeVar("T")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sql", help="create or purge the table of outcomes committed by atomic()")
    p.add_argument("action", choices=("init", "purge", "ddl"),
                   help="init: create the table; purge: delete expired rows; ddl: print the DDL")
    p.add_argument("--dsn", help="PostgreSQL DSN or SQLAlchemy URL (DEDUPE_SQL_DSN)")
    p.add_argument("--table", help="table name (DEDUPE_SQL_TABLE; default dedupe_outcome)")
    p.add_argument("--batch", type=int, default=1000, help="rows deleted per statement by purge (default 1000)")
    p.add_argument("--dialect", default="postgresql", choices=("postgresql", "mysql", "mariadb"),
                   help="for ddl: which database's DDL (default postgresql)")
    p.add_argument("--store", nargs="?", const="", default=None,
                   help="act on the claim store's schema at this database URL (DEDUPE_STORE_URL)")
    p.add_argument("--print", action="store_true", dest="print_only",
                   help="with --store and init: print the DDL instead of running it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = DedupeSettings()
    if args.store is not None:
        return _store(args, args.store or settings.store_url or "")
    table = args.table or settings.sql_table
    from ..sql import SqlOutcomes, ddl

    if args.action == "ddl":
        print(_checked(lambda: ddl(args.dialect, table)), end="")
        return 0
    dsn = args.dsn or settings.sql_dsn
    if not dsn:
        raise CommandError("give --dsn or set DEDUPE_SQL_DSN")
    scheme = dsn.split("://", 1)[0] if "://" in dsn else ""
    if scheme and scheme not in ("postgresql", "postgres") and "+" not in scheme:
        raise CommandError(f"--dsn {redacted(dsn)}: expected a PostgreSQL DSN (postgresql://...) or a "
                           "SQLAlchemy URL with its driver (mysql+pymysql://...)")
    outcomes = _checked(lambda: SqlOutcomes(dsn, table=table))
    if args.action == "init":
        outcomes.create_table()
        print(f"{table}: ready ({outcomes.dialect})")
    else:
        print(f"{table}: purged {outcomes.purge(batch=args.batch)} expired row(s)")
    return 0


def _store(args: argparse.Namespace, url: str) -> int:
    """The ``--store`` actions: the claim store's schema (see the module doc)."""
    from .. import _sqlstore

    if args.action == "ddl" or (args.action == "init" and args.print_only):
        dialect = _sqlstore.dialect_of(url) if url else ("mysql" if args.dialect == "mariadb" else args.dialect)
        print(_sqlstore.ddl(dialect or "postgresql"), end="")
        return 0
    if not _sqlstore.is_sql_url(url):
        raise CommandError("dedupe-worker sql --store: give a postgresql:// or mysql:// URL, or set DEDUPE_STORE_URL")
    pool = _sqlstore.connect(url)
    try:
        if args.action == "init":
            _sqlstore.install(pool)
            print(f"claim store: schema version {_sqlstore.installed_version(pool)} ready ({pool.dialect})")
        else:
            print(f"claim store: purged {_sqlstore.purge(pool, args.batch)} expired row(s)")
    finally:
        pool.close()
    return 0


def _checked(make: Callable[[], T]) -> T:
    """``make()``, its ``ValueError`` (a table name that is not a plain identifier) said as one line."""
    try:
        return make()
    except ValueError as exc:
        raise CommandError(f"{exc} (--table, DEDUPE_SQL_TABLE)") from exc
