"""The shared decision every integration maps onto its broker."""

from __future__ import annotations

import time

import pytest
import redis

from dedupe_worker import Action, Deduplicator, MissingKey, Reason, current_claim, decide, decide_many
from dedupe_worker._engine import poison
from dedupe_worker._messages.deadletter import dead_letter_headers


def test_each_outcome_maps_to_one_action(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, permanent_errors=(LookupError,))
    assert decide(d, "a", lambda: 1, fingerprint="payload-1").reason is Reason.APPLIED
    dup = decide(d, "a", lambda: 2, fingerprint="payload-1")
    assert (dup.action, dup.reason, dup.value) == (Action.ACK, Reason.DUPLICATE, 1)
    d.begin("held")
    held = decide(d, "held", lambda: 3)
    assert held.action is Action.DEFER and held.retry_after > 0
    assert decide(d, "a", lambda: 1, fingerprint="payload-2").action is Action.DEAD_LETTER

    def boom() -> None:
        raise RuntimeError("flaky")

    failed = decide(d, "b", boom)
    assert (failed.action, failed.reason, str(failed.error)) == (Action.RETRY, Reason.HANDLER_ERROR, "flaky")
    assert decide(d, "b", lambda: "retried").reason is Reason.APPLIED

    def missing() -> None:
        raise KeyError("no such account")

    assert decide(d, "c", missing).action is Action.DEAD_LETTER
    assert decide(d, "c", lambda: 1).reason is Reason.PREVIOUSLY_FAILED
    assert decide(d, "", lambda: 1).reason is Reason.INVALID_KEY
    assert decide(d, "d", lambda: object()).reason is Reason.UNSERIALIZABLE_RESULT


def test_lease_lost_is_deferred_not_acked(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.2, renew_interval=10)

    def stalls() -> str:
        time.sleep(0.3)
        d.begin("k")  # a successor takes the expired claim
        return "late"

    decision = decide(d, "k", stalls)
    assert decision.action is Action.DEFER and decision.reason is Reason.LEASE_LOST


def test_batch_claims_and_completes_in_order(dedupe: Deduplicator) -> None:
    dedupe.run("seen", lambda: "old")
    tokens = []

    def handler(v: str) -> str:
        tokens.append(current_claim().token)  # type: ignore[union-attr]
        if v == "bad":
            raise ValueError(v)
        return v.upper()

    items = [(k, None, (lambda k=k: handler(k))) for k in ["x", "seen", "bad", "x", "", "y"]]
    decisions = decide_many(dedupe, items)
    assert [x.reason for x in decisions] == [
        Reason.APPLIED, Reason.DUPLICATE, Reason.HANDLER_ERROR, Reason.DUPLICATE, Reason.INVALID_KEY, Reason.APPLIED,
    ]
    assert [x.value for x in decisions] == ["X", "old", None, "X", None, "Y"]
    ran = [d.token for d in decisions if d.reason in (Reason.APPLIED, Reason.HANDLER_ERROR)]
    assert tokens == ran and all(t > 0 for t in tokens)  # each handler saw its own claim's token
    assert dedupe.begin("bad").acquired  # released for a retry
    assert dedupe.begin("y").result == "Y"


def test_batch_reports_unserialisable_results_like_decide(dedupe: Deduplicator) -> None:
    decisions = decide_many(dedupe, [("a", None, lambda: object()), ("b", None, lambda: "fine")])
    assert [x.reason for x in decisions] == [Reason.UNSERIALIZABLE_RESULT, Reason.APPLIED]
    assert decisions[0].action is Action.DEAD_LETTER
    assert dedupe.begin("a").omitted  # the handler ran: recorded done, never re-applied


def test_batch_conflict_and_in_progress(dedupe: Deduplicator) -> None:
    dedupe.begin("held", fingerprint="a")
    decisions = decide_many(dedupe, [("held", "a", lambda: 1), ("held", "b", lambda: 1)])
    assert [x.reason for x in decisions] == [Reason.IN_PROGRESS, Reason.CONFLICT]


def test_dead_letter_headers_name_reason_error_and_origin() -> None:
    decision = poison(MissingKey("message has no 'idempotency-key' header"))
    headers = dead_letter_headers(decision, attempts=3, original_topic="payments", original_offset=7)
    assert headers == {
        "x-dedupe-reason": "invalid_key",
        "x-dedupe-error": "MissingKey: message has no 'idempotency-key' header",
        "x-dedupe-attempts": "3",
        "x-dedupe-original-topic": "payments",
        "x-dedupe-original-offset": "7",
    }


@pytest.mark.parametrize("attempt", [1, 3, 10])
def test_backoff_stays_in_bounds(attempt: int) -> None:
    from dedupe_worker._engine.policy import backoff

    for _ in range(100):
        value = backoff(attempt, base=0.1, cap=2.0, floor=0.5)
        assert 0.5 <= value <= 0.5 + min(2.0, 0.1 * 2 ** (attempt - 1))
