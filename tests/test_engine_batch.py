"""The batch engine on real Redis: when claims are taken, when outcomes are stored, how many round
trips that costs (counted on the connection), and what an interruption leaves behind."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from dedupe_worker import Deduplicator, Reason, State, current_claim, decide, decide_many
from dedupe_worker._engine import Pacing
from dedupe_worker._engine.batch import STREAM_STEP, verdicts_flow
from dedupe_worker._engine.pacing import STREAM_WORK
from dedupe_worker._transport.scripts import ScriptRunner


class CountingConnection(redis.Connection):
    """Records every request sent to Redis: one ``send_packed_command`` is one round trip (a
    pipeline sends all its commands at once)."""

    sent: list[bytes] = []

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        parts = command if isinstance(command, list) else [command]
        type(self).sent.append(b"".join(bytes(p) for p in parts))
        super().send_packed_command(command, check_health)


@pytest.fixture
def counted(redis_url: str, namespace: str) -> Iterator[tuple[Deduplicator, list[bytes]]]:
    kwargs = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    pool = redis.ConnectionPool(connection_class=CountingConnection, **kwargs)
    dedupe = Deduplicator(redis.Redis(connection_pool=pool), namespace=namespace, lease=5.0,
                          result_ttl=60.0, renew_interval=3600)
    dedupe.begin("warm-up")  # load the scripts and open the connection outside the count
    CountingConnection.sent = []
    yield dedupe, CountingConnection.sent
    dedupe.close()
    pool.disconnect()


#: How a script call starts on the wire: ``FCALL`` on Redis 7+/Valkey (``EVALSHA`` otherwise).
SCRIPT_CALL = b"$5\r\nFCALL\r\n"


def scripts_in(request: bytes) -> set[str]:
    """Which protocol scripts one round trip ran (by SHA, or by function name under FCALL)."""
    runner = ScriptRunner(redis.Redis())
    return {name for name, sha in runner.sha.items()
            if sha.encode() in request or f"{runner.flows.library}_{name}\r".encode() in request}


def test_fast_handlers_store_and_claim_the_next_chunk_in_one_round_trip(
        counted: tuple[Deduplicator, list[bytes]]) -> None:
    dedupe, sent = counted
    pacing = Pacing(flush_after=0.005)

    def work(i: int) -> int:
        time.sleep(0.0008)  # about six handlers per 5 ms chunk
        return i

    items = [(f"fast-{i}", None, (lambda i=i: work(i))) for i in range(60)]
    decisions = decide_many(dedupe, items, pacing=pacing)

    assert [d.reason for d in decisions] == [Reason.APPLIED] * 60
    assert [d.value for d in decisions] == list(range(60))
    kinds = [scripts_in(request) for request in sent]
    # the first round trip claims the first chunk, the last stores the last group, and every one in
    # between stores the group that finished and claims the next chunk, together
    assert kinds[0] == {"claim"} and kinds[-1] == {"complete"}
    # (a chunk that overran flush_after also gives back its unstarted claims in that round trip)
    assert all(k - {"release"} == {"complete", "claim"} for k in kinds[1:-1]), kinds
    assert 3 <= len(sent) <= 30, f"{len(sent)} round trips for 60 fast handlers"


def test_no_op_handlers_cost_two_round_trips_per_batch_once_their_timing_is_known(
        counted: tuple[Deduplicator, list[bytes]]) -> None:
    dedupe, sent = counted
    # flush_after with slack: a no-op handler preempted on a loaded machine (a CI run on 2 vCPUs)
    # measured at 50 us would split the rest under the default 5 ms; the chunking is the same
    pacing = Pacing(flush_after=1.0)
    first = decide_many(dedupe, [(f"n1-{i}", None, (lambda: None)) for i in range(100)], pacing=pacing)
    assert all(d.reason is Reason.APPLIED for d in first)
    # nothing known yet: one message, then (timed) the whole rest with its outcome
    assert [scripts_in(r) for r in sent] == [{"claim"}, {"complete", "claim"}, {"complete"}]
    sent.clear()
    second = decide_many(dedupe, [(f"n2-{i}", None, (lambda: None)) for i in range(100)], pacing=pacing)
    assert all(d.reason is Reason.APPLIED for d in second)
    assert [scripts_in(r) for r in sent] == [{"claim"}, {"complete"}]


def test_slow_handlers_claim_one_message_at_a_time_and_store_before_the_next_starts(
        dedupe: Deduplicator) -> None:
    keys = [f"slow-{i}" for i in range(5)]
    seen: list[tuple[str, list[State]]] = []

    def work(i: int) -> str:
        seen.append((keys[i], [dedupe.status(k).state for k in keys]))
        time.sleep(0.02)  # four times flush_after
        return keys[i]

    decisions = decide_many(dedupe, [(k, None, (lambda i=i: work(i))) for i, k in enumerate(keys)],
                            flush_after=0.005)

    assert [d.reason for d in decisions] == [Reason.APPLIED] * 5
    for i, (_, states) in enumerate(seen):
        # every earlier outcome is stored, only this key is claimed, no later key is touched
        assert states[:i] == [State.DONE] * i
        assert states[i] is State.IN_PROGRESS
        assert states[i + 1:] == [State.FREE] * (4 - i)


def test_finished_work_waits_to_be_stored_only_while_it_stays_under_flush_after(dedupe: Deduplicator) -> None:
    flush_after = 0.01
    took: dict[int, float] = {}
    unstored_at_start: list[float] = []

    def work(i: int) -> int:
        began = time.perf_counter()
        waiting = [j for j in took if dedupe.status(f"g-{j}").state is not State.DONE]
        unstored_at_start.append(sum(took[j] for j in waiting))
        time.sleep(0.001 + (i % 4) * 0.002)  # 1-7 ms, so groups close at different sizes
        took[i] = time.perf_counter() - began
        return i

    decisions = decide_many(dedupe, [(f"g-{i}", None, (lambda i=i: work(i))) for i in range(40)],
                            pacing=Pacing(flush_after))
    assert all(d.reason is Reason.APPLIED for d in decisions)
    assert max(unstored_at_start) < flush_after, unstored_at_start
    assert any(u > 0 for u in unstored_at_start), "outcomes were never grouped"


def test_a_copy_in_the_batch_answers_from_the_stored_outcome(dedupe: Deduplicator) -> None:
    runs: list[str] = []

    def work(key: str) -> str:
        runs.append(key)
        return key.upper()

    items = [(k, None, (lambda k=k: work(k))) for k in ("a", "b", "a", "c", "b", "a")]
    decisions = decide_many(dedupe, items)

    assert runs == ["a", "b", "c"]
    assert [d.reason for d in decisions] == [Reason.APPLIED, Reason.APPLIED, Reason.DUPLICATE, Reason.APPLIED,
                                             Reason.DUPLICATE, Reason.DUPLICATE]
    assert [d.value for d in decisions] == ["A", "B", "A", "C", "B", "A"]
    assert decisions[2].token == decisions[0].token  # the stored outcome's token


def test_a_copy_of_a_failing_key_is_deferred_not_run_twice(dedupe: Deduplicator) -> None:
    runs: list[str] = []

    def fail(key: str) -> None:
        runs.append(key)
        raise ConnectionError("down")

    decisions = decide_many(dedupe, [("f", None, (lambda: fail("f"))), ("f", None, (lambda: fail("f")))])
    assert runs == ["f"]
    assert [d.reason for d in decisions] == [Reason.HANDLER_ERROR, Reason.IN_PROGRESS]
    assert dedupe.status("f").state is State.FREE  # released for the retry


def test_an_interrupt_stores_what_finished_and_frees_what_did_not(dedupe: Deduplicator) -> None:
    def work(i: int) -> int:
        if i == 3:
            raise KeyboardInterrupt
        return i

    items = [(f"int-{i}", None, (lambda i=i: work(i))) for i in range(6)]
    with pytest.raises(KeyboardInterrupt):
        decide_many(dedupe, items, pacing=Pacing(flush_after=1.0))  # everything in one group
    states = [dedupe.status(f"int-{i}").state for i in range(6)]
    assert states[:3] == [State.DONE] * 3
    assert states[3:] == [State.FREE] * 3


def test_the_fencing_token_is_current_in_each_handler(dedupe: Deduplicator) -> None:
    tokens: list[int] = []

    def work() -> None:
        claim = current_claim()
        assert claim is not None
        tokens.append(claim.token)

    decisions = decide_many(dedupe, [(f"tok-{i}", None, work) for i in range(4)])
    assert tokens == [d.token for d in decisions] and all(t >= 1 for t in tokens)


def test_redis_down_mid_batch_defers_the_rest_and_runs_nothing_more(private_redis: Any) -> None:
    client = redis.Redis.from_url(private_redis.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    dedupe = Deduplicator(client, namespace="outage", lease=2.0, result_ttl=60.0)
    runs: list[int] = []

    def work(i: int) -> int:
        runs.append(i)
        if i == 1:
            private_redis.stop()
        time.sleep(0.01)
        return i

    try:
        decisions = decide_many(dedupe, [(f"o-{i}", None, (lambda i=i: work(i))) for i in range(5)],
                                flush_after=0.001)
    finally:
        dedupe.close()
    assert runs == [0, 1]
    assert decisions[0].reason is Reason.APPLIED  # stored before Redis went away
    assert [d.reason for d in decisions[1:]] == [Reason.STORE_UNAVAILABLE] * 4


def test_redis_down_in_the_middle_of_a_claimed_chunk_runs_no_more_of_it(private_redis: Any) -> None:
    client = redis.Redis.from_url(private_redis.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    dedupe = Deduplicator(client, namespace="outage", lease=2.0, result_ttl=60.0)
    pacing = Pacing(flush_after=0.001)
    pacing.mean = 0.0001  # as if handlers were fast: the whole batch is claimed as one chunk
    runs: list[int] = []

    def work(i: int) -> int:
        runs.append(i)
        private_redis.stop()
        time.sleep(0.002)  # past flush_after: the outcome must be stored before the next starts
        return i

    try:
        decisions = decide_many(dedupe, [(f"m-{i}", None, (lambda i=i: work(i))) for i in range(5)], pacing=pacing)
    finally:
        dedupe.close()
    assert runs == [0]
    assert [d.reason for d in decisions] == [Reason.STORE_UNAVAILABLE] * 5


def test_a_batch_of_duplicates_is_claimed_in_growing_chunks_then_whole(
        counted: tuple[Deduplicator, list[bytes]]) -> None:
    dedupe, sent = counted
    keys = [f"dup-{i}" for i in range(200)]
    decide_many(dedupe, [(k, None, (lambda: None)) for k in keys], pacing=Pacing())
    sent.clear()
    pacing = Pacing()  # a fresh consumer: nothing known yet
    again = decide_many(dedupe, [(k, None, (lambda: 1 / 0)) for k in keys], pacing=pacing)
    assert all(d.reason is Reason.DUPLICATE for d in again)
    assert len(sent) <= 9, f"{len(sent)} round trips for 200 duplicates"  # 1, 2, 4, ... then the rest
    sent.clear()
    decide_many(dedupe, [(k, None, (lambda: 1 / 0)) for k in keys], pacing=pacing)
    assert len(sent) == 1  # the same consumer, steady: one claim round trip for the whole batch


@pytest.mark.parametrize("odd", ["none", "omitted", "failed", "new", "copy"])
def test_a_run_of_duplicates_answers_each_with_its_stored_outcome(
        redis_client: redis.Redis, namespace: str, odd: str) -> None:
    """A claimed chunk that found every outcome completed answers each key with its stored value
    and token, also where one claim of the chunk is not such a duplicate (an omitted or failed
    outcome, a new key, a copy in the batch); asked again, the same."""
    dedupe = Deduplicator(redis_client, namespace=namespace, max_result_bytes=64, permanent_errors=(KeyError,))
    try:
        keys = [f"run-{i}" for i in range(40)]
        decide_many(dedupe, [(k, None, (lambda i=i: {"n": i})) for i, k in enumerate(keys)], pacing=fast_pacing())
        if odd == "omitted":
            decide_many(dedupe, [("run-odd", None, (lambda: "x" * 200))])
        elif odd == "failed":
            decide_many(dedupe, [("run-odd", None, (lambda: {}["no such account"]))])
        again = [*keys[:20], "run-odd" if odd != "copy" else keys[3], *keys[20:]]
        if odd == "none":
            again.remove("run-odd")

        def verdicts() -> list[tuple[Any, ...]]:
            decisions = decide_many(dedupe, [(k, None, (lambda: "ran")) for k in again], pacing=fast_pacing())
            return [(d.reason, d.value, d.token) for d in decisions]

        noted = verdicts()
        one_by_one = verdicts()
        assert noted[:20] == [(Reason.DUPLICATE, {"n": i}, noted[i][2]) for i in range(20)]
        if odd == "new":
            assert noted[20][:2] == (Reason.APPLIED, "ran") and one_by_one[20][0] is Reason.DUPLICATE
            noted[20] = one_by_one[20]  # the second run found the first one's outcome
        assert noted == one_by_one
    finally:
        dedupe.close()


def test_claims_a_chunk_has_not_started_are_given_back_once_its_handlers_reach_flush_after(
        dedupe: Deduplicator) -> None:
    pacing = Pacing(flush_after=0.005)
    pacing.mean, pacing.acquired = 0.0001, 0.01  # as after a stream of duplicates: claims everything
    keys = [f"back-{i}" for i in range(6)]
    seen: list[list[State]] = []

    def work(i: int) -> int:
        seen.append([dedupe.status(k).state for k in keys])
        time.sleep(0.02)  # slower than anything seen
        return i

    decisions = decide_many(dedupe, [(k, None, (lambda i=i: work(i))) for i, k in enumerate(keys)], pacing=pacing)
    assert [d.reason for d in decisions] == [Reason.APPLIED] * 6
    assert seen[0] == [State.IN_PROGRESS] * 6  # the first chunk claimed all six
    for i, states in enumerate(seen[1:], 1):  # then: earlier ones stored, this one claimed, none ahead
        assert states == [State.DONE] * i + [State.IN_PROGRESS] + [State.FREE] * (5 - i), (i, states)


class ReadCountingConnection(CountingConnection):
    """Also counts the replies read, and can fail a read (a connection cut mid-reply stream)."""

    reads = 0
    fail_at: int | None = None  # the read (counted from 1) that raises ConnectionError

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        type(self).reads += 1
        if type(self).reads == type(self).fail_at:
            self.disconnect()
            raise redis.ConnectionError("cut while reading")
        return super().read_response(*args, **kwargs)


@pytest.fixture
def streamed(accelerated: None, redis_url: str, namespace: str) -> Iterator[Deduplicator]:
    """Streaming is the held connection's: on for these tests (``accelerated``)."""
    kwargs = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    pool = redis.ConnectionPool(connection_class=ReadCountingConnection, **kwargs)
    dedupe = Deduplicator(redis.Redis(connection_pool=pool), namespace=namespace, lease=5.0,
                          result_ttl=60.0, renew_interval=3600)
    dedupe.begin("warm-up")
    ReadCountingConnection.sent, ReadCountingConnection.reads, ReadCountingConnection.fail_at = [], 0, None
    yield dedupe
    ReadCountingConnection.fail_at = None
    dedupe.close()
    pool.disconnect()


def fast_pacing() -> Pacing:
    pacing = Pacing()
    pacing.mean = 1e-7  # as after a stream of no-op handlers: the whole batch is one chunk, one call
    return pacing


def streaming_pacing() -> Pacing:
    """As after handlers of 40 us: a batch of up to 125 is one chunk (5 ms), claimed in calls of
    STREAM_STEP (each carries over STREAM_WORK of handler time), so its handlers overlap Redis."""
    pacing = Pacing()
    pacing.mean = 40e-6
    assert pacing.chunk(3 * STREAM_STEP + 5) == 3 * STREAM_STEP + 5 and pacing.step(100) == STREAM_STEP
    return pacing


def test_a_chunks_handlers_start_while_redis_still_claims_the_rest_of_it(streamed: Deduplicator) -> None:
    n = 3 * STREAM_STEP + 5  # four claim calls
    reads_seen: list[int] = []

    def work(i: int) -> int:
        reads_seen.append(ReadCountingConnection.reads)
        return i

    decisions = decide_many(streamed, [(f"s-{i}", None, (lambda i=i: work(i))) for i in range(n)],
                            pacing=streaming_pacing())
    assert [d.reason for d in decisions] == [Reason.APPLIED] * n
    assert [d.value for d in decisions] == list(range(n))
    # one write claimed the chunk, one stored it: the round trips are those of one chunk
    sent = ReadCountingConnection.sent
    assert [scripts_in(r) for r in sent] == [{"claim"}, {"complete"}]
    assert sent[0].count(SCRIPT_CALL) == 4
    # the first handler ran once the first call's reply was read, before the other three were
    assert reads_seen[0] == 1
    assert reads_seen[-1] == 4
    assert all(streamed.status(f"s-{i}").state is State.DONE for i in (0, n - 1))


def test_a_streamed_call_carries_stream_work_of_handlers_or_the_whole_chunk() -> None:
    """Pacing.step: at least STREAM_STEP claims a call, enough for STREAM_WORK of handler time;
    the whole chunk when it all should take less (no-op handlers, duplicates: none run)."""
    fresh = Pacing()  # nothing seen: a handler is taken to last flush_after
    assert fresh.step(100) == STREAM_STEP
    steady = Pacing()
    steady.mean = 10e-6  # 100 handlers make STREAM_WORK (1 ms)
    assert steady.step(500) == math.ceil(STREAM_WORK / 10e-6) == 100
    assert steady.step(100) == 100 and steady.step(101) == 100
    steady.mean = 1e-7
    assert steady.step(500) == 500
    duplicates = Pacing()
    duplicates.mean, duplicates.acquired = 40e-6, 0.0  # a long run of duplicates: nothing to divide by
    assert duplicates.step(500) == 500
    assert duplicates.step(0) == 1


def test_a_flush_after_near_the_lease_claims_the_chunk_in_one_call(streamed: Deduplicator) -> None:
    """A streamed sub-chunk's claims are renewed only once its reply is read: with ``flush_after``
    over half the lease, earlier handlers could outlast those claims, so the chunk is one call."""
    n = 2 * STREAM_STEP + 1
    pacing = Pacing(streamed.lease)  # flush_after = the lease (5 s)
    pacing.mean = 1e-7
    decisions = decide_many(streamed, [(f"long-{i}", None, (lambda i=i: i)) for i in range(n)], pacing=pacing)
    assert [d.reason for d in decisions] == [Reason.APPLIED] * n
    sent = ReadCountingConnection.sent
    assert [scripts_in(r) for r in sent] == [{"claim"}, {"complete"}]
    assert sent[0].count(SCRIPT_CALL) == 1


def test_duplicates_are_answered_call_by_call_in_one_round_trip(streamed: Deduplicator) -> None:
    n = 2 * STREAM_STEP + 1
    decide_many(streamed, [(f"d-{i}", None, (lambda i=i: i)) for i in range(n)], pacing=fast_pacing())
    ReadCountingConnection.sent.clear()
    again = decide_many(streamed, [(f"d-{i}", None, (lambda: 1 / 0)) for i in range(n)], pacing=streaming_pacing())
    assert [d.reason for d in again] == [Reason.DUPLICATE] * n
    assert [d.value for d in again] == list(range(n))
    assert len(ReadCountingConnection.sent) == 1 and ReadCountingConnection.sent[0].count(SCRIPT_CALL) == 3


def test_fast_handlers_and_a_run_of_duplicates_claim_a_chunk_in_one_call(streamed: Deduplicator) -> None:
    """Where a chunk's handlers should take less than STREAM_WORK together, nothing would run
    while Redis claims: the chunk is one call (one wait on its reply, not one per call). No-op
    handlers; then the same keys again, with the pacing that a run of duplicates leaves (few
    claims ACQUIRED): one call too, though its handlers would be slow."""
    n = 3 * STREAM_STEP + 5
    first = decide_many(streamed, [(f"one-{i}", None, (lambda i=i: i)) for i in range(n)], pacing=fast_pacing())
    assert [d.reason for d in first] == [Reason.APPLIED] * n
    sent = ReadCountingConnection.sent
    assert [scripts_in(r) for r in sent] == [{"claim"}, {"complete"}]
    assert sent[0].count(SCRIPT_CALL) == 1
    sent.clear()
    pacing = streaming_pacing()
    pacing.acquired = 0.01  # as after a run of duplicates
    again = decide_many(streamed, [(f"one-{i}", None, (lambda: 1 / 0)) for i in range(n)], pacing=pacing)
    assert [d.reason for d in again] == [Reason.DUPLICATE] * n
    assert len(sent) == 1 and sent[0].count(SCRIPT_CALL) == 1


def test_a_connection_cut_mid_stream_defers_what_was_not_answered_and_runs_nothing_of_it(
        streamed: Deduplicator) -> None:
    n = 3 * STREAM_STEP
    runs: list[int] = []
    ReadCountingConnection.fail_at = 2  # the first claim call answered, the second reply lost

    def work(i: int) -> int:
        runs.append(i)
        return i

    decisions = decide_many(streamed, [(f"cut-{i}", None, (lambda i=i: work(i))) for i in range(n)],
                            pacing=streaming_pacing())
    ReadCountingConnection.fail_at = None
    assert runs == list(range(STREAM_STEP))  # only the answered sub-chunk ran
    # what ran is stored by the next round trip (the connection is back): APPLIED
    assert [d.reason for d in decisions[:STREAM_STEP]] == [Reason.APPLIED] * STREAM_STEP
    assert [d.reason for d in decisions[STREAM_STEP:]] == [Reason.STORE_UNAVAILABLE] * (n - STREAM_STEP)
    assert streamed.status(f"cut-{STREAM_STEP - 1}").state is State.DONE
    # the connection is usable again, and the keys Redis claimed without an answer are held
    # (until their leases run out), never run twice
    assert streamed.status(f"cut-{STREAM_STEP}").state is State.IN_PROGRESS


def test_a_noscript_in_a_streamed_round_trip_reloads_every_script_and_answers_in_order(
        private_redis: Any) -> None:
    client = redis.Redis.from_url(private_redis.url)
    dedupe = Deduplicator(client, namespace="noscript", lease=5.0, result_ttl=60.0)
    try:
        n = 2 * STREAM_STEP + 3
        first = decide_many(dedupe, [(f"ns-{i}", None, (lambda i=i: i)) for i in range(n)], pacing=streaming_pacing())
        assert all(d.reason is Reason.APPLIED for d in first)
        client.script_flush()
        runs: list[int] = []

        def work(i: int) -> int:
            runs.append(i)
            return -i

        keys = [f"ns-{i}" for i in range(n)] + [f"ns-new-{i}" for i in range(n)]
        again = decide_many(dedupe, [(k, None, (lambda i=i: work(i))) for i, k in enumerate(keys)],
                            pacing=streaming_pacing())
        assert [d.reason for d in again] == [Reason.DUPLICATE] * n + [Reason.APPLIED] * n
        assert [d.value for d in again] == list(range(n)) + [-i for i in range(n, 2 * n)]
        assert runs == list(range(n, 2 * n))
    finally:
        dedupe.close()


def test_an_interrupt_mid_stream_stores_what_finished_and_frees_every_other_claim(streamed: Deduplicator) -> None:
    n = 3 * STREAM_STEP
    stop_at = STREAM_STEP + 3

    def work(i: int) -> int:
        if i == stop_at:
            raise KeyboardInterrupt
        return i

    with pytest.raises(KeyboardInterrupt):
        decide_many(streamed, [(f"ki-{i}", None, (lambda i=i: work(i))) for i in range(n)],
                    pacing=streaming_pacing())
    states = [streamed.status(f"ki-{i}").state for i in range(n)]
    assert states[:stop_at] == [State.DONE] * stop_at
    assert states[stop_at:] == [State.FREE] * (n - stop_at)
    later = decide_many(streamed, [("ki-after", None, (lambda: 1))])  # the connection is in step
    assert later[0].reason is Reason.APPLIED and later[0].value == 1


def test_fail_open_with_redis_down_runs_a_key_once_and_defers_its_copy() -> None:
    client = redis.Redis(port=1, socket_connect_timeout=0.2)  # nothing listens there
    dedupe = Deduplicator(client, namespace="down", fail_open=True)
    runs: list[str] = []

    def work(key: str) -> str:
        runs.append(key)
        return key

    try:
        decisions = decide_many(dedupe, [(k, None, (lambda k=k: work(k))) for k in ("a", "b", "a")])
    finally:
        dedupe.close()
    assert runs == ["a", "b"]  # without deduplication, but never twice in one batch
    assert [d.reason for d in decisions] == [Reason.APPLIED, Reason.APPLIED, Reason.STORE_UNAVAILABLE]


def test_a_long_run_of_duplicates_keeps_claiming_whole_batches() -> None:
    """Every sub-chunk of duplicates halves the share of claims that run a handler; after a few
    dozen batches of them it is so small that ``flush_after`` divided by it overflowed (an
    OverflowError out of ``decide_many``, which never raises, around batch 60 of a replay)."""
    for mean in (None, 1e-6):
        pacing = Pacing()
        pacing.mean = mean
        for n in range(1100 * 16):  # sub-chunks of 32 duplicates, 16 per batch of 500
            pacing.claimed(32, 0)
            assert pacing.chunk(500) == 500 or n < 16


def test_verdicts_are_built_when_asked_for_and_equal_what_a_single_decide_gives(dedupe: Deduplicator) -> None:
    """The engine keeps an ACK's verdict in its columns: ``Verdicts.reasons`` is there at once, a
    Decision is built on first access (once: the same object after), and what it holds is what
    ``decide`` answers for the same key (the claim's key, token, stem, fingerprint and ttl, the
    stored value decoded)."""
    values = {"n": None, "v": {"a": [1, 2]}, "big": "x" * 2000, "s": "text"}
    first = decide_many(dedupe, [(k, f"fp-{k}", (lambda v=v: v)) for k, v in values.items()], ttl=90)
    items = [(k, f"fp-{k}", (lambda: pytest.fail("a duplicate ran"))) for k in values]
    verdicts = dedupe._drive(verdicts_flow(dedupe, [k for k, _, _ in items], [fp for _, fp, _ in items],
                                          lambda handler: handler(), [h for _, _, h in items], ttl=90))
    assert verdicts.reasons == [Reason.DUPLICATE] * len(values)
    assert all(d is None for d in verdicts._batch.decisions)  # nothing built yet
    for i, (key, value) in enumerate(values.items()):
        built = verdicts[i]
        assert built is verdicts[i] and built is verdicts[i - len(values)]
        single = decide(dedupe, key, lambda: pytest.fail("a duplicate ran"), fingerprint=f"fp-{key}", ttl=90)
        assert built == single and built.value == value == first[i].value
        assert (built.claim.key, built.claim.token, built.claim.stem, built.claim.fingerprint, built.claim.ttl) == (
            single.claim.key, single.claim.token, single.claim.stem, single.claim.fingerprint, 90)
    with pytest.raises(IndexError):
        verdicts[len(values)]
    assert [d.reason for d in first] == [Reason.APPLIED] * len(values)
    assert [d.claim.token for d in first] == [d.claim.token for d in verdicts.all()]


#: One key's records made unreadable, each as the review found them: ``(suffix, type, value)``.
CORRUPT = {
    "short value at the stem": ("", "string", b"1"),
    "truncated format-2 record": ("", "string", b"C" + (7).to_bytes(8, "big") + b"\x00\x40" + b"fp"),
    "list at the stem": ("", "list", b"x"),
    "string at the started key": (":started", "string", b"1"),
    "string at the format-1 result key": (":result", "string", b"1"),
    "format-1 hash of an unknown status": (":result", "hash", b"x"),
}


def corrupt(client: redis.Redis, stem: str, variant: str) -> None:
    suffix, kind, value = CORRUPT[variant]
    name = stem + suffix
    if kind == "string":
        client.set(name, value)
    elif kind == "list":
        client.rpush(name, value)
    else:
        client.hset(name, mapping={"s": value, "v": b"null", "t": 1})


@pytest.mark.parametrize("record_format", [1, 2])
@pytest.mark.parametrize("variant", sorted(CORRUPT))
def test_one_unreadable_record_sets_its_message_aside_and_the_batch_of_8_is_decided(
        redis_client: redis.Redis, redis_url: str, namespace: str, variant: str, record_format: int,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A batch of 8 with one key whose records are not ours: that key is UNREADABLE_RECORD
    (dead-lettered with what lies there, not run, nothing written), the 7 others are applied in
    the same batch, a copy of the bad key is answered alike; ``dedupe-worker forget KEY --force``
    removes the record (refused without ``--force``), and the key then runs once."""
    from dedupe_worker import Action
    from dedupe_worker.cli import main

    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0)
    dedupe.store.write_format(record_format)
    corrupt(redis_client, f"{namespace}:{{k3}}", variant)
    before = sorted(redis_client.scan_iter(match=f"{namespace}:*"))
    ran: list[str] = []
    keys = [f"k{i}" for i in range(8)] + ["k3"]
    decisions = decide_many(dedupe, [(k, None, (lambda k=k: ran.append(k) or k)) for k in keys])
    reasons = [d.reason for d in decisions]
    assert reasons == [Reason.APPLIED] * 3 + [Reason.UNREADABLE_RECORD] + [Reason.APPLIED] * 4 \
        + [Reason.UNREADABLE_RECORD]
    assert sorted(ran) == [k for k in keys[:8] if k != "k3"]
    bad = decisions[3]
    assert bad.action is Action.DEAD_LETTER and "k3" in bad.detail and "forget --force" in bad.detail
    assert sorted(redis_client.scan_iter(match=f"{namespace}:{{k3}}*")) == [
        k for k in before if k.startswith(f"{namespace}:{{k3}}".encode())]  # nothing written for it

    def forget(*flags: str) -> tuple[int, str]:
        code = main(["forget", "--redis-url", redis_url, "--namespace", namespace, *flags, "k3"])
        return code, capsys.readouterr().out

    code, out = forget()
    assert code == 1 and "refused" in out and "--force" in out
    code, out = forget("--force", "--dry-run")
    assert code == 0 and "would be removed (unreadable" in out
    code, out = forget("--force")
    assert code == 0 and "k3: removed" in out, out
    assert not list(redis_client.scan_iter(match=f"{namespace}:{{k3}}*"))
    again = decide_many(dedupe, [(k, None, (lambda k=k: ran.append(k) or k)) for k in keys[:8]])
    assert [d.reason for d in again] == [Reason.DUPLICATE] * 3 + [Reason.APPLIED] + [Reason.DUPLICATE] * 4
    assert ran.count("k3") == 1
    dedupe.close()


def test_a_batchs_leases_are_renewed_while_its_handlers_run_past_the_lease(redis_client: redis.Redis,
                                                                          namespace: str) -> None:
    """The claims of a chunk are kept alive as one group: a handler that runs past the lease still
    holds its key (another worker is answered IN_PROGRESS), and its outcome is stored."""
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=0.3, renew_interval=0.05, result_ttl=60)
    other = Deduplicator(redis_client, namespace=namespace, lease=0.3, renew_interval=0.05, result_ttl=60)
    seen: list[str] = []

    def slow(key: str) -> str:
        time.sleep(0.6)  # twice the lease
        seen.append(other.begin(key).outcome.name)
        return key

    try:
        decisions = decide_many(dedupe, [(k, None, (lambda k=k: slow(k))) for k in ("g1", "g2")],
                                pacing=Pacing(flush_after=1.0))
        assert [d.reason for d in decisions] == [Reason.APPLIED, Reason.APPLIED]
        assert seen == ["IN_PROGRESS", "IN_PROGRESS"]
        assert not dedupe.renewer._book.groups  # every group let go once stored
    finally:
        dedupe.close()
        other.close()
