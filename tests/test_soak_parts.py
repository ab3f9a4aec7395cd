"""The soak harness's own parts (tests/soak): the proxy's cuts are real, the ledger's write is
fenced and idempotent, and a re-run is attributed to the fault that explains it."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from .soak.faults import Fault
from .soak.ledger import Ledger, Operation
from .soak.proxy import TcpProxy
from .soak.report import attribute


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(1024), b"")],
                             daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield int(server.getsockname()[1])
    server.close()


def roundtrip(port: int, data: bytes = b"ping") -> socket.socket:
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    client.sendall(data)
    assert client.recv(1024) == data
    return client


def test_proxy_forwards_cuts_and_refuses(echo_port: int) -> None:
    proxy = TcpProxy(echo_port, "echo")
    try:
        client = roundtrip(proxy.port)
        assert proxy.cut() == 1
        assert client.recv(1024) == b""  # the connection in flight is gone
        proxy.block(0.5)
        refused = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        assert refused.recv(1024) == b""  # accepted, then closed at once: unreachable
        time.sleep(0.6)
        roundtrip(proxy.port).close()  # reachable again after the block
    finally:
        proxy.close()


def test_the_ledger_write_is_fenced_and_idempotent(postgres_dsn: str) -> None:
    ledger = Ledger(postgres_dsn, f"t{uuid.uuid4().hex[:10]}")
    ledger.create()
    try:
        ledger.open_account(Operation("op-1", "rabbitmq", 7))
        assert ledger.write("op-1", 7, token=10) == "applied"
        assert ledger.write("op-1", 7, token=9) == "fenced"            # a zombie's late write
        assert ledger.write("op-1", 7, token=11) == "already_applied"  # a re-run after a crash
        assert ledger.rows("SELECT balance, fence FROM {accounts} WHERE id = 'op-1'") == [(7, 10)]
        assert [r[0] for r in ledger.rows("SELECT phase FROM {invocations} ORDER BY seq")] == [
            "applied", "fenced", "already_applied"]
        ledger.open_account(Operation("op-2", "rabbitmq", 5))
        assert ledger.write("op-2", 5, token=10, idempotent=False) == "applied"
        assert ledger.write("op-2", 5, token=9, idempotent=False) == "fenced"
        # the bare fenced increment: a re-run under a larger token passes the fence and adds again
        assert ledger.write("op-2", 5, token=11, idempotent=False) == "applied"
        assert ledger.rows("SELECT balance FROM {accounts} WHERE id = 'op-2'") == [(10,)]
    finally:
        ledger.drop()
        ledger.close()


def test_a_rerun_is_attributed_to_the_fault_between_the_two_runs() -> None:
    kill = Fault("sigkill", "rabbitmq-0", ("rabbitmq",), start=100.0, pids=(42,))
    restart = Fault("redis_restart", "redis", ("rabbitmq",), start=200.0)
    assert attribute((42, 99.9), 103.0, [kill, restart], lease=2.0).startswith("sigkill of pid 42")
    assert attribute((43, 99.9), 103.0, [kill, restart], lease=2.0) == "unexplained"  # another process
    assert attribute((43, 198.5), 204.0, [kill, restart], lease=2.0).startswith("redis_restart")
    assert attribute((43, 300.0), 304.0, [kill, restart], lease=2.0, lease_lost=True).startswith("lease expired")


def test_a_rerun_after_redis_lost_its_data_is_attributed_to_the_flush() -> None:
    flush = Fault("redis_flush", "redis", ("celery",), start=500.0)
    assert attribute((43, 100.0), 520.0, [flush], lease=2.0).startswith("redis_flush")  # long before it
    assert attribute((43, 501.0), 520.0, [flush], lease=2.0) == "unexplained"  # both after it


def test_the_plain_write_inside_atomic_commits_once(postgres_dsn: str, redis_client: Any, namespace: str) -> None:
    from dedupe_worker import Deduplicator, Reason, decide
    from dedupe_worker.sql import SqlOutcomes

    ledger = Ledger(postgres_dsn, f"t{uuid.uuid4().hex[:8]}")
    ledger.create()
    try:
        outcomes = SqlOutcomes(postgres_dsn, table=ledger.outcomes)
        outcomes.create_table()
        dedupe = Deduplicator(redis_client, namespace=namespace, outcomes=outcomes)
        ledger.open_account(Operation("op-1", "rabbitmq", 5))
        first = dedupe.run("op-1", lambda: ledger.write_plain("op-1", 5, dedupe_token()))
        dedupe.forget("op-1")
        again = decide(dedupe, "op-1", lambda: ledger.write_plain("op-1", 5, dedupe_token()))
        assert again.reason is Reason.DUPLICATE and again.value == first
        assert ledger.rows("SELECT balance FROM {accounts} WHERE id = 'op-1'") == [(5,)]
        phases = [p for (p,) in ledger.rows("SELECT phase FROM {invocations} ORDER BY seq")]
        assert phases == ["applied", "already_applied"]
        dedupe.close()
    finally:
        ledger.drop()
        ledger.close()


def dedupe_token() -> int:
    from dedupe_worker import current_claim

    claim = current_claim()
    assert claim is not None
    return claim.token
