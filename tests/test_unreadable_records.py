"""Every script reads only records it can parse: a key whose records are not ours (another
program's key of another type, a truncated format-2 string) is answered for that key alone, never
with a Lua error that fails the whole call, on both ways the scripts run (``FCALL`` of the
function library, ``EVALSHA``); ``forget --force`` removes whatever lies under a key's names; a
real consumer (RabbitMQ, Kafka) dead-letters that one message with its reason and goes on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis
from kombu import Connection

from dedupe_worker import Deduplicator, Outcome, Reason, StoreUnavailable, UnreadableRecord
from dedupe_worker._messages.deadletter import ERROR, REASON
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker._protocol.sending import SendState
from dedupe_worker._transport.script_flow import SCRIPTS_ENV
from dedupe_worker._transport.sending import check_send
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.asyncio import decide_many as decide_many_async
from dedupe_worker.kafka import DedupeKafkaConsumer
from dedupe_worker.rabbitmq import DedupeConsumer, dlq

from .async_fixtures import adedupe, aredis
from .kafka_fixtures import Topics, headers_of, kafka_topics, produce, read_topic
from .rabbitmq_fixtures import amqp, consumer_thread, dead_letters, depth, publish, queue_name, wait_for

__all__ = ["adedupe", "amqp", "aredis", "kafka_topics", "queue_name"]  # fixtures used by name


@pytest.fixture(params=["fcall", "eval"])
def dedupe(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis,
           namespace: str) -> Iterator[Deduplicator]:
    """A deduplicator whose scripts run as the function library (Redis 7+) or with EVALSHA."""
    if request.param == "eval":
        monkeypatch.setenv(SCRIPTS_ENV, "eval")
    else:
        monkeypatch.delenv(SCRIPTS_ENV, raising=False)
    d = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0)
    d.run("warm-up", lambda: None)
    assert d.store.scripts.flows.functions is (request.param == "fcall")
    yield d
    d.close()


def stem(d: Deduplicator, key: str) -> str:
    return d.request(key).stem


def test_claim_and_inspect_answer_the_unreadable_key_alone(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    redis_client.set(stem(dedupe, "b"), b"C" + bytes(8) + b"\x00\x09abc")  # fingerprint cut short
    claims = dedupe.begin_many(["a", "b", "c"])
    assert [c.outcome for c in claims] == [Outcome.ACQUIRED, Outcome.UNREADABLE, Outcome.ACQUIRED]
    assert isinstance(claims[1].error, UnreadableRecord) and "truncated (14 bytes)" in claims[1].error.detail
    with pytest.raises(UnreadableRecord, match="truncated"):
        dedupe.status("b")
    assert dedupe.status("a").state == "in_progress"


@pytest.mark.asyncio
async def test_the_asyncio_engine_sets_the_unreadable_message_aside_and_decides_the_rest(
        adedupe: AsyncDeduplicator, redis_client: redis.Redis) -> None:
    redis_client.rpush(adedupe.request("k2").stem, "another program's list")
    ran: list[str] = []

    async def handler(key: str) -> str:
        ran.append(key)
        return key

    keys = [f"k{i}" for i in range(8)]
    decisions = await decide_many_async(adedupe, [(k, None, (lambda k=k: handler(k))) for k in keys])
    assert [d.reason for d in decisions] == [Reason.APPLIED] * 2 + [Reason.UNREADABLE_RECORD] + [Reason.APPLIED] * 5
    assert "holds a list, not a string" in decisions[2].detail and "k2" not in ran and len(ran) == 7
    assert await adedupe.forget("k2", force=True)
    assert (await adedupe.begin("k2")).acquired


@pytest.mark.parametrize("record_format", [1, 2])
def test_complete_release_and_renew_answer_a_taken_over_key_alone(
        dedupe: Deduplicator, redis_client: redis.Redis, record_format: int) -> None:
    """Keys claimed, then another program's value of another type written over one key's started
    key (and over where the format written keeps another's outcome): completing, releasing and
    renewing the batch answers those keys "not ours" (nothing written for them) and the others as
    usual."""
    dedupe.store.write_format(record_format)
    claims = dedupe.begin_many(["a", "b", "c", "d"])
    assert all(c.acquired for c in claims)
    redis_client.set(KeyLayout.started(stem(dedupe, "b")), "taken")
    renew = dedupe.store.renew_calls([(c.stem, c.token) for c in claims], 5000, 60_000)
    assert [list(map(int, reply)) for reply in dedupe.store.scripts.call_all(renew)] == [[1, 0, 1, 1]]
    assert dedupe.release_many([claims[3], claims[1]]) == [True, False]
    # format 1 writes a hash at the result key (HSET on another type fails: "not ours"); format 2
    # one SET at the stem, which replaces whatever lies at that name of ours while c's claim is held
    outcome_name = KeyLayout.result if record_format == 1 else KeyLayout.record
    redis_client.rpush(outcome_name(stem(dedupe, "c")), "x")
    stored_c = record_format == 2
    assert dedupe.complete_many([(claims[0], 1), (claims[1], 2), (claims[2], 3)]) == [True, False, stored_c]
    assert redis_client.get(KeyLayout.started(stem(dedupe, "b"))) == b"taken"  # left as it was
    assert dedupe.begin("a").result == 1
    b, c = dedupe.begin_many(["b", "c"])
    assert b.outcome is Outcome.UNREADABLE
    assert (c.outcome, c.result) == ((Outcome.DUPLICATE, 3) if stored_c else (Outcome.UNREADABLE, None))


def test_complete_and_release_replace_a_notice_list_of_another_type(
        dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    for key, finish in (("done", lambda c: dedupe.complete(c, "v")), ("freed", dedupe.release)):
        claim = dedupe.begin(key)
        assert dedupe.store.watch(claim.stem) > 0  # one waiter counted
        redis_client.set(KeyLayout.notice(claim.stem), "not a list")
        finish(claim)
        assert redis_client.lrange(KeyLayout.notice(claim.stem), 0, -1) == [str(claim.token).encode()]


def test_watch_sends_a_waiter_back_to_claim_on_an_unreadable_key(
        dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    redis_client.set(KeyLayout.started(stem(dedupe, "x")), "taken")
    assert dedupe.store.watch(stem(dedupe, "x")) == 0
    claim = dedupe.begin("y")
    redis_client.hset(KeyLayout.started(claim.stem), "w", "many")  # a count we never kept
    assert dedupe.store.watch(claim.stem) > 0
    assert redis_client.hget(KeyLayout.started(claim.stem), "w") == b"1"
    assert dedupe.begin("x", wait=0.2).outcome is Outcome.UNREADABLE  # the wait ends, not loops


@pytest.mark.parametrize("suffix", ["", ":started", ":result", ":notice", ":sent"])
def test_forget_force_removes_whatever_lies_under_a_keys_names(
        dedupe: Deduplicator, redis_client: redis.Redis, suffix: str) -> None:
    base = stem(dedupe, "k")
    redis_client.sadd(base + suffix, "another program's set")
    redis_client.set(base if suffix else KeyLayout.started(base), "1")
    assert dedupe.begin("k").outcome is Outcome.UNREADABLE
    assert dedupe.store.forget(base, None, False)[0] == -3
    assert dedupe.store.forget(base, 5, True)[0] == -3  # a token cannot be checked on it
    assert redis_client.exists(base + suffix)
    assert dedupe.forget("k", force=True)
    assert not list(redis_client.scan_iter(match=f"{base}*"))
    assert dedupe.begin("k").acquired


def test_forget_with_token_0_removes_only_a_record_that_is_not_ours(
        dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    """What the HTTP layer does for a claim answered UNREADABLE (its token is 0): forced, the
    record is removed; a live lease or an outcome written since by a concurrent request carries a
    token, so a late second removal is refused and leaves it whole."""
    redis_client.set(stem(dedupe, "k"), b"1")
    unreadable = dedupe.begin("k")
    assert unreadable.outcome is Outcome.UNREADABLE and unreadable.token == 0
    assert not dedupe.forget("k", token=0)  # not forced
    assert dedupe.forget("k", token=unreadable.token, force=True)
    live = dedupe.begin("k")
    assert live.acquired
    assert not dedupe.forget("k", token=0, force=True)
    assert dedupe.status("k").token == live.token and dedupe.begin("k").outcome is Outcome.IN_PROGRESS
    dedupe.complete(live, "v")
    assert not dedupe.forget("k", token=0, force=True)
    assert dedupe.begin("k").result == "v"


def test_forget_finds_unreadable_whatever_claim_finds_unreadable(
        dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    """A readable format-2 record at the stem beside a set where format 1 keeps its hash: a worker
    reading format 1 first answers UNREADABLE, and ``forget.lua`` (which reads both) removes it
    with token 0."""
    dedupe.store.write_format(2)
    dedupe.run("k", lambda: "v")
    redis_client.sadd(KeyLayout.result(stem(dedupe, "k")), "another program's set")
    dedupe.store.write_format(1)
    assert dedupe.begin("k").outcome is Outcome.UNREADABLE
    assert dedupe.forget("k", token=0, force=True)
    assert dedupe.begin("k").acquired


def test_a_send_check_on_an_unreadable_key_raises_for_that_send_alone(
        dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    """The producer's check is a hint: an unreadable record is StoreUnavailable for that send (the
    producer publishes), and the worker's claim dead-letters the message."""
    redis_client.set(stem(dedupe, "s"), b"1")
    with pytest.raises(StoreUnavailable, match="UNREADABLE"):
        check_send(dedupe, "s", "task-1", ttl=5)
    assert check_send(dedupe, "t", "task-2", ttl=5).state is SendState.PUBLISH


def test_a_rabbitmq_consumer_dead_letters_the_unreadable_message_and_decides_the_rest(
        amqp: Connection, queue_name: str, redis_client: redis.Redis, namespace: str) -> None:
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0)
    redis_client.set(stem(dedupe, "order-3"), b"C" + bytes(8) + b"\x00\x40fp")  # truncated format 2
    applied: list[str] = []

    def handler(body: Any, message: Any) -> str:
        applied.append(body["id"])
        return str(body["id"])

    for n in range(8):
        publish(amqp, queue_name, orjson.dumps({"id": f"m{n}"}), headers={"idempotency-key": f"order-{n}"})
    consumer = DedupeConsumer(amqp.clone(), [queue_name], handler, dedupe, prefetch_count=8)
    with consumer_thread(consumer):
        wait_for(lambda: len(applied) >= 7 and depth(amqp, dlq(queue_name)) == 1, what="7 applied, 1 set aside")
    [letter] = dead_letters(amqp, queue_name)
    assert sorted(applied) == [f"m{n}" for n in range(8) if n != 3]
    assert letter.headers["x-dedupe-reason"] == Reason.UNREADABLE_RECORD.value
    assert "truncated" in letter.headers["x-dedupe-error"] and orjson.loads(letter.body) == {"id": "m3"}
    assert depth(amqp, queue_name) == 0
    dedupe.close()


def test_a_kafka_consumer_dead_letters_the_unreadable_record_and_commits_past_the_batch(
        kafka_bootstrap: str, kafka_topics: Topics, redis_client: redis.Redis, namespace: str) -> None:
    """A partition is never held by a record that will not heal: the unreadable key's record goes
    to ``<topic>.dlq`` with its reason, the 7 others are applied, the group commits past all 8."""
    from .test_kafka import body, config, consume_all

    topic = kafka_topics.create(partitions=1)
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0)
    redis_client.set(KeyLayout.started(stem(dedupe, "order-5")), b"1")  # a string where a hash belongs
    records = [(0, None, body(f"m{n}"), [("idempotency-key", f"order-{n}".encode())]) for n in range(8)]
    positions = produce(kafka_bootstrap, topic, records)
    applied: list[str] = []
    consumer = DedupeKafkaConsumer(config(kafka_bootstrap), [topic],
                                   lambda msg: applied.append(orjson.loads(msg.value())["id"]), dedupe,
                                   batch_size=500, poll_timeout=0.2)
    try:
        consume_all(consumer, positions)
    finally:
        dedupe.close()
    assert sorted(applied) == [f"m{n}" for n in range(8) if n != 5]
    [letter] = read_topic(kafka_bootstrap, f"{topic}.dlq", expected=1)
    assert headers_of(letter)[REASON] == "unreadable_record" and letter.value() == body("m5")
    assert "holds a string, not a hash" in headers_of(letter)[ERROR]


def test_forget_leaves_a_readable_keys_send_mark_to_lapse(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    """As docs/celery.md says: a forgotten key's mark lapses by itself (only an unreadable record's
    removal takes it)."""
    assert check_send(dedupe, "m", "task-1", ttl=5).state is SendState.PUBLISH
    dedupe.run("m", lambda: "done")
    assert dedupe.forget("m")
    assert redis_client.exists(KeyLayout.sent(stem(dedupe, "m")))
    redis_client.sadd(KeyLayout.sent(stem(dedupe, "n")), "another program's set")  # alone under a name
    assert dedupe.store.forget(stem(dedupe, "n"), None, False)[0] == -3
    assert dedupe.forget("n", force=True) and not redis_client.exists(KeyLayout.sent(stem(dedupe, "n")))
