"""The claim protocol, transition by transition, on a real Redis (records and TTLs included)."""

from __future__ import annotations

import time

import pytest
import redis

from dedupe_worker import OMITTED, Action, Deduplicator, LeaseLost, Outcome, Reason, StoreUnavailable, decide
from dedupe_worker._protocol.layout import KeyLayout

from .doubles import redis_or_double  # noqa: F401 - each test runs on Redis and on the double


def keys_of(d: Deduplicator, key: str) -> tuple[str, str]:
    """The started key and the key the outcome is stored at in the format ``d`` writes."""
    stem = d.layout.stem(d.layout.stored_key(key)[0])
    return KeyLayout.started(stem), (KeyLayout.record(stem) if d.store.record_format == 2 else KeyLayout.result(stem))


def test_first_claim_acquires_with_a_clock_token_and_records_a_lease(
    dedupe: Deduplicator, redis_client: redis.Redis
) -> None:
    claim = dedupe.begin("order-1", fingerprint="fp-a")
    assert claim.outcome is Outcome.ACQUIRED and 0 < claim.token < 2**53
    started, result = keys_of(dedupe, "order-1")
    fields = redis_client.hgetall(started)
    token = str(claim.token).encode()
    assert fields[b"owner"] == token and fields[b"next"] == token and fields[b"fp"] == b"fp-a"
    seconds, micros = redis_client.time()
    assert 0 <= seconds * 1_000_000 + micros - claim.token < 5_000_000  # Redis' clock, in µs
    server_ms = seconds * 1000
    assert 0 < int(fields[b"deadline"]) - server_ms <= 6000  # lease 5 s, on Redis' clock
    assert not redis_client.exists(result)
    # the started key outlives the lease (it keeps the token counter) but never lives forever
    assert 5000 < redis_client.pttl(started) <= 60_000


def test_second_claim_while_held_is_in_progress_with_remaining_lease(dedupe: Deduplicator) -> None:
    first = dedupe.begin("k")
    second = dedupe.begin("k")
    assert second.outcome is Outcome.IN_PROGRESS
    assert second.token == first.token
    assert 4.0 < second.retry_after <= 5.0


def test_complete_stores_result_with_ttl_and_drops_the_lease(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    claim = dedupe.begin("k", fingerprint="fp")
    dedupe.complete(claim, {"charged": 12.5, "currency": "EUR"})
    started, result = keys_of(dedupe, "k")
    assert not redis_client.exists(started)
    assert 55_000 < redis_client.pttl(result) <= 60_000
    again = dedupe.begin("k", fingerprint="fp")
    assert again.outcome is Outcome.DUPLICATE
    assert again.result == {"charged": 12.5, "currency": "EUR"}
    assert again.token == claim.token and not again.failed


def test_conflict_on_a_different_fingerprint_while_held_and_after_completion(dedupe: Deduplicator) -> None:
    claim = dedupe.begin("k", fingerprint="payload-a")
    assert dedupe.begin("k", fingerprint="payload-b").outcome is Outcome.CONFLICT
    dedupe.complete(claim, 1)
    assert dedupe.begin("k", fingerprint="payload-b").outcome is Outcome.CONFLICT
    assert dedupe.begin("k", fingerprint="payload-a").outcome is Outcome.DUPLICATE
    assert dedupe.begin("k").outcome is Outcome.DUPLICATE  # no fingerprint: no check


def test_release_frees_the_key_and_the_next_token_is_larger(dedupe: Deduplicator) -> None:
    first = dedupe.begin("k")
    assert dedupe.release(first) is True
    second = dedupe.begin("k")
    assert second.outcome is Outcome.ACQUIRED and second.token > first.token
    assert dedupe.release(first) is False  # stale token: nothing changes
    assert dedupe.begin("k").outcome is Outcome.IN_PROGRESS


def test_tokens_increase_across_lease_expiry(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.15, result_ttl=30)
    tokens = []
    for _ in range(3):
        claim = d.begin("k")
        assert claim.outcome is Outcome.ACQUIRED
        tokens.append(claim.token)
        time.sleep(0.2)
    assert tokens == sorted(set(tokens)) and len(tokens) == 3  # strictly increasing


def test_zombie_completion_is_fenced_off(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.2, result_ttl=30)
    a = d.begin("payment-9")
    time.sleep(0.3)  # A is paused past its lease
    b = d.begin("payment-9")
    assert b.outcome is Outcome.ACQUIRED and b.token > a.token
    d.complete(b, "B's result")
    with pytest.raises(LeaseLost) as info:
        d.complete(a, "A's late result")
    assert info.value.token == a.token
    assert d.begin("payment-9").result == "B's result"


def test_zombie_cannot_complete_over_a_live_successor(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.2, result_ttl=30)
    a = d.begin("k")
    time.sleep(0.3)
    b = d.begin("k")
    with pytest.raises(LeaseLost):
        d.complete(a, "late")
    assert d.renew(a) is False and d.release(a) is False
    assert d.begin("k").outcome is Outcome.IN_PROGRESS  # B's lease is untouched
    d.complete(b, "ok")


def test_renew_extends_only_the_owner(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.3, result_ttl=30)
    claim = d.begin("k")
    for _ in range(4):
        time.sleep(0.15)
        assert d.renew(claim) is True
    assert d.begin("k").outcome is Outcome.IN_PROGRESS  # 0.6 s later, still ours
    d.complete(claim, None)
    assert d.renew(claim) is False


def test_an_expired_lease_nobody_took_is_still_ours(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.1, result_ttl=30)
    claim = d.begin("k")
    time.sleep(0.15)
    d.complete(claim, "late but unopposed")
    assert d.begin("k").result == "late but unopposed"


def test_fail_stores_a_permanent_failure(dedupe: Deduplicator) -> None:
    claim = dedupe.begin("k")
    dedupe.fail(claim, ValueError("card declined"))
    again = dedupe.begin("k")
    assert again.outcome is Outcome.DUPLICATE and again.failed
    assert again.error == {"type": "builtins.ValueError", "message": "card declined"}


def test_result_ttl_ends_protection(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=1, result_ttl=0.2)
    d.complete(d.begin("k"), 1)
    assert d.begin("k").outcome is Outcome.DUPLICATE
    time.sleep(0.3)
    assert d.begin("k").outcome is Outcome.ACQUIRED


def test_released_records_expire_after_retention(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.1, result_ttl=30, token_retention=0.3)
    d.release(d.begin("k"))
    started, _ = keys_of(d, "k")
    assert 0 < redis_client.pttl(started) <= 300
    time.sleep(0.4)
    assert not redis_client.exists(started)


def test_oversized_result_is_stored_as_omitted(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, max_result_bytes=100)
    assert d.run("k", lambda: "x" * 1000) == "x" * 1000  # the caller still gets its value
    assert d.begin("k").result is OMITTED
    assert d.run("k", lambda: "never") is OMITTED


def test_status_reads_without_changing(dedupe: Deduplicator) -> None:
    assert dedupe.status("k").state == "free"
    claim = dedupe.begin("k")
    state = dedupe.status("k")
    assert state.state == "in_progress" and state.token == claim.token and state.remaining_ms > 0
    dedupe.complete(claim, [1, 2])
    assert dedupe.status("k").state == "done" and dedupe.status("k").status == "c"
    assert dedupe.begin("k").outcome is Outcome.DUPLICATE


def test_script_cache_flush_is_survived(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    dedupe.begin("warm")
    redis_client.script_flush()
    assert dedupe.begin("k").outcome is Outcome.ACQUIRED
    redis_client.script_flush()
    assert dedupe.begin_many(["a", "b"])[1].outcome is Outcome.ACQUIRED


def test_a_retried_completion_that_already_succeeded_answers_stored(dedupe: Deduplicator) -> None:
    """After a failover or a connection reset the reply of a completion can be lost and the call
    retried: the retry finds our token on the stored result and answers stored, not LEASE_LOST."""
    from dedupe_worker import Stored

    claim = dedupe.begin("retried")
    row = [(claim.stem, claim.token, Stored.COMPLETED, b'"v"')]
    assert dedupe.store.scripts.call_all(dedupe.store.complete_calls(row, 60_000)) == [[1]]
    assert dedupe.store.scripts.call_all(dedupe.store.complete_calls(row, 60_000)) == [[1]]  # the retry
    later = dedupe.begin("retried")
    assert later.outcome is Outcome.DUPLICATE and later.result == "v"
    other = [(claim.stem, claim.token - 1, Stored.COMPLETED, b'"x"')]
    assert dedupe.store.scripts.call_all(dedupe.store.complete_calls(other, 60_000)) == [[0]]  # another token: refused


def test_renewer_tracks_again_at_once_after_close(dedupe: Deduplicator) -> None:
    """A claim tracked right after close() is renewed by a new thread, not left to the closing one."""
    renewer = dedupe.renewer
    claim = dedupe.begin("tracked-after-close")
    renewer.track(claim.stem, claim.token)
    first = renewer._thread
    assert first is not None
    renewer.close()
    renewer.track(claim.stem, claim.token)  # the first thread has not even woken up yet
    first.join(5)
    assert not first.is_alive()
    second = renewer._thread
    assert second is not None and second is not first and second.is_alive()
    renewer.untrack(claim.stem, claim.token)
    renewer.untrack(claim.stem, claim.token)
    renewer.close()
    second.join(5)
    assert renewer._thread is None  # the loop says so when it ends: the next track() starts one


def test_renewer_tracks_a_chunk_per_holder(dedupe: Deduplicator) -> None:
    """``track_many``/``untrack_many`` (one lock per chunk, as the batch engine uses them) count
    holders like ``track``/``untrack``: a lease is renewed until its last holder lets go."""
    a, b = dedupe.begin("lease-a"), dedupe.begin("lease-b")
    leases = [(a.stem, a.token), (b.stem, b.token)]
    renewer = dedupe.renewer
    renewer.track_many(leases)
    renewer.track(a.stem, a.token)
    renewer.untrack_many(leases)
    ttl_before = dedupe.store.client.pttl(a.stem + ":started")
    dedupe.store.client.pexpire(a.stem + ":started", 1000)
    dedupe.store.client.pexpire(b.stem + ":started", 1000)
    renewer.renew_now()
    assert dedupe.store.client.pttl(a.stem + ":started") > 1000  # still held once: renewed
    assert dedupe.store.client.pttl(b.stem + ":started") <= 1000  # let go: not renewed
    assert ttl_before > 0
    renewer.untrack(a.stem, a.token)
    dedupe.store.client.pexpire(a.stem + ":started", 1000)
    renewer.renew_now()
    assert dedupe.store.client.pttl(a.stem + ":started") <= 1000


@pytest.mark.parametrize("cls", ["Claim", "Decision"])
def test_init_takes_exactly_the_declared_fields_and_defaults(cls: str) -> None:
    """``Claim`` and ``Decision`` have hand-written ``__init__`` (speed): each must match its
    dataclass fields, and the instance stay frozen."""
    import dataclasses
    import inspect

    import dedupe_worker

    kind = getattr(dedupe_worker, cls)
    params = list(inspect.signature(kind.__init__).parameters.values())[1:]
    fields = dataclasses.fields(kind)
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [inspect.Parameter.empty if f.default is dataclasses.MISSING
                                           else f.default for f in fields]
    claim = dedupe_worker.Claim("k", Outcome.ACQUIRED, 7, stem="s")
    instance = claim if cls == "Claim" else dedupe_worker.Decision(dedupe_worker.Reason.APPLIED, claim, 1)
    assert set(vars(instance)) == {f.name for f in fields}
    assert dataclasses.replace(claim, token=8).token == 8 and claim.token == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        instance.token = 9  # type: ignore[misc]


@pytest.mark.parametrize(("suffix", "says"), [("", "20-byte string that is not a format-2 record"),
                                               (":result", "holds a string, not a hash")])
def test_a_record_we_never_wrote_is_unreadable_for_its_key_alone(redis_client: redis.Redis, dedupe: Deduplicator,
                                                                 namespace: str, suffix: str, says: str) -> None:
    """Another program's string under one of our outcome key names (the stem, where format 2 keeps
    a string we would parse, or ``:result``, where format 1 keeps a hash): the claim answers
    UNREADABLE with what lies there (never run as new, nothing written), ``status`` raises
    :class:`UnreadableRecord` (a StoreUnavailable), and the verdict sets the message aside."""
    from dedupe_worker import UnreadableRecord

    redis_client.set(f"{namespace}:{{garbage}}{suffix}", b"not a record of ours")
    claim = dedupe.begin("garbage")
    assert claim.outcome is Outcome.UNREADABLE and not claim.acquired
    assert isinstance(claim.error, UnreadableRecord) and says in claim.error.detail
    with pytest.raises(StoreUnavailable, match=says):
        dedupe.status("garbage")
    ran: list[int] = []
    decision = decide(dedupe, "garbage", lambda: ran.append(1))
    assert decision.reason is Reason.UNREADABLE_RECORD and decision.action is Action.DEAD_LETTER and ran == []
    assert says in decision.detail and "forget --force" in decision.detail
    assert redis_client.type(f"{namespace}:{{garbage}}{suffix}") == b"string"  # left as it was
    assert not redis_client.exists(f"{namespace}:{{garbage}}:started")


def test_a_lease_group_is_renewed_marked_lost_and_let_go_as_its_single_leases_are() -> None:
    """``LeaseBook`` groups (a batch's claims, tracked together): every member is due for
    renewal; a refused renewal marks a member lost unless its group is settling or gone; letting
    the group go forgets its members, lost marks included."""
    from types import SimpleNamespace

    from dedupe_worker._protocol.leases import LeaseBook

    book = LeaseBook()
    claims = [SimpleNamespace(stem=f"s{i}", token=i) for i in range(3)]
    single = ("alone", 9)
    book.track(single)
    group = book.track_group(claims)
    other = book.track_group([SimpleNamespace(stem="t", token=7)])
    assert book.holds()
    assert sorted(book.due()) == sorted([single, ("s0", 0), ("s1", 1), ("s2", 2), ("t", 7)])
    assert book.refused(("s1", 1)) and ("s1", 1) in book.lost
    assert ("s1", 1) not in book.due()
    assert not book.refused(("s1", 2))  # not a member: another token
    book.settle_group(other)
    assert not book.refused(("t", 7))  # its completion is in flight: the write's reply decides
    book.untrack_group(group)
    assert ("s1", 1) not in book.lost and not book.refused(("s0", 0))
    book.untrack_group(other)
    book.untrack(single)
    assert not book.holds() and book.due() == []
