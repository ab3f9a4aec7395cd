"""The cost of ``atomic()``: ``run()`` of a handler that updates one PostgreSQL row in its own
transaction, with the outcome recorded by ``dedupe_worker.sql.atomic()`` in that transaction and
without, as a ratio to the plain transaction, both in the same run (issue 22's goal: >= 0.85x).

    python -m bench.sql_outcomes [--messages N] [--rounds R] [--dsn DSN] [--redis-url URL]

Each message: one claim and one completion in Redis (the same in every variant), and one
transaction on a held psycopg connection: ``UPDATE`` of one row (plain); the same ``UPDATE`` after
``atomic()``'s ``INSERT`` of the key's row, returning ``None`` (no statement at exit); and the same
returning a small dict, whose exit ``UPDATE`` writes it to the row. The tables are the run's own and
dropped at the end; keys are new every round (first claims: no look-up).
"""

from __future__ import annotations

import argparse
import os
import uuid
from typing import Any

import psycopg
import redis

from bench.ratios import print_ratios
from dedupe_worker import Deduplicator
from dedupe_worker.sql import SqlOutcomes, atomic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dsn", default=os.environ.get("DEDUPE_TEST_POSTGRES_DSN",
                                                        "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    run_id = uuid.uuid4().hex[:8]
    accounts, table = f"bench_accounts_{run_id}", f"bench_outcome_{run_id}"
    outcomes = SqlOutcomes(args.dsn, table=table)
    outcomes.create_table()
    conn = psycopg.connect(args.dsn, autocommit=True)
    conn.execute(f"CREATE TABLE {accounts} (id int PRIMARY KEY, balance bigint NOT NULL)")
    conn.execute(f"INSERT INTO {accounts} VALUES (1, 0)")
    update = f"UPDATE {accounts} SET balance = balance + 1 WHERE id = 1"
    dedupe = Deduplicator(redis.Redis.from_url(args.redis_url), namespace=f"bench-sql-{run_id}", outcomes=outcomes)

    def plain() -> Any:
        with conn.transaction():
            conn.execute(update)

    def recorded() -> Any:
        with atomic(conn) as outcome:
            conn.execute(update)
        return outcome.result

    def with_result() -> Any:
        with atomic(conn) as outcome:
            conn.execute(update)
            outcome.result = {"account": 1, "credited": 1}
        return outcome.result

    def measure(handler: Any, count: int) -> float:
        import time

        prefix = uuid.uuid4().hex[:8]
        began = time.perf_counter()
        for i in range(count):
            dedupe.run(f"{prefix}-{i}", handler)
        return count / (time.perf_counter() - began)

    try:
        cases = [("plain", plain), ("atomic()", recorded), ("+ result", with_result)]
        rates: dict[str, list[float]] = {name: [] for name, _ in cases}
        for _, handler in cases:
            measure(handler, 100)  # warm every path
        for n in range(args.rounds):  # alternate which goes first: a shared machine drifts
            for name, handler in cases if n % 2 == 0 else cases[::-1]:
                rates[name].append(measure(handler, args.messages))
        print(f"run() of a handler updating one PostgreSQL row, with and without atomic() {args.label}", flush=True)
        print_ratios("run()", rates, "plain", args.messages)
    finally:
        dedupe.close()
        conn.execute(f"DROP TABLE IF EXISTS {accounts}")
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.close()


if __name__ == "__main__":
    main()
