"""``send.lua`` on real Redis: each answer, the mark's TTLs, and records written by the worker's
scripts of this release and of the previous one (a rolling upgrade: senders read both)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import redis

from dedupe_worker import Deduplicator, PreviouslyFailed
from dedupe_worker._protocol import KeyLayout, Stored
from dedupe_worker._protocol.sending import SendState
from dedupe_worker._transport.sending import check_send, unsend

PREVIOUS = Path(__file__).parent / "data" / "lua_previous"


def test_publish_then_queued_then_publish_again_after_the_ttl(dedupe: Deduplicator,
                                                             redis_client: redis.Redis) -> None:
    first = check_send(dedupe, "k1", "id-1", ttl=0.3, fingerprint="fp")
    assert first.state is SendState.PUBLISH and first.task_id == "id-1"
    queued = check_send(dedupe, "k1", "id-2", ttl=0.3, fingerprint="fp")
    assert queued.state is SendState.QUEUED and queued.task_id == "id-1" and 0 < queued.remaining <= 0.3
    assert check_send(dedupe, "k1", "id-3", ttl=0.3, fingerprint="other").state is SendState.CONFLICT
    mark = KeyLayout.sent(dedupe.request("k1").stem)
    assert 0.3 * 1000 < redis_client.pttl(mark) <= (0.3 + dedupe.result_ttl) * 1000  # kept to name the task
    time.sleep(0.35)
    again = check_send(dedupe, "k1", "id-4", ttl=0.3, fingerprint="other")  # a stale mark is no conflict
    assert again.state is SendState.PUBLISH and redis_client.hget(mark, "id") == b"id-4"


def test_running_done_and_failed(dedupe: Deduplicator) -> None:
    check_send(dedupe, "k2", "id-1", ttl=5, fingerprint="fp")
    claim = dedupe.begin("k2", fingerprint="fp")
    running = check_send(dedupe, "k2", "id-2", ttl=5, fingerprint="fp")
    assert running.state is SendState.RUNNING and running.task_id == "id-1" and running.remaining > 0
    assert check_send(dedupe, "k2", "id-3", ttl=5, fingerprint="no").state is SendState.CONFLICT
    dedupe.complete(claim, {"v": 1})
    done = check_send(dedupe, "k2", "id-4", ttl=5, fingerprint="fp")
    assert done.state is SendState.DONE and done.task_id == "id-1" and done.claim is not None
    assert Deduplicator.answer(done.claim) == {"v": 1} and done.claim.token == claim.token
    assert check_send(dedupe, "k2", "id-5", ttl=5, fingerprint="no").state is SendState.CONFLICT

    failed_claim = dedupe.begin("k3")
    dedupe.fail(failed_claim, ValueError("never"))
    failed = check_send(dedupe, "k3", "id-6", ttl=5)
    assert failed.state is SendState.DONE and failed.task_id == "" and failed.claim is not None
    with pytest.raises(PreviouslyFailed):
        Deduplicator.answer(failed.claim)


def test_a_claim_without_a_mark_publishes(dedupe: Deduplicator) -> None:
    dedupe.begin("k4")  # a worker runs a task that was sent without the check
    assert check_send(dedupe, "k4", "id-1", ttl=5).state is SendState.PUBLISH
    assert check_send(dedupe, "k4", "id-2", ttl=5).state is SendState.RUNNING


def test_records_of_the_previous_release_are_read(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    texts = {n: (PREVIOUS / f"{n}.lua").read_text() for n in ("claim", "complete")}
    sha = {n: hashlib.sha1(t.encode()).hexdigest() for n, t in texts.items()}
    for text in texts.values():
        redis_client.script_load(text)
    stem = dedupe.request("k5").stem
    started, result, notice = KeyLayout.started(stem), KeyLayout.result(stem), KeyLayout.notice(stem)
    code, token, _, _ = redis_client.evalsha(sha["claim"], 2, started, result, 5000, 60000, "fp", "")
    assert code == 1
    assert check_send(dedupe, "k5", "id-1", ttl=5, fingerprint="other").state is SendState.CONFLICT
    redis_client.evalsha(sha["complete"], 3, started, result, notice, 60000, token, Stored.COMPLETED.value, b'"ok"')
    done = check_send(dedupe, "k5", "id-2", ttl=5, fingerprint="fp")
    assert done.state is SendState.DONE and done.claim is not None and Deduplicator.answer(done.claim) == "ok"


def test_unsend_removes_only_the_mark_of_its_own_task(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    assert check_send(dedupe, "k6", "id-1", ttl=5, fingerprint="fp").state is SendState.PUBLISH
    assert not unsend(dedupe, "k6", "id-0")  # an earlier send's publish raised late: the mark stays
    assert check_send(dedupe, "k6", "id-2", ttl=5, fingerprint="fp").state is SendState.QUEUED
    assert unsend(dedupe, "k6", "id-1")  # id-1's publish raised: nothing is queued for the key
    assert not redis_client.exists(KeyLayout.sent(dedupe.request("k6").stem))
    again = check_send(dedupe, "k6", "id-3", ttl=5, fingerprint="fp")
    assert again.state is SendState.PUBLISH and again.task_id == "id-3"
    assert not unsend(dedupe, "k7", "id-1")  # no mark at all


def test_a_released_claim_frees_the_mark_for_the_next_send(dedupe: Deduplicator) -> None:
    assert check_send(dedupe, "k8", "id-1", ttl=5, fingerprint="fp").state is SendState.PUBLISH
    claim = dedupe.begin("k8", fingerprint="fp")  # a worker took task id-1
    assert check_send(dedupe, "k8", "id-2", ttl=5, fingerprint="fp").state is SendState.RUNNING
    assert dedupe.release(claim)  # a retryable failure: task id-1 is no longer queued
    again = check_send(dedupe, "k8", "id-3", ttl=5, fingerprint="fp")
    assert again.state is SendState.PUBLISH and again.task_id == "id-3"
    assert check_send(dedupe, "k8", "id-4", ttl=5, fingerprint="fp").state is SendState.QUEUED  # id-3's mark


def test_a_mark_of_a_key_claimed_before_stays_queued_until_a_new_claim(redis_client: redis.Redis,
                                                                       namespace: str) -> None:
    short = Deduplicator(redis_client, namespace=namespace, lease=0.2, result_ttl=60.0)
    try:
        short.release(short.begin("k9"))  # an earlier run of the key, released: its counter stays
        assert check_send(short, "k9", "id-1", ttl=5).state is SendState.PUBLISH
        assert check_send(short, "k9", "id-2", ttl=5).state is SendState.QUEUED
        short.begin("k9")  # taken, then its worker dies: the lease runs out
        time.sleep(0.25)
        assert check_send(short, "k9", "id-3", ttl=5).state is SendState.PUBLISH
    finally:
        short.close()
