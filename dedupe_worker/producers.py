"""Producer helpers: stamp the idempotency key on a message, and skip publishing work already done.

The consumers read the key from the ``idempotency-key`` header first (``RABBITMQ_DEFAULT``,
``KAFKA_DEFAULT``, the FastStream middleware's defaults), so a producer that stamps it decides
the key the consumer claims::

    from dedupe_worker.producers import publish_once, produce_once

    publish_once(kombu_producer, {"order": 42}, key="charge:42", routing_key="orders",
                 deduplicator=dedupe)                       # kombu / RabbitMQ
    produce_once(kafka_producer, "orders", b'{"order": 42}', key="charge:42",
                 deduplicator=dedupe)                       # confluent-kafka
    send_actor_once(charge, 42, 10, deduplicator=dedupe)    # Dramatiq: the actor's own key
    await broker_publish_once(broker, {"order": 42}, queue="orders", key="charge:42",
                              deduplicator=async_dedupe)    # FastStream, any broker

With a ``deduplicator``, the key's records are read first (:meth:`Deduplicator.status`, one round
trip) and a key whose outcome is stored is not published: the answer carries the stored state.
That is a hint, nothing more: a key in progress, free, or unreadable (Redis down, logged as a
warning) is published, and the consumer's claim makes the work apply once whatever the producer
did. The payload is not compared here (``status`` has no fingerprint): a done key sent with
another body is skipped, where the consumer would have dead-lettered it as ``conflict``.

Nothing is written before the publish (no send mark, unlike Celery's ``dedupe_on_send``), so a
publish that raises leaves no trace: the error reaches the caller, whose retry is checked and
published like a first send, and ``dedupe_sends_total{outcome="published"}`` counts only
publishes that returned.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

from ._deduplicator import Deduplicator
from ._errors import StoreUnavailable
from ._protocol import KeyState, State
from .keys import DEFAULT_HEADER
from .observe._base import current as observer

__all__ = ["DEFAULT_HEADER", "Sent", "broker_publish_once", "produce_once", "publish_once", "send_actor_once",
           "stamp"]

log = logging.getLogger(__name__)


class Sent(NamedTuple):
    """What a helper did: ``published``, and the key's state when it was read (``None`` without a
    deduplicator or when Redis could not be reached); ``state.value`` is the stored outcome of a
    skipped send."""

    published: bool
    state: KeyState | None = None


def stamp(key: str, headers: Mapping[str, Any] | None = None, header: str = DEFAULT_HEADER) -> dict[str, Any]:
    """``headers`` (copied) with the idempotency key under ``header``."""
    if not key:
        raise ValueError("idempotency key is empty")
    return {**(headers or {}), header: key}


def _after_status(state: KeyState | None, key: str, integration: str) -> Sent | None:
    """``Sent(False, state)`` when ``state`` says the key is done; ``None``: publish, then
    :func:`_published`. The decision of the sync and the asyncio helpers."""
    if state is not None and state.state is State.DONE:
        observer.sent(integration, "skipped_done")
        log.info("not sending, done key=%s token=%s", key, state.token)
        return Sent(False, state)
    return None


def _published(integration: str) -> Sent:
    """Counted once the publish returned: one that raised is no send."""
    observer.sent(integration, "published")
    return Sent(True)


def _unavailable(key: str, exc: Exception) -> None:
    log.warning("Redis unavailable before sending, publishing key=%s token=-: %s", key, exc)


def done_already(deduplicator: Deduplicator | None, key: str, integration: str) -> Sent | None:
    """Read ``key``'s state (unless no ``deduplicator``) and decide (:func:`_after_status`)."""
    state = None
    if deduplicator is not None:
        try:
            state = deduplicator.status(key)
        except StoreUnavailable as exc:
            _unavailable(key, exc)
    return _after_status(state, key, integration)


def publish_once(producer: Any, body: Any, *, key: str, deduplicator: Deduplicator | None = None,
                 header: str = DEFAULT_HEADER, **publish: Any) -> Sent:
    """``producer.publish(body, headers=<with the key>, **publish)`` on a ``kombu.Producer``,
    unless ``deduplicator`` finds the key done (see module doc)."""
    skipped = done_already(deduplicator, key, "kombu")
    if skipped is not None:
        return skipped
    headers = stamp(key, publish.pop("headers", None), header)
    producer.publish(body, headers=headers, **publish)
    return _published("kombu")


def produce_once(producer: Any, topic: str, value: Any, *, key: str, deduplicator: Deduplicator | None = None,
                 header: str = DEFAULT_HEADER, **produce: Any) -> Sent:
    """``producer.produce(topic, value, headers=<with the key>, **produce)`` on a confluent-kafka
    ``Producer`` (flushing stays the caller's), unless ``deduplicator`` finds the key done (see
    module doc). ``headers`` may be a dict or a list of pairs; ``key=`` is the idempotency key
    (pass the record key as ``partition_key=``)."""
    skipped = done_already(deduplicator, key, "kafka")
    if skipped is not None:
        return skipped
    given = produce.pop("headers", None) or []
    pairs = list(given.items()) if isinstance(given, Mapping) else list(given)
    pairs = [(name, v) for name, v in pairs if name != header] + [(header, key.encode("utf-8"))]
    if "partition_key" in produce:
        produce["key"] = produce.pop("partition_key")
    producer.produce(topic, value, headers=pairs, **produce)
    return _published("kafka")


def send_actor_once(actor: Any, *args: Any, deduplicator: Deduplicator | None = None, **kwargs: Any) -> Sent:
    """Dramatiq: ``actor.send(*args, **kwargs)`` unless the key is done (see module doc). The key is
    the one :class:`~dedupe_worker.dramatiq.DedupeMiddleware` derives, by the same function (the
    actor's ``idempotency_key`` option over the arguments; without it the new message's id, which
    no earlier send can have used, so the message is published). Raises :class:`InvalidKey` when
    the option fails on these arguments."""
    from .dramatiq._middleware import DedupeMiddleware

    message = actor.message(*args, **kwargs)
    key = DedupeMiddleware.key_for(actor, message, args, kwargs)
    skipped = done_already(deduplicator, key, "dramatiq")
    if skipped is not None:
        return skipped
    actor.broker.enqueue(message)
    return _published("dramatiq")


async def broker_publish_once(broker: Any, message: Any, *args: Any, key: str, deduplicator: Any = None,
                              header: str = DEFAULT_HEADER, **publish: Any) -> Sent:
    """FastStream: ``await broker.publish(message, *args, headers=<with the key>, **publish)`` on
    any broker (RabbitMQ, Kafka, NATS: the middleware reads the same header first), unless the
    key is done. ``deduplicator`` is an :class:`~dedupe_worker.asyncio.AsyncDeduplicator` (its
    ``status`` does not block the event loop)."""
    state = None
    if deduplicator is not None:
        try:
            state = await deduplicator.status(key)
        except StoreUnavailable as exc:
            _unavailable(key, exc)
    skipped = _after_status(state, key, "faststream")
    if skipped is not None:
        return skipped
    await broker.publish(message, *args, headers=stamp(key, publish.pop("headers", None), header), **publish)
    return _published("faststream")
