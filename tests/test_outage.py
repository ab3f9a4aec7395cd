"""Redis down: StoreUnavailable, and the handler never runs (unless fail_open)."""

from __future__ import annotations

import logging

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from dedupe_worker import Action, Deduplicator, Reason, StoreUnavailable, decide, decide_many

from .services import RedisServer, free_port


def closed_port_client() -> redis.Redis:
    return redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))


def test_closed_port_gives_store_unavailable_and_runs_nothing() -> None:
    d = Deduplicator(closed_port_client())
    calls: list[int] = []
    with pytest.raises(StoreUnavailable):
        d.run("k", lambda: calls.append(1))
    with pytest.raises(StoreUnavailable):
        d.begin_many(["a", "b"])
    decision = decide(d, "k", lambda: calls.append(1))
    assert decision.action is Action.DEFER and decision.reason is Reason.STORE_UNAVAILABLE
    assert [x.reason for x in decide_many(d, [("a", None, lambda: calls.append(1))])] == [Reason.STORE_UNAVAILABLE]
    assert calls == []


def test_server_stopped_mid_stream_then_back(private_redis: RedisServer) -> None:
    d = Deduplicator.from_url(private_redis.url, lease=5)  # the URL path's quick retry policy
    calls: list[str] = []
    assert d.run("before", lambda: calls.append("before") or 1) == 1
    private_redis.stop()
    with pytest.raises(StoreUnavailable):
        d.run("during", lambda: calls.append("during"))
    private_redis.start()  # same port, empty: nothing was persisted
    assert d.run("after", lambda: calls.append("after") or 3) == 3
    assert calls == ["before", "after"]
    d.close()


def test_fail_open_runs_the_handler_loudly(caplog: pytest.LogCaptureFixture) -> None:
    d = Deduplicator(closed_port_client(), fail_open=True)
    with caplog.at_level(logging.ERROR):
        assert d.run("k", lambda: "ran anyway") == "ran anyway"
    assert "WITHOUT deduplication" in caplog.text
    assert decide(d, "k", lambda: 5).reason is Reason.APPLIED
