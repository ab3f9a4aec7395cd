"""The protocol on every store: Redis, PostgreSQL and MariaDB (``store_url``), one run per store.

The same assertions on each: ``run()`` once, the four claim outcomes, keys compared byte for byte,
fencing (a zombie past its lease refused, tokens increasing across release and forget, a SIGKILLed
holder taken over under a larger token), per-message ttl, batches, waiting, 32 threads racing on
200 keys, and the asyncio client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from dedupe_worker import OMITTED, Deduplicator, InProgress, KeyConflict, LeaseLost, Outcome
from dedupe_worker.asyncio import AsyncDeduplicator

from .store_fixtures import store_url

__all__ = ["store_url"]


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def dedupe(store_url: str, namespace: str) -> Iterator[Deduplicator]:
    client = Deduplicator.from_url(store_url, namespace=namespace, lease=5)
    yield client
    client.close()


def short_lease(store_url: str, namespace: str, lease: float = 0.3) -> Deduplicator:
    return Deduplicator.from_url(store_url, namespace=namespace, lease=lease, renew_interval=60)


def test_run_applies_once_and_answers_duplicates_with_the_stored_value(dedupe: Deduplicator) -> None:
    calls: list[int] = []
    assert dedupe.run("order-1", lambda: calls.append(1) or {"id": 1}) == {"id": 1}
    assert dedupe.run("order-1", lambda: calls.append(1) or {"id": 2}) == {"id": 1}
    assert calls == [1]


def test_a_handler_error_releases_the_key_for_the_next_delivery(dedupe: Deduplicator) -> None:
    def boom() -> None:
        raise RuntimeError("retry me")

    with pytest.raises(RuntimeError):
        dedupe.run("flaky", boom)
    assert dedupe.run("flaky", lambda: "second") == "second"


def test_the_four_claim_outcomes(dedupe: Deduplicator) -> None:
    first = dedupe.begin("k", fingerprint="body-1")
    assert first.outcome is Outcome.ACQUIRED
    held = dedupe.begin("k", fingerprint="body-1")
    assert held.outcome is Outcome.IN_PROGRESS and held.token == first.token and 0 < held.retry_after <= 5
    with pytest.raises(InProgress):
        dedupe.run("k", lambda: None, fingerprint="body-1")
    assert dedupe.begin("k", fingerprint="body-2").outcome is Outcome.CONFLICT
    dedupe.complete(first, [1, 2])
    dup = dedupe.begin("k", fingerprint="body-1")
    assert (dup.outcome, dup.result, dup.token) == (Outcome.DUPLICATE, [1, 2], first.token)
    with pytest.raises(KeyConflict):
        dedupe.run("k", lambda: None, fingerprint="body-2")


def test_keys_are_compared_byte_for_byte(dedupe: Deduplicator) -> None:
    keys = ["a", "A", "a ", "é", "É", "e"]
    assert [dedupe.run(k, lambda k=k: k) for k in keys] == keys
    assert [dedupe.run(k, lambda: "again") for k in keys] == keys


def test_a_zombie_past_its_lease_is_refused(store_url: str, namespace: str) -> None:
    zombie, successor = short_lease(store_url, namespace), short_lease(store_url, namespace)
    try:
        old = zombie.begin("job")
        time.sleep(0.4)
        new = successor.begin("job")
        assert new.outcome is Outcome.ACQUIRED and new.token > old.token
        with pytest.raises(LeaseLost):
            zombie.complete(old, "late")
        assert zombie.release(old) is False and zombie.renew(old) is False
        successor.complete(new, "winner")
        assert zombie.begin("job").result == "winner"
    finally:
        zombie.close()
        successor.close()


def test_tokens_increase_across_release_and_forget(dedupe: Deduplicator) -> None:
    tokens = []
    for _ in range(3):
        claim = dedupe.begin("t")
        tokens.append(claim.token)
        assert dedupe.release(claim)
    claim = dedupe.begin("t")
    dedupe.complete(claim, 1)
    tokens.append(claim.token)
    assert dedupe.forget("t")
    tokens.append(dedupe.begin("t").token)
    assert tokens == sorted(set(tokens))


def test_a_per_message_ttl_is_kept_that_long(dedupe: Deduplicator) -> None:
    assert dedupe.run("short", lambda: 1, ttl=0.3) == 1
    assert dedupe.run("long", lambda: 1) == 1
    assert dedupe.run("short", lambda: 2) == 1
    time.sleep(0.45)
    assert dedupe.run("short", lambda: 2) == 2
    assert dedupe.run("long", lambda: 2) == 1


def test_batches_claim_and_complete_in_order(dedupe: Deduplicator) -> None:
    dedupe.run("done", lambda: "stored")
    claims = dedupe.begin_many(["x", "y", "x", "done"])
    assert [c.outcome for c in claims] == [Outcome.ACQUIRED, Outcome.ACQUIRED, Outcome.IN_PROGRESS,
                                           Outcome.DUPLICATE]
    assert claims[2].token == claims[0].token and claims[3].result == "stored"
    assert dedupe.complete_many([(claims[0], "vx"), (claims[1], "vy")]) == [True, True]
    assert [c.result for c in dedupe.begin_many(["y", "x"])] == ["vy", "vx"]
    state = dedupe.status("x")
    assert (state.state, state.token) == ("done", claims[0].token)


def test_a_waiter_gets_the_holders_value_as_soon_as_it_is_stored(store_url: str, dedupe: Deduplicator,
                                                                 namespace: str) -> None:
    holder = Deduplicator.from_url(store_url, namespace=namespace, lease=10)
    try:
        claim = holder.begin("slow")
        threading.Timer(0.3, lambda: holder.complete(claim, "from holder")).start()
        started = time.monotonic()
        assert dedupe.run("slow", lambda: "from waiter", wait=5) == "from holder"
        assert time.monotonic() - started < 2.0  # woken by the completion, not the 10 s lease
        released = holder.begin("freed")
        threading.Timer(0.3, lambda: holder.release(released)).start()
        assert dedupe.run("freed", lambda: "ran here", wait=5) == "ran here"
    finally:
        holder.close()


def test_32_threads_on_200_keys_run_each_key_once(dedupe: Deduplicator) -> None:
    runs: Counter[str] = Counter()
    lock = threading.Lock()
    keys = [f"race-{i}" for i in range(200)]
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        for i in range(len(keys)):
            key = keys[(i + offset * 7) % len(keys)]
            try:
                dedupe.run(key, lambda key=key: _count(runs, lock, key))
            except InProgress:
                pass
            except Exception as exc:  # a store error would leave the key unrun: the test fails on it
                errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert set(runs) == set(keys) and set(runs.values()) == {1}


def _count(runs: Counter[str], lock: threading.Lock, key: str) -> str:
    with lock:
        runs[key] += 1
    return key


_HOLDER = """
import sys, time
from dedupe_worker import Deduplicator
d = Deduplicator.from_url(sys.argv[1], namespace=sys.argv[2], lease=0.5, renew_interval=60)
c = d.begin("killed")
print(c.outcome.name, c.token, flush=True)
time.sleep(60)
"""


def test_a_sigkilled_holder_is_taken_over_after_its_lease_under_a_larger_token(store_url: str, dedupe: Deduplicator,
                                                                              namespace: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, store_url, namespace], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout is not None
    outcome, token = proc.stdout.readline().split()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert outcome == "ACQUIRED"
    assert dedupe.begin("killed").outcome is Outcome.IN_PROGRESS
    time.sleep(0.6)
    taken = dedupe.begin("killed")
    assert taken.outcome is Outcome.ACQUIRED and taken.token > int(token)


def test_the_asyncio_client_on_the_same_store(store_url: str, namespace: str) -> None:
    async def main() -> None:
        adedupe = AsyncDeduplicator.from_url(store_url, namespace=namespace, lease=5)
        calls: list[int] = []

        async def handler() -> str:
            calls.append(1)
            return "once"

        try:
            assert [await adedupe.run("a", handler) for _ in range(2)] == ["once", "once"]
            claims = await adedupe.begin_many(["b", "b", "a"])
            assert [c.outcome for c in claims] == [Outcome.ACQUIRED, Outcome.IN_PROGRESS, Outcome.DUPLICATE]

            async def finish_later() -> None:
                await asyncio.sleep(0.3)
                await adedupe.complete(claims[0], "b done")

            task = asyncio.create_task(finish_later())
            assert await adedupe.run("b", handler, wait=5) == "b done"
            await task
            assert calls == [1]
        finally:
            await adedupe.aclose()

    asyncio.run(main())


def test_the_producers_send_check(dedupe: Deduplicator) -> None:
    from dedupe_worker._protocol.sending import SendState
    from dedupe_worker._transport.sending import check_send

    first = check_send(dedupe, "s1", "id-1", ttl=0.3, fingerprint="fp")
    assert first.state is SendState.PUBLISH and first.task_id == "id-1"
    queued = check_send(dedupe, "s1", "id-2", ttl=0.3, fingerprint="fp")
    assert queued.state is SendState.QUEUED and queued.task_id == "id-1" and 0 < queued.remaining <= 0.3
    assert check_send(dedupe, "s1", "id-3", ttl=0.3, fingerprint="other").state is SendState.CONFLICT
    time.sleep(0.35)
    assert check_send(dedupe, "s1", "id-4", ttl=0.3, fingerprint="other").state is SendState.PUBLISH
    claim = dedupe.begin("s1", fingerprint="other")
    running = check_send(dedupe, "s1", "id-5", ttl=5, fingerprint="other")
    assert running.state is SendState.RUNNING and running.task_id == "id-4" and running.remaining > 0
    dedupe.complete(claim, {"v": 1})
    done = check_send(dedupe, "s1", "id-6", ttl=5, fingerprint="other")
    assert done.state is SendState.DONE and done.task_id == "id-4" and done.claim is not None
    assert Deduplicator.answer(done.claim) == {"v": 1}
    dedupe.begin("s2")  # a task sent without the check
    assert check_send(dedupe, "s2", "id-1", ttl=5).state is SendState.PUBLISH
    assert check_send(dedupe, "s2", "id-2", ttl=5).state is SendState.RUNNING


def test_a_permanent_failure_is_stored_and_answered(dedupe: Deduplicator) -> None:
    from dedupe_worker import PreviouslyFailed

    claim = dedupe.begin("doomed")
    dedupe.fail(claim, ValueError("never"))
    with pytest.raises(PreviouslyFailed):
        dedupe.run("doomed", lambda: "ran")
    assert dedupe.status("doomed").status == "f"


def test_renewal_and_completion_belong_to_the_owner(store_url: str, namespace: str) -> None:
    dedupe = short_lease(store_url, namespace, lease=0.3)
    try:
        claim = dedupe.begin("owned")
        time.sleep(0.4)  # ran out, but nobody took it: still ours
        assert dedupe.renew(claim)
        assert dedupe.status("owned").state == "in_progress"
        stranger = dataclasses.replace(claim, token=claim.token + 1000)
        assert not dedupe.renew(stranger) and not dedupe.release(stranger)
        dedupe.complete(claim, "mine")
        assert dedupe.complete_many([(claim, "mine")]) == [True]  # a retried completion answers stored
        assert dedupe.run("owned", lambda: "other") == "mine"
    finally:
        dedupe.close()


def test_the_batch_engine_runs_each_key_once_and_compresses_large_results(store_url: str, namespace: str) -> None:
    from dedupe_worker import decide_many

    dedupe = Deduplicator.from_url(store_url, namespace=namespace, compress_above=100, max_result_bytes=200)
    runs: Counter[str] = Counter()

    noise = os.urandom(600).hex()  # compressed, still over max_result_bytes

    def handler(key: str) -> Callable[[], object]:
        return lambda: runs.update([key]) or ("x" * 5000 if key == "big" else noise if key == "huge" else key)

    keys = ["a", "b", "a", "big", "huge", "b"]
    first = decide_many(dedupe, [(k, None, handler(k)) for k in keys], ttl=[None, 60, None, None, None, 60])
    again = decide_many(dedupe, [(k, None, handler(k)) for k in keys])
    assert runs == Counter({"a": 1, "b": 1, "big": 1, "huge": 1})
    assert [d.reason.value for d in first].count("applied") == 4
    assert all(d.reason.value == "duplicate" for d in again)
    assert dedupe.run("big", lambda: "again") == "x" * 5000  # stored compressed: 5000 bytes raw > max_result_bytes
    assert dedupe.begin("huge").result is OMITTED
    dedupe.close()


def test_a_publish_that_raised_takes_its_mark_back_and_a_release_frees_it(dedupe: Deduplicator) -> None:
    from dedupe_worker._protocol.sending import SendState
    from dedupe_worker._transport.sending import check_send, unsend

    assert check_send(dedupe, "u1", "id-1", ttl=5, fingerprint="fp").state is SendState.PUBLISH
    assert not unsend(dedupe, "u1", "id-0")  # another send's publish raised late: the mark stays
    assert check_send(dedupe, "u1", "id-2", ttl=5, fingerprint="fp").task_id == "id-1"  # QUEUED
    assert unsend(dedupe, "u1", "id-1") and not unsend(dedupe, "u1", "id-1")  # fenced by the task id
    assert check_send(dedupe, "u1", "id-3", ttl=5, fingerprint="fp").state is SendState.PUBLISH
    claim = dedupe.begin("u1", fingerprint="fp")  # a worker took task id-3
    assert check_send(dedupe, "u1", "id-4", ttl=5, fingerprint="fp").state is SendState.RUNNING
    assert dedupe.release(claim)  # a retryable failure: id-3 is no longer queued
    again = check_send(dedupe, "u1", "id-5", ttl=5, fingerprint="fp")
    assert (again.state, again.task_id) == (SendState.PUBLISH, "id-5")
    assert check_send(dedupe, "u1", "id-6", ttl=5, fingerprint="fp").state is SendState.QUEUED  # id-5's mark


def test_celery_sends_a_raising_publish_leaves_no_mark_and_a_send_after_a_release_publishes(
        store_url: str, namespace: str, rabbitmq_url: str, redis_url: str, dedupe: Deduplicator) -> None:
    from kombu.exceptions import OperationalError

    from .celery_fixtures import delete_queue, make_app
    from .test_celery_send import closed_port, queued

    config = {"backend": redis_url, "namespace": namespace, "queue": f"dedupe-test-{namespace}",
              "store_url": store_url}
    down = make_app(broker=f"amqp://guest:guest@127.0.0.1:{closed_port()}//", **config)
    down.conf.update(dedupe_on_send=True, broker_connection_timeout=0.5, task_publish_retry_policy={"max_retries": 0})
    app = make_app(broker=rabbitmq_url, **config)
    app.conf.dedupe_on_send = True
    try:
        with pytest.raises(OperationalError):  # the broker is down for the first send
            down.tasks["dt.charge"].delay(1, 10)
        retried = app.tasks["dt.charge"].delay(1, 10)  # the producer's retry: published, not "queued"
        assert app.tasks["dt.charge"].delay(1, 10).id == retried.id and queued(app, config["queue"]) == 1
        claim = dedupe.begin("charge:1")  # a worker takes it, fails retryably, releases the key
        assert app.tasks["dt.charge"].delay(1, 10).id == retried.id  # running: nothing published
        assert dedupe.release(claim)
        again = app.tasks["dt.charge"].delay(1, 10)
        assert again.id != retried.id and queued(app, config["queue"]) == 2
    finally:
        down.close()
        delete_queue(app, config["queue"])
        app.close()


def test_forget_with_token_0_removes_only_a_record_carrying_none(dedupe: Deduplicator) -> None:
    claim = dedupe.begin("f1")
    stem = dedupe.request("f1").stem
    assert dedupe.store.forget(stem, 0, True) == (-2, claim.token, "")  # a live lease carries a token
    assert dedupe.store.forget(stem, None, False)[:2] == (-1, claim.token)
    assert not dedupe.forget("f1", token=0, force=True)
    assert dedupe.begin("f1").outcome is Outcome.IN_PROGRESS  # nothing changed
    dedupe.complete(claim, "kept")
    assert dedupe.store.forget(stem, 0, True) == (-2, claim.token, "")  # a stored outcome too
    assert dedupe.store.forget(stem, claim.token, False)[:2] == (1, claim.token)
    assert dedupe.store.forget(stem, 0, True)[:2] == (0, 0)  # nothing left


def test_a_decompression_bomb_in_a_stored_record_is_answered_omitted(store_url: str, namespace: str) -> None:
    import zlib

    from dedupe_worker._protocol import Stored
    from dedupe_worker._protocol.serialization import MARK, decoded_limit

    dedupe = Deduplicator.from_url(store_url, namespace=namespace, max_result_bytes=1000)
    plain = b"[" + b"0," * decoded_limit(1000) + b"0]"  # past the bound this client decodes to
    bomb = MARK + b"z" + zlib.compress(plain, 9)
    claim = dedupe.begin("bomb")
    [call] = dedupe.store.complete_calls([(claim.stem, claim.token, Stored.COMPLETED, bomb)], 60_000)
    assert dedupe.store.scripts.call(*call) in ([1], 1)
    assert dedupe.begin("bomb").result is OMITTED
    assert dedupe.run("bomb", lambda: "ran") is OMITTED
    dedupe.close()
