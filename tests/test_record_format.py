"""Record format 2 (the compact string result at the key's stem) through the public paths: sync and asyncio, one key
and batches, the switch read from the environment. The format's layout and its rolling upgrade
are tested in ``test_lua_compat.py``."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import redis.asyncio

from bench.core import completed_key_memory
from dedupe_worker import Deduplicator, Envelope, Outcome, Stored, decide_many
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker._protocol.serialization import MARK
from dedupe_worker._transport.record import parse_result
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.keys import header_key
from dedupe_worker.replay import Planner, Step

from .async_fixtures import aredis
from .replay_fixtures import apply_before

__all__ = ["aredis"]


def _result(client: redis.Redis, d: Deduplicator | AsyncDeduplicator, key: str) -> bytes:
    """The format-2 record of ``key``: a string at its stem, and no format-1 hash beside it."""
    stem = d.request(key).stem
    raw = client.get(KeyLayout.record(stem))
    assert isinstance(raw, bytes)
    assert not client.exists(KeyLayout.result(stem), KeyLayout.started(stem))
    return raw


def test_the_switch_is_read_from_the_environment(
        redis_client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEDUPE_RECORD_FORMAT", raising=False)  # the suite may run with it set
    assert Deduplicator(redis_client, namespace=namespace).store.record_format == 2
    monkeypatch.setenv("DEDUPE_RECORD_FORMAT", "1")  # a mixed rollout: an earlier release still reads
    assert Deduplicator(redis_client, namespace=namespace).store.record_format == 1
    monkeypatch.setenv("DEDUPE_RECORD_FORMAT", "2")
    assert Deduplicator(redis_client, namespace=namespace).store.record_format == 2
    monkeypatch.setenv("DEDUPE_RECORD_FORMAT", "3")
    with pytest.raises(ValueError, match="DEDUPE_RECORD_FORMAT"):
        Deduplicator(redis_client, namespace=namespace)


def test_a_completed_key_costs_at_most_144_bytes_by_default(
        redis_client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch, server_kind: str) -> None:
    """The bench's own ``MEMORY USAGE`` probe (``bench.core``), on a deduplicator built with no
    switch set. The 144 bytes are Redis's figure; Valkey 8 counts a key's overhead differently (both
    formats can land in the same allocation size), so there the default is held to costing no more
    than format 1."""
    monkeypatch.delenv("DEDUPE_RECORD_FORMAT", raising=False)
    d = Deduplicator(redis_client, namespace=namespace)
    by_default = completed_key_memory(d, redis_client)
    monkeypatch.setenv("DEDUPE_RECORD_FORMAT", "1")  # format 1 (the hash every release reads) costs more
    in_format_1 = completed_key_memory(Deduplicator(redis_client, namespace=f"{namespace}-f1"), redis_client)
    assert by_default <= in_format_1
    if server_kind == "redis":
        assert by_default <= 144 < in_format_1
    d.close()


def test_one_key_and_batches_in_format_2(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0)
    d.store.write_format(2)
    calls = []
    assert d.run("one", lambda: calls.append(1) or {"charged": 100}) == {"charged": 100}
    assert d.run("one", lambda: calls.append(2) or {"charged": 999}) == {"charged": 100}
    assert calls == [1]
    stored = parse_result(_result(redis_client, d, "one"))
    assert stored.status == b"c" and stored.value == b'{"charged":100}'
    claims = d.begin_many([f"k{i}" for i in range(5)])
    assert [c.outcome for c in claims] == [Outcome.ACQUIRED] * 5
    assert d.complete_many([(c, {"n": i}) for i, c in enumerate(claims)]) == [True] * 5
    assert d.complete_many([(c, {"n": -1}) for c in claims]) == [True] * 5  # a retry answers as the first
    again = d.begin_many([f"k{i}" for i in range(5)])
    assert [(c.outcome, c.token) for c in again] == [(Outcome.DUPLICATE, c.token) for c in claims]
    assert [parse_result(_result(redis_client, d, f"k{i}")).token for i in range(5)] == [c.token for c in claims]
    status = d.status("k3")
    assert status.status is Stored.COMPLETED and status.token == claims[3].token
    d.close()


@pytest.mark.asyncio
async def test_asyncio_in_format_2(aredis: redis.asyncio.Redis, redis_client: redis.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=5.0, result_ttl=60.0)
    d.store.write_format(2)

    async def charge() -> dict[str, int]:
        return {"charged": 100}

    assert await d.run("a", charge) == {"charged": 100}
    claim = await d.begin("a")
    assert claim.outcome is Outcome.DUPLICATE
    assert parse_result(_result(redis_client, d, "a")) == (b"c", claim.token, b'{"charged":100}', b"", b"")
    await d.aclose()


def test_a_compressed_result_in_format_2_reads_back_in_both_formats(redis_client: redis.Redis, namespace: str) -> None:
    writer = Deduplicator(redis_client, namespace=namespace, lease=5.0, compress_above=64)
    writer.store.write_format(2)
    big = {"rows": ["the same row of a large result"] * 200}
    assert writer.run("big", lambda: big) == big
    stored = parse_result(_result(redis_client, writer, "big"))
    assert stored.value[:1] == MARK and len(stored.value) < 1000  # the codec's bytes, inside the record
    reader = Deduplicator(redis_client, namespace=namespace, lease=5.0)
    reader.store.write_format(1)  # writes format 1, reads both
    assert reader.run("big", lambda: {"ran": "again"}) == big
    writer.close()
    reader.close()


def test_the_replay_reads_the_fingerprint_of_either_format_in_one_batch(
        redis_client: redis.Redis, namespace: str) -> None:
    f1 = Deduplicator(redis_client, namespace=namespace, lease=5.0)
    f1.store.write_format(1)
    f2 = Deduplicator(redis_client, namespace=namespace, lease=5.0)
    f2.store.write_format(2)
    apply_before(f1, "one", b'{"id": 1}')
    apply_before(f2, "two", b'{"id": 2}')
    assert redis_client.type(KeyLayout.record(f2.request("two").stem)) == b"string"
    assert redis_client.type(KeyLayout.result(f1.request("one").stem)) == b"hash"
    messages = [(Envelope(body=body, headers={"idempotency-key": key}), "handler_error")
                for key, body in (("one", b'{"id": 1}'), ("two", b'{"id": 2}'),
                                  ("one", b'{"id": 9}'), ("two", b'{"id": 9}'))]
    entries = Planner(f1, header_key()).judge_many(messages)
    assert [(e.state, e.step) for e in entries] == [
        ("applied", Step.DROP), ("applied", Step.DROP), ("conflict", Step.LEAVE), ("conflict", Step.LEAVE)]
    f1.close()
    f2.close()


def test_workers_writing_formats_1_and_2_racing_leave_one_record_per_key(
        redis_client: redis.Redis, redis_url: str, namespace: str) -> None:
    """Mid-switch, a worker writing format 1 and one writing format 2 race over the same 300 keys
    (each key sent to both, each batch in its own order, twice): every key runs once, and holds
    exactly one outcome record, in the format of the worker that ran it, which both read."""
    import collections
    import random
    import threading

    keys = [f"race-{i}" for i in range(300)]
    ran: collections.Counter[tuple[int, str]] = collections.Counter()
    lock = threading.Lock()
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker(record_format: int) -> None:
        d = Deduplicator(redis.Redis.from_url(redis_url), namespace=namespace, lease=5.0, result_ttl=60.0)
        d.store.write_format(record_format)
        order = random.Random(record_format).sample(keys, len(keys))

        def handler(key: str) -> Any:
            with lock:
                ran[(record_format, key)] += 1
            return {"by": record_format}

        try:
            start.wait(10)
            for _ in range(2):
                for i in range(0, len(order), 50):
                    chunk = order[i:i + 50]
                    decide_many(d, [(k, None, (lambda k=k: handler(k))) for k in chunk])
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            d.close()

    threads = [threading.Thread(target=worker, args=(f,)) for f in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    by_key = collections.Counter(key for _, key in ran.elements())
    assert by_key == {key: 1 for key in keys}  # deferred copies aside, each key ran once in all
    assert all(sum(n for (f, _), n in ran.items() if f == fmt) > 0 for fmt in (1, 2))  # both won some
    reader = Deduplicator(redis_client, namespace=namespace)
    for key in keys:
        stem = reader.request(key).stem
        formats = [f for f in (1, 2) if ran[(f, key)]]
        held = [redis_client.exists(KeyLayout.result(stem)), redis_client.exists(KeyLayout.record(stem))]
        assert held == ([1, 0] if formats == [1] else [0, 1]), (key, formats, held)
        assert reader.begin(key).result == {"by": formats[0]}
    reader.close()
