"""Compressed results: stored compressed over ``compress_above`` bytes, read back byte-exact by
every reader (sync, asyncio, inspect, the replay, the send-side check, SQL outcomes, the test
double), values stored uncompressed by the previous release still read, and ``max_result_bytes``
counted on the stored size. On a real Redis (and PostgreSQL for the SQL outcomes)."""

from __future__ import annotations

import base64
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import psycopg
import pytest
import redis

from dedupe_worker import OMITTED, DedupeSettings, Deduplicator, Envelope, Reason, decide
from dedupe_worker._operate import describe
from dedupe_worker._protocol.sending import SendState
from dedupe_worker._protocol.serialization import CODECS, MARK, JsonSerializer, Packer, unpack
from dedupe_worker._transport.sending import check_send
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.cli import main
from dedupe_worker.http import IdempotencyMiddleware, current_claim
from dedupe_worker.keys import body_fingerprint, header_key
from dedupe_worker.replay import Planner, Step
from dedupe_worker.sql import atomic
from dedupe_worker.sql._statements import stored_key
from dedupe_worker.testing import in_memory

from .sql_fixtures import Tables, pg
from .test_http_inprocess import call, replayed, scope

__all__ = ["pg"]  # fixture used by name


def codec_available(codec: str) -> str:
    """``codec``, or a skip where zstd is missing (a failure under CI: the test extra has it)."""
    if codec not in CODECS:
        if os.environ.get("CI"):
            pytest.fail("zstandard is not installed: the test extra installs it")
        pytest.skip("zstandard is not installed")
    return codec


@pytest.fixture(params=["zlib", "zstd"])
def codec(request: pytest.FixtureRequest) -> str:
    return codec_available(request.param)


def order(lines: int = 120) -> dict[str, Any]:
    """A JSON result of about 10 KB (``lines=120``), as a real handler returns: compresses well."""
    return {"order": "o-1", "lines": [{"sku": f"SKU-{i:05d}", "name": f"widget number {i}", "qty": i % 7,
                                       "price": round(i * 1.25, 2), "tags": ["blue", "large"]}
                                      for i in range(lines)]}


def stored_value(client: redis.Redis, d: Deduplicator | AsyncDeduplicator, key: str) -> bytes:
    """The bytes the result record holds for ``key``, as Redis has them (``inspect.lua``)."""
    reader = Deduplicator(client, namespace=d.layout.namespace)
    value = reader.store.inspect(d.request(key).stem).value
    return value if isinstance(value, bytes) else b""


# -- the codec, without Redis --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["zlib", "zstd"])
def test_packer_round_trips_and_marks_its_codec(name: str) -> None:
    packer = Packer(1024, codec_available(name))
    data = orjson.dumps(order())
    packed = packer.pack(data)
    assert packed[:1] == MARK and packed[1:2] == (b"s" if name == "zstd" else b"z")
    assert len(packed) < len(data) // 4 and unpack(packed) == data


@pytest.mark.parametrize("name", ["zlib", "zstd"])
def test_threads_pack_and_unpack_at_once(name: str) -> None:
    packer = Packer(0, codec_available(name))
    datas = [orjson.dumps(order(50 + i)) for i in range(8)]

    def round_trips(data: bytes) -> bool:
        return all(unpack(packer.pack(data)) == data for _ in range(200))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(round_trips, datas))


def test_just_under_and_just_over_the_threshold() -> None:
    packer = Packer(1024)
    at = b'"' + b"x" * 1022 + b'"'  # 1024 bytes: not over
    over = b'"' + b"x" * 1023 + b'"'
    assert packer.pack(at) == at
    assert packer.pack(over)[:1] == MARK and unpack(packer.pack(over)) == over
    assert Packer(None).pack(over) == over  # never


def test_a_value_compression_does_not_shrink_is_stored_as_it_is() -> None:
    noise = b"[" + random.Random(1).randbytes(3000)  # what no codec shrinks
    assert len(Packer(0, "zlib").pack(noise)) <= len(noise) and Packer(0, "zlib").pack(noise) == noise


def test_plain_json_of_the_previous_release_passes_through() -> None:
    for old in (b'{"a":1}', b"null", b"[1,2]", b'"x"', b"12", b" {}"):
        assert unpack(old) == old


def test_a_custom_serializer_whose_output_starts_with_the_mark_stays_unambiguous() -> None:
    data = MARK + b"z-not-zlib"
    packed = Packer(1024).pack(data)
    assert packed != data and unpack(packed) == data


def test_an_unknown_mark_or_a_corrupted_value_raises() -> None:
    with pytest.raises(ValueError, match="unknown compression mark"):
        unpack(MARK + b"?abc")
    with pytest.raises(Exception):  # noqa: B017 - zlib.error, a ValueError subclass in zstandard
        unpack(MARK + b"z" + b"not deflate")


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="compression must be"):
        Packer(10, "lz4")
    with pytest.raises(ValueError, match="negative"):
        Packer(-1)


# -- the clients, on Redis -----------------------------------------------------------------------

def test_sync_reads_back_a_compressed_result_byte_exact(redis_client: redis.Redis, namespace: str,
                                                         codec: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, result_ttl=60, compression=codec)
    value = order()
    assert len(orjson.dumps(value)) > 9000
    assert d.run("big", lambda: value) == value
    raw = stored_value(redis_client, d, "big")
    assert raw[:1] == MARK and len(raw) < 3000
    again = d.begin("big")
    assert again.result == value and orjson.dumps(again.result) == orjson.dumps(value)
    assert d.run("big", lambda: "never") == value
    d.close()


def test_a_batch_stores_and_reads_compressed_results(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    values = [order(100 + i) for i in range(3)] + ["small"]
    keys = [f"b{i}" for i in range(len(values))]
    claims = dedupe.begin_many(keys)
    assert dedupe.complete_many(list(zip(claims, values, strict=True))) == [True] * len(values)
    assert [stored_value(redis_client, dedupe, k)[:1] == MARK for k in keys] == [True, True, True, False]
    assert [c.result for c in dedupe.begin_many(keys)] == values


def test_just_under_and_just_over_the_threshold_on_redis(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, result_ttl=60)
    under, over = "y" * 1022, "y" * 1023  # JSON of 1024 and 1025 bytes
    d.run("under", lambda: under)
    d.run("over", lambda: over)
    assert stored_value(redis_client, d, "under") == orjson.dumps(under)
    assert stored_value(redis_client, d, "over")[:1] == MARK
    assert d.begin("under").result == under and d.begin("over").result == over
    d.close()


def test_a_result_stored_by_the_previous_release_still_reads(redis_client: redis.Redis, namespace: str) -> None:
    old = Deduplicator(redis_client, namespace=namespace, result_ttl=60, compress_above=None)  # plain JSON
    value = order()
    old.run("old", lambda: value)
    assert stored_value(redis_client, old, "old") == orjson.dumps(value)
    new = Deduplicator(redis_client, namespace=namespace, result_ttl=60)
    assert new.begin("old").result == value
    # and the other way round: a value over the threshold written now is compressed
    new.run("new", lambda: value)
    assert stored_value(redis_client, new, "new")[:1] == MARK
    old.close()
    new.close()


def test_max_result_bytes_counts_the_stored_compressed_size(redis_client: redis.Redis, namespace: str) -> None:
    value = order()  # ~10 KB of JSON, well under 2000 bytes compressed
    fits = Deduplicator(redis_client, namespace=namespace, result_ttl=60, max_result_bytes=2000)
    assert fits.run("k1", lambda: value) == value
    assert fits.begin("k1").result == value
    plain = Deduplicator(redis_client, namespace=namespace, result_ttl=60, max_result_bytes=2000,
                         compress_above=None)
    plain.run("k2", lambda: value)
    assert plain.begin("k2").result is OMITTED
    # a result still over the limit once compressed is stored as omitted, as before
    noise = base64.b64encode(random.Random(2).randbytes(6000)).decode()
    assert fits.run("k3", lambda: noise) == noise
    assert fits.begin("k3").result is OMITTED
    fits.close()
    plain.close()


def test_a_stored_failure_over_the_threshold_is_compressed_and_reads(dedupe: Deduplicator,
                                                                    redis_client: redis.Redis) -> None:
    claim = dedupe.begin("failed")
    dedupe.fail(claim, ValueError("declined " * 300))
    assert stored_value(redis_client, dedupe, "failed")[:1] == MARK
    again = dedupe.begin("failed")
    assert again.failed and again.error == {"type": "builtins.ValueError", "message": "declined " * 300}


@pytest.mark.asyncio
async def test_asyncio_reads_back_a_compressed_result_byte_exact(redis_url: str, redis_client: redis.Redis,
                                                                 namespace: str, codec: str) -> None:
    d = AsyncDeduplicator.from_url(redis_url, namespace=namespace, result_ttl=60, compression=codec)
    value = order()

    async def handler() -> Any:
        return value

    assert await d.run("big", handler) == value
    assert stored_value(redis_client, d, "big")[:1] == MARK
    again = await d.begin("big")
    assert again.result == value and orjson.dumps(again.result) == orjson.dumps(value)
    # what the sync client wrote, the asyncio one reads (and back)
    sync = Deduplicator(redis_client, namespace=namespace, result_ttl=60, compression=codec)
    sync.run("from-sync", lambda: value)
    assert (await d.begin("from-sync")).result == value
    await d.run("from-async", handler)
    assert sync.begin("from-async").result == value
    sync.close()
    await d.aclose()


# -- the other readers ---------------------------------------------------------------------------

def test_inspect_shows_the_decompressed_result(dedupe: Deduplicator, redis_client: redis.Redis,
                                               capsys: pytest.CaptureFixture[str], redis_url: str,
                                               namespace: str) -> None:
    value = order()
    dedupe.run("big", lambda: value)
    assert stored_value(redis_client, dedupe, "big")[:1] == MARK
    report = describe(dedupe, "big")
    text = orjson.dumps(value).decode()
    assert report.state == "done" and report.result_preview.startswith(text[:120])
    assert f"({len(text)} chars)" in report.result_preview
    code = main(["inspect", "--redis-url", redis_url, "--namespace", namespace, "--json", "big"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["result_preview"] == report.result_preview


def test_the_replay_judges_a_compressed_outcome_applied(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    body = orjson.dumps(order())
    big = dedupe.begin("big", fingerprint=body_fingerprint(Envelope(body=body)))
    dedupe.complete(big, order())
    assert stored_value(redis_client, dedupe, "big")[:1] == MARK
    entry = Planner(dedupe, header_key()).judge(Envelope(body=body, headers={"idempotency-key": "big"}),
                                                "handler_error")
    assert (entry.state, entry.step) == ("applied", Step.DROP) and entry.token == big.token


def test_the_send_side_done_answer_carries_the_decompressed_value(dedupe: Deduplicator,
                                                                  redis_client: redis.Redis) -> None:
    value = order()
    dedupe.run("sent", lambda: value)
    assert stored_value(redis_client, dedupe, "sent")[:1] == MARK
    answer = check_send(dedupe, "sent", "task-1", ttl=5)
    assert answer.state is SendState.DONE and answer.claim is not None
    assert answer.claim.result == value and dedupe.answer(answer.claim) == value


def test_the_test_double_stores_compressed_and_reads_back() -> None:
    d = in_memory()
    value = order()
    assert d.run("k", lambda: value) == d.run("k", lambda: "never") == value
    value_stored = d.store.inspect(d.request("k").stem).value
    assert isinstance(value_stored, bytes) and value_stored[:1] == MARK


def test_the_option_is_read_from_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEDUPE_COMPRESS_ABOVE", "50")
    monkeypatch.setenv("DEDUPE_COMPRESSION", "zlib")
    options = DedupeSettings().client_options()
    assert options["compress_above"] == 50 and options["compression"] == "zlib"
    d = in_memory(**{k: options[k] for k in ("compress_above", "compression")})
    assert d.packer.above == 50 and d.packer.codec == "zlib"


# -- SQL outcomes --------------------------------------------------------------------------------

def test_sql_row_is_compressed_and_a_reclaim_is_answered_from_it(redis_client: redis.Redis, namespace: str,
                                                                  pg: Tables, postgres_dsn: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.3, renew_interval=60, result_ttl=60,
                     outcomes=pg.outcomes)
    value = order()
    runs: list[int] = []

    def handler() -> Any:
        runs.append(1)
        with psycopg.connect(postgres_dsn) as conn, atomic(conn) as outcome:
            outcome.result = value
        return value

    claim = d.begin("o-1")
    with d.hold(claim):  # commits, then the worker "dies" before complete()
        handler()
    with psycopg.connect(postgres_dsn) as conn:
        row = conn.execute(f"SELECT result FROM {pg.outcomes.table} WHERE dedupe_key = %s",
                           (stored_key(d.request("o-1").stem),)).fetchone()
    assert row is not None and bytes(row[0])[:1] == MARK and unpack(bytes(row[0])) == orjson.dumps(value)
    time.sleep(0.4)  # the lease runs out
    decision = decide(d, "o-1", handler)
    assert decision.reason is Reason.DUPLICATE and decision.value == value and runs == [1]
    # written back to Redis (compressed) and answered from there
    assert stored_value(redis_client, d, "o-1")[:1] == MARK
    assert d.begin("o-1").result == value
    d.close()


def test_the_default_serializer_is_untouched() -> None:
    assert JsonSerializer().dumps(order())[:1] == b"{"  # compression is the codec's, not the serializer's


# -- the HTTP layer ------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_an_http_response_is_replayed_byte_exact_through_both_compressions(
        redis_url: str, redis_client: redis.Redis, namespace: str) -> None:
    """The HTTP layer deflates its body before base64 (which the general compression cannot do as
    well), and the general compression then shrinks the base64 text: both, and the replay is exact."""
    body = orjson.dumps(order(600)) + bytes(range(256))  # not text: every byte value
    runs: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        runs.append(current_claim())
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"x/bytes")]})
        await send({"type": "http.response.body", "body": body})

    d = AsyncDeduplicator.from_url(redis_url, namespace=namespace, result_ttl=60)
    middleware = IdempotencyMiddleware(app, d, scope=lambda request: "tenant-1")
    first, again = await call(middleware, scope()), await call(middleware, scope())
    assert len(runs) == 1 and replayed(again) and not replayed(first)
    assert b"".join(m.get("body", b"") for m in again[1:]) == body
    reader = Deduplicator(redis_client, namespace=namespace)
    raw = reader.store.inspect(runs[0].stem).value
    assert isinstance(raw, bytes) and raw[:1] == MARK and orjson.loads(unpack(raw))["z"] == "deflate"
    assert len(raw) < len(orjson.dumps(orjson.loads(unpack(raw))))
    await d.aclose()
