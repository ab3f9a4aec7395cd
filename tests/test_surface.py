"""The public surface: which modules are public, and exactly what each exports.

Every module whose dotted path has no ``_``-prefixed part is public; everything else is the
implementation and may move between releases without notice. A new public name or module is a
deliberate change to this file (and a line in CHANGELOG.md).
"""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import dedupe_worker

SURFACE: dict[str, list[str]] = {
    "dedupe_worker": [
        "OMITTED", "Action", "AlreadyApplied", "Claim", "ClaimClient", "ClaimError", "ClientOptions", "ConsumerOptions",
        "Decision", "DedupeError",
        "DedupeSettings", "Deduplicator", "Envelope", "EvictionPolicyError", "Hooks", "InProgress", "InvalidKey",
        "KeyConflict", "KeyState", "LeaseLost", "MissingKey", "Omitted", "Outcome", "PreviouslyFailed", "Reason",
        "ResultNotSerializable", "State", "StoreUnavailable", "Stored", "UndecodableMessage", "UnreadableRecord",
        "current_claim", "decide", "decide_many", "idempotent",
    ],
    "dedupe_worker.asyncio": [
        "AsyncClaimClient", "AsyncDeduplicator", "AsyncHandler", "AsyncItem", "AsyncKeyWaiter", "AsyncLeaseRenewer",
        "AsyncRedisStore", "async_redis_from_url", "current_claim", "decide", "decide_many", "execute", "idempotent",
        "run",
    ],
    "dedupe_worker.keys": [
        "KAFKA_DEFAULT", "RABBITMQ_DEFAULT", "KeyStrategy", "body_fingerprint", "canonical_json", "content_hash",
        "content_key", "field_key", "fingerprint_of", "first_of", "header_key", "message_id_key",
        "partition_key_with_hash", "position_key",
    ],
    "dedupe_worker.testing": ["in_memory", "in_memory_async"],
    "dedupe_worker.observe": ["Observer", "current", "enable_metrics", "enable_tracing"],
    "dedupe_worker.producers": [
        "DEFAULT_HEADER", "Sent", "broker_publish_once", "produce_once", "publish_once", "send_actor_once", "stamp",
    ],
    "dedupe_worker.celery": ["DEFERRALS_HEADER", "IdempotentTask", "current_claim"],
    "dedupe_worker.dramatiq": ["DEFERRALS_OPTION", "DeadLettered", "DedupeMiddleware", "current_claim"],
    "dedupe_worker.faststream": ["DLQ_SUFFIX", "DedupeMiddleware", "current_claim", "dedupe_middleware"],
    "dedupe_worker.rabbitmq": [
        "DEFERRALS", "DELAY_SUFFIX", "DLQ_SUFFIX", "ORIGINAL_USER_ID", "DedupeConsumer", "Handler",
        "PublishFailed", "Republisher", "delay_queue", "dlq",
    ],
    "dedupe_worker.kafka": ["ConsumerHooks", "DeadLetter", "DeadLetterProducer", "DedupeKafkaConsumer"],
    "dedupe_worker.http": [
        "IdempotencyMiddleware", "IdempotencyRules", "KeyProblem", "RequestInfo", "Response",
        "WSGIIdempotencyMiddleware", "applied_as_json", "asgi_user_scope", "current_claim", "flask_login_scope",
        "header_scope", "parse_key", "stored_status",
    ],
    "dedupe_worker.sql": ["AlreadyApplied", "Atomic", "AtomicOutcome", "NotCommitted", "SqlOutcomes", "atomic", "ddl"],
    "dedupe_worker.django": ["IdempotencyMiddleware", "atomic", "user_scope"],
    "dedupe_worker.replay": [
        "REPLAYED", "Destination", "Entry", "Found", "Pacer", "Planner", "Progress", "ReplayOptions", "Step",
        "Summary", "format_table", "replay_headers", "replay_kafka", "replay_rabbitmq",
    ],
    "dedupe_worker.cli": ["main"],
}

def public_module(name: str) -> types.ModuleType:
    if name == "dedupe_worker.django":
        pytest.importorskip("django")
        from django.conf import settings

        if not settings.configured:
            settings.configure()
    return importlib.import_module(name)


@pytest.mark.parametrize("name", sorted(SURFACE))
def test_each_public_module_exports_exactly_its_names(name: str) -> None:
    module = public_module(name)
    assert sorted(module.__all__) == sorted(SURFACE[name])
    assert len(set(module.__all__)) == len(module.__all__)
    for export in module.__all__:
        value = getattr(module, export)
        assert not isinstance(value, types.ModuleType), f"{name}.{export} is a module"


def test_no_public_module_beyond_the_listed_ones() -> None:
    found = {
        info.name for info in pkgutil.walk_packages(dedupe_worker.__path__, "dedupe_worker.",
                                                    onerror=lambda name: None)
        if not any(part.startswith("_") for part in info.name.split(".")[1:])
    } | {"dedupe_worker"}
    assert found == set(SURFACE)


def test_every_submodule_of_a_public_package_is_private() -> None:
    for name in SURFACE:
        module = public_module(name)
        if not hasattr(module, "__path__"):
            continue
        for info in pkgutil.iter_modules(module.__path__):
            full = f"{name}.{info.name}"
            assert info.name.startswith("_") or full in SURFACE, f"{full} is a public submodule"


def test_the_documented_imports_resolve() -> None:
    """What README.md and docs/ show users import (``from X import a, b``) comes from a public module."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"^\s*from (dedupe_worker[\w.]*) import ([\w, ]+(?: as \w+)?)", re.M)
    seen = 0
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for module_name, names in pattern.findall(doc.read_text()):
            assert module_name in SURFACE, f"{doc.name} imports from {module_name}, not a public module"
            module = public_module(module_name)
            for name in names.split(","):
                name = name.split(" as ")[0].strip()
                assert name in module.__all__, f"{doc.name}: {name} is not in {module_name}.__all__"
                seen += 1
    assert seen > 20


#: Public on the asyncio classes only: the name asyncio libraries give ``close`` (httpx's ``aclose``).
ASYNC_ONLY = {"aclose"}


@pytest.mark.parametrize(("sync_name", "async_name"), [("Deduplicator", "AsyncDeduplicator"),
                                                       ("ClaimClient", "AsyncClaimClient")])
def test_the_sync_and_asyncio_classes_show_the_same_public_attributes(sync_name: str, async_name: str) -> None:
    """Internals (the drivers, the performers' helpers) stay private on both, so what a user can
    reach on one they can reach on the other."""
    import dedupe_worker.asyncio

    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    sync, asyn = getattr(dedupe_worker, sync_name), getattr(dedupe_worker.asyncio, async_name)
    assert public(sync) == public(asyn) - ASYNC_ONLY
    assert ASYNC_ONLY <= public(asyn)
