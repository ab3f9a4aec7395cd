"""IdempotentTask in eager mode (users' unit tests), on direct calls, and its options (real Redis)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, chain

import dedupe_worker.celery
from dedupe_worker import (
    OMITTED,
    Deduplicator,
    InProgress,
    InvalidKey,
    KeyConflict,
    PreviouslyFailed,
    ResultNotSerializable,
)
from dedupe_worker.celery import IdempotentTask
from dedupe_worker.celery._options import AppSettings

from . import celery_fixtures
from .celery_fixtures import PermanentError, effects, make_app

celery_config = celery_fixtures.celery_config


@pytest.fixture
def eager_app(celery_config: dict[str, Any]) -> Iterator[Celery]:
    app = make_app(**celery_config, eager=True)
    yield app
    app.close()


def count(app: Celery, *parts: Any) -> int:
    with effects(app) as r:
        return int(r.get(":".join(["fx", app.conf.dedupe_namespace, *map(str, parts)])) or 0)


def test_public_names() -> None:
    assert dedupe_worker.celery.__all__ == ["DEFERRALS_HEADER", "IdempotentTask", "current_claim"]


def test_eager_duplicate_returns_the_stored_result(eager_app: Celery) -> None:
    charge = eager_app.tasks["dt.charge"]
    first = charge.delay(1, 10).get()
    second = charge.delay(1, 10).get()

    assert first == second
    assert first["fencing_token"] == first["claim_token"] >= 1
    assert count(eager_app, "charge", 1) == 1
    assert count(eager_app, "duplicates") == 1


def test_eager_conflicting_payload_raises_key_conflict(eager_app: Celery) -> None:
    charge = eager_app.tasks["dt.charge"]
    charge.delay(2, 10).get()
    with pytest.raises(KeyConflict):
        charge.delay(2, 11)
    assert count(eager_app, "charge-started", 2) == 1


def test_eager_autoretry_claims_again_after_a_failing_body(eager_app: Celery) -> None:
    # As with any Celery task, eager retries need task_eager_propagates off (else Retry is raised).
    eager_app.conf.task_eager_propagates = False
    assert eager_app.tasks["dt.flaky"].delay("e1", fail_times=2).get() == {"attempt": 3, "retries": 2}
    assert count(eager_app, "flaky", "e1") == 3


def test_eager_permanent_failure_then_previously_failed(eager_app: Celery) -> None:
    doomed = eager_app.tasks["dt.doomed"]
    with pytest.raises(PermanentError):
        doomed.delay("e2")
    with pytest.raises(PreviouslyFailed):
        doomed.delay("e2")
    assert count(eager_app, "doomed", "e2") == 1


def test_eager_in_progress_elsewhere_raises_instead_of_spinning(eager_app: Celery, redis_url: str) -> None:
    other = Deduplicator(redis.Redis.from_url(redis_url), namespace=eager_app.conf.dedupe_namespace, lease=5)
    held = other.begin("charge:3")
    with pytest.raises(InProgress) as caught:
        eager_app.tasks["dt.charge"].delay(3, 10)
    assert caught.value.retry_after > 0
    assert count(eager_app, "charge-started", 3) == 0
    other.release(held)
    assert eager_app.tasks["dt.charge"].delay(3, 10).get()["fencing_token"] > held.token


def test_eager_chain_with_a_duplicate_link(eager_app: Celery) -> None:
    charge, total = eager_app.tasks["dt.charge"], eager_app.tasks["dt.total"]
    assert chain(charge.s(4, 5), total.s()).apply_async().get() == 10
    assert chain(charge.s(4, 5), total.s()).apply_async().get() == 10
    assert count(eager_app, "charge", 4) == 1
    assert count(eager_app, "total", 4) == 2


def test_direct_call_is_deduplicated_too(eager_app: Celery) -> None:
    charge = eager_app.tasks["dt.charge"]
    assert charge(5, 50) == charge(5, 50)
    assert count(eager_app, "charge", 5) == 1


def test_default_key_is_the_same_for_positional_and_keyword_arguments(eager_app: Celery) -> None:
    tagged = eager_app.tasks["dt.tagged"]
    assert tagged.delay("x").get() == tagged.delay(tag="x").get()
    assert count(eager_app, "tagged", "x") == 1


def test_header_key_in_eager_mode(eager_app: Celery) -> None:
    tagged = eager_app.tasks["dt.tagged"]
    assert tagged.apply_async(("y",), headers={"idempotency_key": "h1"}).get() == "y:h1"
    assert tagged.apply_async(("y",), headers={"idempotency_key": "h1"}).get() == "y:h1"
    assert count(eager_app, "tagged", "y") == 1


def test_format_string_key_and_a_key_function_that_fails(eager_app: Celery) -> None:
    calls: list[int] = []

    @eager_app.task(base=IdempotentTask, shared=False, name="dt.formatted",
                    idempotency_key="order:{order_id}")
    def formatted(order_id: int, note: str = "") -> int:
        calls.append(order_id)
        return order_id

    @eager_app.task(base=IdempotentTask, shared=False, name="dt.badkey",
                    idempotency_key=lambda order, **_: order["id"])
    def badkey(order: Any) -> None:
        calls.append(-1)

    assert formatted.delay(7).get() == formatted.delay(order_id=7).get() == 7
    assert formatted.deduplicator.status("order:7").state == "done"
    with pytest.raises(InvalidKey):
        badkey.delay("not a dict")
    assert calls == [7]


def test_fingerprint_option_false_disables_the_conflict_check(eager_app: Celery) -> None:
    @eager_app.task(base=IdempotentTask, shared=False, name="dt.nofp", idempotency_fingerprint=False,
                    idempotency_key=lambda user, **_: f"welcome:{user}")
    def welcome(user: str, text: str) -> str:
        return text

    assert welcome.delay("ann", "hello").get() == "hello"
    assert welcome.delay("ann", "hi there").get() == "hello"  # same key, other payload: a duplicate


def test_unserializable_result_fails_once_and_later_copies_get_omitted(eager_app: Celery) -> None:
    runs: list[str] = []

    @eager_app.task(base=IdempotentTask, shared=False, name="dt.raw")
    def raw(name: str) -> bytes:
        runs.append(name)
        return name.encode()

    with pytest.raises(ResultNotSerializable):
        raw.delay("blob")
    assert raw.delay("blob").get() is OMITTED  # the body ran; it is not run again
    assert runs == ["blob"]


def test_settings_come_from_task_then_app_then_environment(
        celery_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEDUPE_LEASE", "7")
    monkeypatch.setenv("DEDUPE_NAMESPACE", "from-env")
    apps = [Celery(f"settings-{i}", set_as_current=False) for i in range(2)]
    for app in apps:
        app.conf.dedupe_redis_url = celery_config["backend"]
        app.conf.dedupe_result_ttl = 99
        app.conf.dedupe_compression = "zlib"
    apps[1].conf.dedupe_lease = 3
    tasks = []
    for app in apps:
        @app.task(base=IdempotentTask, shared=False, name="s.env")
        def from_env() -> None: ...

        @app.task(base=IdempotentTask, shared=False, name="s.task", dedupe_lease=1.5, dedupe_namespace="mine",
                  dedupe_compress_above=64)
        def from_task() -> None: ...

        tasks.append((from_env.deduplicator, from_task.deduplicator))

    (env, own), (conf, own_again) = tasks
    assert (env.lease, env.layout.namespace, env.result_ttl) == (7.0, "from-env", 99)
    assert (own.lease, own.layout.namespace, own.result_ttl) == (1.5, "mine", 99)
    assert (conf.lease, conf.layout.namespace) == (3.0, "from-env")
    assert (env.packer.above, env.packer.codec, own.packer.above) == (1024, "zlib", 64)
    assert own_again is own  # same settings, same process: one Deduplicator, one renewer thread
    for app in apps:
        app.close()


def test_per_call_settings_see_the_app_changed_since_the_last_call() -> None:
    class Config:
        dedupe_on_send = True

    app = Celery("per-call", set_as_current=False)
    app.config_from_object(Config)
    settings = AppSettings(app.conf)
    assert (settings.get("dedupe_on_send"), settings.get("dedupe_ttl")) == (True, None)
    app.conf.dedupe_ttl = 13  # set on the app: the next call sees it
    app.conf.update(dedupe_on_send=False)
    assert (settings.get("dedupe_on_send"), settings.get("dedupe_ttl")) == (False, 13)
    app.conf.dedupe_ttl = 14
    assert settings.get("dedupe_ttl") == 14
    app.conf.add_defaults({"dedupe_send_ttl": 5})  # another layer below: read again
    assert settings.get("dedupe_send_ttl") == 5
    named = Celery("per-call-ns", set_as_current=False)
    named.config_from_object({"CELERY_DEDUPE_TTL": 21}, namespace="CELERY")
    assert AppSettings(named.conf).get("dedupe_ttl") == named.conf.get("dedupe_ttl") == 21
    app.close()
    named.close()


def test_crash_safety_defaults() -> None:
    assert IdempotentTask.acks_late is True
    assert IdempotentTask.reject_on_worker_lost is True


def test_hooks_and_retry_options_are_the_shared_ones(eager_app: Celery) -> None:
    from dedupe_worker._engine import Hooks, RetryPolicy
    from dedupe_worker.kafka import DedupeKafkaConsumer
    from dedupe_worker.rabbitmq import DedupeConsumer

    for cls in (IdempotentTask, DedupeConsumer, DedupeKafkaConsumer):
        assert issubclass(cls, Hooks) and issubclass(cls, RetryPolicy)
        for name in ("max_attempts", "retry_base", "retry_cap", "defer_base", "defer_cap"):
            assert getattr(cls, name) == getattr(RetryPolicy, name), (cls, name)
    seen: list[tuple[str, Any]] = []

    class Hooked(IdempotentTask):
        def on_applied(self, message: Any, decision: Any) -> None:
            seen.append(("applied", message.id))

        def on_duplicate(self, message: Any, decision: Any) -> None:
            seen.append(("duplicate", decision.value))

        def on_dead_letter(self, message: Any, decision: Any) -> None:
            seen.append(("dead_letter", decision.reason.value))

    @eager_app.task(base=Hooked, name="dt.hooked", idempotency_key=lambda n: f"hooked:{n}")
    def hooked(n: int) -> int:
        return n * 2

    first = hooked.apply(args=(3,), task_id="t-1")
    assert first.get() == 6 and hooked.apply(args=(3,)).get() == 6
    assert seen == [("applied", "t-1"), ("duplicate", 6)]
    hooked.idempotency_fingerprint = lambda n: "another payload"  # same key, other payload: conflict
    with pytest.raises(KeyConflict):
        hooked.apply(args=(3,)).get()
    assert seen[-1] == ("dead_letter", "conflict")
