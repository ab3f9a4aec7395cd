"""The SQL store beside Redis: ``run()`` first-seen and duplicate latency and the batch engine's
messages per second on Redis, PostgreSQL and MariaDB, measured in the same run (issue 38's goals:
the batch engine on PostgreSQL >= 20% of Redis's msg/s, first-seen ``run()`` within 4x of Redis's).

    python -m bench.sql_store [--seconds S] [--redis-url URL] [--dsn DSN] [--mysql-url URL]

Every case takes turns with the others in short rounds (``bench.core.rates``), so a noisy
neighbour hits them alike. ``run()`` first seen: a new key each call (claim + completion, two
round trips); duplicate: the same completed key (one round trip); batch: ``decide_many`` of 500
new keys with a trivial handler (the engine every consumer uses). Each store is the run's own: a
PostgreSQL schema and a MariaDB database made for it and dropped at the end, with the servers'
durability settings as they are (printed: they decide the cost of every commit), and PostgreSQL
once more with this client's sessions at ``synchronous_commit = off`` ("PG async": a commit is
acknowledged before its WAL reaches the disk, as Redis's ``appendfsync everysec`` acknowledges a
write before its ``fsync``).
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import psycopg
import pymysql

from bench.core import rates
from dedupe_worker import Deduplicator, decide_many
from dedupe_worker._sqlstore import connect, install

BATCH = 500


@contextmanager
def postgres(dsn: str) -> Iterator[str]:
    schema = f"bench_store_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        print(f"  PostgreSQL synchronous_commit = {conn.execute('SHOW synchronous_commit').fetchone()[0]}")
    url = "postgresql://" + dsn.split("://", 1)[1] + ("&" if "?" in dsn else "?") + f"options=-csearch_path%3D{schema}"
    try:
        install(connect(url))
        yield url
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@contextmanager
def mariadb(url: str) -> Iterator[str]:
    database = f"bench_store_{uuid.uuid4().hex[:8]}"
    server = url.split("://", 1)[1].rsplit("/", 1)[0]
    conn = pymysql.connect(**connect("mysql://" + server + "/").arguments | {"database": None})  # type: ignore[attr-defined]
    with conn.cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {database}")
        cursor.execute("SELECT @@innodb_flush_log_at_trx_commit")
        print(f"  MariaDB innodb_flush_log_at_trx_commit = {cursor.fetchone()[0]}")
    store = f"mariadb://{server}/{database}"
    try:
        install(connect(store))
        yield store
    finally:
        with conn.cursor() as cursor:
            cursor.execute(f"DROP DATABASE {database}")
        conn.close()


def cases(name: str, dedupe: Deduplicator) -> dict[str, Callable[[int], int]]:
    dedupe.run("dup", lambda: {"ok": True})
    run_id = uuid.uuid4().hex[:6]

    def first_seen(i: int) -> int:
        dedupe.run(f"new-{run_id}-{i}", lambda: {"ok": True})
        return 1

    def duplicate(_: int) -> int:
        dedupe.run("dup", lambda: {"ok": False})
        return 1

    def batch(i: int) -> int:
        decide_many(dedupe, [(f"batch-{run_id}-{i}-{j}", None, lambda: None) for j in range(BATCH)])
        return BATCH

    return {f"{name} first": first_seen, f"{name} dup": duplicate, f"{name} batch": batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=9.0, help="seconds per case, over all rounds")
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--dsn", default=os.environ.get("DEDUPE_TEST_POSTGRES_DSN",
                                                        "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--mysql-url", default=os.environ.get("DEDUPE_TEST_MYSQL_URL",
                                                              "mysql://root@127.0.0.1:3306/test"))
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    namespace = f"bench-store-{uuid.uuid4().hex[:6]}"
    with ExitStack() as stack:
        pg = stack.enter_context(postgres(args.dsn))
        urls = {"Redis": args.redis_url, "PostgreSQL": pg,
                # the same database, this client's commits not waiting for the disk (libpq options)
                "PG async": pg + "%20-csynchronous_commit%3Doff",
                "MariaDB": stack.enter_context(mariadb(args.mysql_url))}
        clients = {name: stack.enter_context(Deduplicator.from_url(url, namespace=namespace))
                   for name, url in urls.items()}
        all_cases: dict[str, Callable[[int], int]] = {}
        for name, dedupe in clients.items():
            all_cases.update(cases(name, dedupe))
        found = rates(all_cases, args.seconds)
    print(f"\nSQL store beside Redis ({args.label or 'unpinned'}), median of 15 interleaved rounds")
    print(f"  {'store':<11} {'run() first seen':>18} {'duplicate':>12} {'batch engine (500)':>20}")
    redis_first, redis_batch = found["Redis first"], found["Redis batch"]
    for name in urls:
        first, dup, batch = found[f"{name} first"], found[f"{name} dup"], found[f"{name} batch"]
        print(f"  {name:<11} {1e6 / first:>15,.0f} us {1e6 / dup:>9,.0f} us {batch:>14,.0f} msg/s"
              f"   first-seen {redis_first / first:.2f}x Redis's time, batch {batch / redis_batch:.0%} of Redis's")
    pg_first, pg_batch = found["PostgreSQL first"], found["PostgreSQL batch"]
    async_first = found["PG async first"]
    print(f"  targets: PostgreSQL batch >= 20% of Redis ({pg_batch / redis_batch:.0%}), first-seen run() within 4x "
          f"({redis_first / pg_first:.2f}x; {redis_first / async_first:.2f}x with synchronous_commit = off)")


if __name__ == "__main__":
    main()
