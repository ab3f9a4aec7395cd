"""Per-message retention: ``ttl=`` on ``begin``/``begin_many``, ``run``, ``decide``,
``decide_many`` and ``@idempotent``, sync and asyncio, on a real Redis. The result key's PTTL
shows the ttl used; the client's ``result_ttl`` is 60 s, so a short ttl and a long one are both
told apart from it."""

from __future__ import annotations

import json
import re

import pytest
import redis

import dedupe_worker
from dedupe_worker import Deduplicator, Reason, decide, decide_many, idempotent
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.cli import main

from .async_fixtures import adedupe, aredis

__all__ = ["adedupe", "aredis"]


def outcome_pttl(redis_client: redis.Redis, stem: str) -> int:
    """The remaining ms of the outcome stored for ``stem``, in whichever record format it is (-2: none)."""
    ms = int(redis_client.pttl(KeyLayout.record(stem)))
    return ms if ms != -2 else int(redis_client.pttl(KeyLayout.result(stem)))


def pttl(redis_client: redis.Redis, dedupe: Deduplicator | AsyncDeduplicator, key: str) -> int:
    """The remaining ms of ``key``'s outcome record."""
    return outcome_pttl(redis_client, dedupe.request(key).stem)


def assert_kept(ms: int, seconds: float) -> None:
    """``ms`` (a PTTL) is ``seconds`` less the test's own run time."""
    assert seconds * 1000 - 5000 < ms <= seconds * 1000, ms


def test_run_keeps_the_outcome_for_its_ttl(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    assert dedupe.run("short", lambda: 1, ttl=7) == 1
    assert dedupe.run("long", lambda: 2, ttl=3600) == 2
    assert dedupe.run("default", lambda: 3) == 3
    assert_kept(pttl(redis_client, dedupe, "short"), 7)
    assert_kept(pttl(redis_client, dedupe, "long"), 3600)
    assert_kept(pttl(redis_client, dedupe, "default"), 60)
    assert dedupe.run("short", lambda: 9, ttl=7) == 1  # still a duplicate


def test_begin_carries_the_ttl_to_complete_and_fail(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    claim = dedupe.begin("c", ttl=9)
    assert claim.ttl == 9
    dedupe.complete(claim, "v")
    assert_kept(pttl(redis_client, dedupe, "c"), 9)
    failed = dedupe.begin("f", ttl=11)
    dedupe.fail(failed, "broken")
    assert_kept(pttl(redis_client, dedupe, "f"), 11)
    override = dedupe.begin("o", ttl=11)
    dedupe.complete(override, "v", ttl=13)  # the call's own ttl wins
    assert_kept(pttl(redis_client, dedupe, "o"), 13)


def test_begin_many_and_complete_many(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    claims = dedupe.begin_many(["a", "b"], ttl=17)
    assert [c.ttl for c in claims] == [17, 17]
    other = dedupe.begin("c")
    assert dedupe.complete_many([(claims[0], 1), (other, 2), (claims[1], 3)]) == [True, True, True]
    assert_kept(pttl(redis_client, dedupe, "a"), 17)
    assert_kept(pttl(redis_client, dedupe, "b"), 17)
    assert_kept(pttl(redis_client, dedupe, "c"), 60)


def test_a_released_key_keeps_its_token_counter_as_long_as_its_ttl(dedupe: Deduplicator,
                                                                  redis_client: redis.Redis) -> None:
    """A ttl longer than ``retention`` (here ``result_ttl``, 60 s) keeps the started key (the
    token counter) at least as long, on claim and after a release."""
    claim = dedupe.begin("r", ttl=3600)
    started = dedupe.layout.started(claim.stem)
    assert_kept(int(redis_client.pttl(started)), 3600)
    dedupe.release(claim)
    assert_kept(int(redis_client.pttl(started)), 3600)
    again = dedupe.begin("r", ttl=3600)
    assert again.token > claim.token and again.reclaimed


def test_decide_and_decide_many(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    assert decide(dedupe, "d", lambda: 1, ttl=19).reason is Reason.APPLIED
    assert_kept(pttl(redis_client, dedupe, "d"), 19)
    decisions = decide_many(dedupe, [("m1", None, lambda: 1), ("m2", None, lambda: 2), ("m3", None, lambda: 3)],
                            ttl=[23, None, 29])
    assert [d.reason for d in decisions] == [Reason.APPLIED] * 3
    assert_kept(pttl(redis_client, dedupe, "m1"), 23)
    assert_kept(pttl(redis_client, dedupe, "m2"), 60)
    assert_kept(pttl(redis_client, dedupe, "m3"), 29)
    decide_many(dedupe, [("n1", None, lambda: 1), ("n2", None, lambda: 2)], ttl=31)
    assert_kept(pttl(redis_client, dedupe, "n2"), 31)
    with pytest.raises(ValueError):
        decide_many(dedupe, [("x", None, lambda: 1)], ttl=[1, 2])
    with pytest.raises(ValueError):
        decide_many(dedupe, [("x", None, lambda: 1)], ttl=-1)


def test_a_handler_error_releases_with_the_ttl_s_retention(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    def broken() -> None:
        raise RuntimeError("no")

    decisions = decide_many(dedupe, [("e", None, broken)], ttl=3600)
    assert decisions[0].reason is Reason.HANDLER_ERROR
    assert_kept(int(redis_client.pttl(dedupe.layout.started(dedupe.request("e").stem))), 3600)


def test_idempotent_with_a_ttl(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    @idempotent(dedupe, key="order:{n}", ttl=37)
    def fixed(n: int) -> int:
        return n

    @idempotent(dedupe, key="call:{n}", ttl=lambda n: 41 if n else None)
    def chosen(n: int) -> int:
        return n

    assert fixed(1) == 1 and chosen(1) == 1 and chosen(0) == 0
    assert_kept(pttl(redis_client, dedupe, "order:1"), 37)
    assert_kept(pttl(redis_client, dedupe, "call:1"), 41)
    assert_kept(pttl(redis_client, dedupe, "call:0"), 60)
    with pytest.raises(ValueError):
        idempotent(dedupe, key="k", ttl=0)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "10", True])
def test_a_bad_ttl_is_refused_before_anything_is_claimed(dedupe: Deduplicator, redis_client: redis.Redis,
                                                         bad: object) -> None:
    with pytest.raises(ValueError):
        dedupe.run("bad", lambda: 1, ttl=bad)  # type: ignore[arg-type]
    assert not redis_client.exists(dedupe.layout.started(dedupe.request("bad").stem))


@pytest.mark.asyncio
async def test_asyncio_paths(adedupe: AsyncDeduplicator, redis_client: redis.Redis) -> None:
    async def value(n: int) -> int:
        return n

    assert await adedupe.run("ar", value, 1, ttl=43) == 1
    assert_kept(pttl(redis_client, adedupe, "ar"), 43)
    claim = await adedupe.begin("ab", ttl=47)
    await adedupe.complete(claim, 1)
    assert_kept(pttl(redis_client, adedupe, "ab"), 47)
    claims = await adedupe.begin_many(["am1", "am2"], ttl=53)
    await adedupe.complete_many([(c, 1) for c in claims])
    assert_kept(pttl(redis_client, adedupe, "am2"), 53)
    decision = await dedupe_worker.asyncio.decide(adedupe, "ad", lambda: value(2), ttl=59)
    assert decision.reason is Reason.APPLIED
    assert_kept(pttl(redis_client, adedupe, "ad"), 59)
    decisions = await dedupe_worker.asyncio.decide_many(
        adedupe, [("adm1", None, lambda: value(1)), ("adm2", None, lambda: value(2))], ttl=[61, 67])
    assert [d.reason for d in decisions] == [Reason.APPLIED] * 2
    assert_kept(pttl(redis_client, adedupe, "adm1"), 61)
    assert_kept(pttl(redis_client, adedupe, "adm2"), 67)

    @dedupe_worker.asyncio.idempotent(adedupe, key="ai:{n}", ttl=71)
    async def decorated(n: int) -> int:
        return n

    assert await decorated(3) == 3
    assert_kept(pttl(redis_client, adedupe, "ai:3"), 71)


def test_inspect_shows_each_key_s_remaining_ttl(dedupe: Deduplicator, capsys: pytest.CaptureFixture[str],
                                                redis_url: str, namespace: str) -> None:
    dedupe.run("short", lambda: 1, ttl=30)
    dedupe.run("long", lambda: 2, ttl=7200)
    assert main(["inspect", "--redis-url", redis_url, "--namespace", namespace, "--json", "short", "long"]) == 0
    short, long = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert_kept(short["result_ttl_ms"], 30)
    assert_kept(long["result_ttl_ms"], 7200)
    assert main(["inspect", "--redis-url", redis_url, "--namespace", namespace, "long"]) == 0
    assert re.search(r"kept 7,(19\d|200)\.\d s more", capsys.readouterr().out)


def test_stats_prints_one_projection_and_what_it_assumes(dedupe: Deduplicator, capsys: pytest.CaptureFixture[str],
                                                         redis_url: str, namespace: str) -> None:
    for n in range(10):
        dedupe.run(f"k{n}", lambda n=n: n, ttl=3600)
    common = ["stats", "--redis-url", redis_url, "--namespace", namespace, "--rate", "10"]
    # every outcome kept less than the result TTL: the result TTL is the assumption
    assert main([*common, "--result-ttl", "86400", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["retention"] == 86400 and report["retention_from"] == "result_ttl"
    assert report["projection_bytes"] == int(10 * 86400 * report["bytes_per_key"]) > 0
    assert "sampled_projection_bytes" not in report
    # per-message ttls above the result TTL: the longest remaining one sampled
    assert main([*common, "--result-ttl", "60", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert 3590 < report["retention"] <= 3600 and report["retention_from"] == "sampled"
    assert report["projection_bytes"] == int(10 * report["retention"] * report["bytes_per_key"])
    assert main([*common, "--result-ttl", "60"]) == 0
    out = capsys.readouterr().out
    assert out.count("projection") == 1 and out.count(" bytes = 10 msg/s x 3,") == 1
    assert "assuming               10 new keys/s (--rate), each outcome kept 3," in out
    assert "above the result TTL of 60 s" in out
