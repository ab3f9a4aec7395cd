"""``dedupe_middleware``: a FastStream subscriber's handler applied once per idempotency key.

Usage (the same for ``KafkaBroker`` and ``NatsBroker``)::

    dedupe = AsyncDeduplicator.from_url("redis://127.0.0.1:6379/0", namespace="orders")
    middleware = dedupe_middleware(dedupe)
    broker = RabbitBroker(url, middlewares=[middleware])
    app = FastStream(broker, on_startup=[middleware.check_at_start])  # refuses an evicting Redis

    @broker.subscriber("orders")
    async def handle(order: Order) -> dict:
        token = current_claim().token          # fence your writes with it
        ...

Every message goes through the asyncio engine (:func:`dedupe_worker.asyncio.decide`): the key is
claimed, the rest of the middleware chain and the handler run with the lease renewed and
``current_claim()`` set, the handler's return value is stored, and the verdict is mapped to the
broker (broker steps in :mod:`._brokers`); no verdict logic lives here:

===================  ======================================================================
verdict              the message ...
===================  ======================================================================
applied              is acked as FastStream does; the return value is published as usual
duplicate,           is acked without running the handler (nothing is published)
previously_failed
in_progress          first waits up to ``defer_wait`` on the key (this subscriber's task waits;
                     others go on): acked as a duplicate once the holder stores its outcome,
                     or run if the holder released the key or its lease ran out; then, as below
lease_lost,          is handed back to be delivered again after a backoff that starts at tens of
store_unavailable    ms and never outlasts the holder's lease (:mod:`._brokers`); never dropped
                     (so is a message that meets an evicting Redis: see ``check_at_start``)
handler_error        the claim is released and the exception goes on to FastStream, whose
                     ``ack_policy`` decides (``NACK_ON_ERROR`` redelivers, ``REJECT_ON_ERROR``
                     rejects to the dead-letter exchange)
conflict, invalid_   is dead-lettered with ``x-dedupe-*`` headers (reason, error, key, origin):
key, undecodable,    to ``<queue|topic|subject>.dlq``, see :mod:`._brokers`
permanent_failure,
unserializable_result,
unreadable_record
===================  ======================================================================

**Batches.** A ``KafkaBroker`` subscriber with ``batch=True`` goes through the batch engine
(:func:`dedupe_worker.asyncio.decide_many`): the handler gets only the records that must run, and
the batch is committed or handed back whole; see :mod:`._batch` for its verdicts.

**The key.** ``key_strategy`` is a strategy from :mod:`dedupe_worker.keys`
(``header_key("idempotency-key")``, ``field_key("order.id")``, ``message_id_key()``,
``first_of(...)``). By default: the ``idempotency-key`` header, else the message id (RabbitMQ's
``message_id`` property; NATS' ``Nats-Msg-Id`` or a ``message_id`` header), else a hash of the
body; on Kafka the header, else the record key with a body hash, else a body hash.

**Crash safety.** A consumer killed mid-handler has not acked: the broker redelivers the message.
The dead consumer's claim stays held until its lease runs out, so the redelivery is deferred
until then and runs the handler again under a larger fencing token. Subscribers must not ack
before the handler ran: leave ``ack_policy`` at anything but ``AckPolicy.ACK_FIRST`` (Kafka: so
that offsets are committed after the handler). NATS needs a JetStream subscriber (core NATS has
no redelivery).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from faststream import BaseMiddleware
from faststream.exceptions import AckMessage, NackMessage, RejectMessage

from .._engine import ACKED, Acted, Action, ConsumerOptions, Decision, Done, Reason, dispatch_async
from .._errors import EvictionPolicyError, StoreUnavailable
from .._messages.deadletter import dead_letter_headers
from .._messages.envelope import Envelope
from ..asyncio import AsyncClaimClient, decide
from ._batch import handle_batch, is_batch
from ._brokers import BrokerAdapter, adapter_for
from ._state import MiddlewareState

__all__ = ["DedupeMiddleware", "dedupe_middleware"]

log = logging.getLogger(__name__)


class DedupeMiddleware(MiddlewareState):
    """The middleware factory FastStream calls once per message (``middlewares=[...]``); see the
    module doc. Hooks (:class:`~dedupe_worker.Hooks`) get FastStream's ``StreamMessage``; override
    them in a subclass. ``max_attempts``, ``retry_base`` and ``retry_cap`` are not used: handler
    errors are FastStream's ``ack_policy``'s."""

    def __call__(self, msg: Any, /, *, context: Any) -> _Scope:
        return _Scope(msg, context=context, owner=self)

    async def handle(self, call_next: Callable[[Any], Any], msg: Any, subscriber: Any, broker: Any = None) -> Any:
        """Identify the message, let :func:`decide` claim its key and run the rest of the chain,
        act on the verdict. ``broker`` (the one consuming ``msg``) publishes Kafka's dead letters when no
        ``dead_letter_producer`` was given. A Kafka batch goes to :func:`._batch.handle_batch`."""
        if is_batch(msg):
            return await handle_batch(self, call_next, msg, broker)
        adapter = adapter_for(msg)
        envelope = adapter.envelope(msg, subscriber)
        found = self.identify(envelope, adapter.default_key)
        if isinstance(found, Decision):
            return await self.act(adapter, msg, envelope, found, None, broker)
        key, fingerprint, ttl = found
        try:
            decision = await decide(self.dedupe, key, functools.partial(call_next, msg), fingerprint=fingerprint,
                                    wait=self.defer_wait, integration="faststream", ttl=ttl)
        except EvictionPolicyError as exc:
            # Not checked at start (no check_at_start hook, or Redis was down then): handed back,
            # never failed (a handler error would be rejected or acked away under some ack policies).
            log.error("Redis may evict our records, deferring key=%s token=0 message_id=%s: %s", key,
                      getattr(msg, "message_id", None), exc)
            decision = Decision(Reason.STORE_UNAVAILABLE, error=exc)
        return await self.act(adapter, msg, envelope, decision, key, broker)

    async def check_at_start(self) -> None:
        """The start-up check of the store: raises :class:`~dedupe_worker.EvictionPolicyError` when
        Redis may evict our records (unless the client has ``allow_eviction``), so the app refuses
        to start before it consumes anything. Register it as the app's start-up hook:
        ``FastStream(broker, on_startup=[middleware.check_at_start])`` (it runs before the broker
        connects). Redis unreachable is only logged: the first claim checks again. Without it, the
        first message that meets an evicting Redis is deferred (handed back), never dropped."""
        if self.dedupe.store_checked:
            return
        try:
            await self.dedupe.check_store()
        except StoreUnavailable as exc:
            log.warning("could not check Redis settings at start: %s", exc)

    async def act(self, adapter: BrokerAdapter, msg: Any, envelope: Envelope, decision: Decision,
                     key: str | None, broker: Any = None) -> Any:
        """Map the verdict onto the broker. Raises FastStream's ``AckMessage``/``NackMessage``/
        ``RejectMessage`` after acting, so that nothing is published and FastStream's own
        acknowledgement (already done) is a no-op."""
        if key is not None and decision.action is not Action.DEFER:
            self._deferrals.pop(key, None)  # decided: a later deferral of the key starts over
        await dispatch_async(_MessageSteps(self, adapter, envelope, key, broker), self, msg, key, decision)
        return decision.value


class _MessageSteps:
    """The dispatch port of :class:`DedupeMiddleware` (:class:`~dedupe_worker._engine.dispatch.AsyncBroker`)
    for one message. Each step raises FastStream's ``AckMessage``/``NackMessage``/``RejectMessage``
    after acting (through :attr:`~dedupe_worker._engine.dispatch.Acted.then`), so that nothing is
    published and FastStream's own acknowledgement (already done) is a no-op."""

    __slots__ = ("adapter", "broker", "envelope", "key", "owner")

    def __init__(self, owner: DedupeMiddleware, adapter: BrokerAdapter, envelope: Envelope, key: str | None,
                 broker: Any) -> None:
        self.owner = owner
        self.adapter = adapter
        self.envelope = envelope
        self.key = key
        self.broker = broker

    async def ack(self, msg: Any, decision: Decision) -> Acted:
        if decision.reason is Reason.APPLIED:
            return ACKED  # FastStream acks once the handler's value is returned
        await msg.ack()
        return Acted(Done.ACKED, then=AckMessage())

    async def defer(self, msg: Any, decision: Decision) -> Acted:
        delay = self.owner.defer_delay(self.owner.next_deferral(self.key), decision.retry_after or None)
        await self.adapter.requeue(msg, delay)
        return Acted(Done.DEFERRED, delay, then=NackMessage())

    async def retry(self, msg: Any, decision: Decision) -> Acted:
        # FastStream's ack_policy decides, as for any handler exception
        return Acted(Done.HANDED_OVER, then=decision.error)

    async def dead_letter(self, msg: Any, decision: Decision) -> Acted:
        headers = {**dead_letter_headers(decision, key=self.key), **self.adapter.origin(self.envelope)}
        await self.adapter.dead_letter(msg, self.envelope, headers, self.owner.dead_letter_producer or self.broker)
        return Acted(Done.DEAD_LETTERED, then=RejectMessage())

    def where(self, msg: Any) -> str:
        return f"message_id={getattr(msg, 'message_id', None)}"


class _Scope(BaseMiddleware):
    """One message's pass through :class:`DedupeMiddleware`."""

    def __init__(self, msg: Any, /, *, context: Any, owner: DedupeMiddleware) -> None:
        super().__init__(msg, context=context)
        self.owner = owner

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        return await self.owner.handle(call_next, msg, self.context.get_local("handler_"),
                                       self.context.get("broker"))


def dedupe_middleware(dedupe: AsyncClaimClient, *, options: ConsumerOptions | None = None,
                      dead_letter_producer: Any = None, **keywords: Any) -> DedupeMiddleware:
    """The middleware for ``RabbitBroker``/``KafkaBroker``/``NatsBroker(..., middlewares=[...])``.

    ``options``: the options every integration shares (:class:`~dedupe_worker.ConsumerOptions`),
    whole; or as keywords, set on top: ``key_strategy`` (a key strategy; default: see the module
    doc; ``key``, its old name, still works for one release), ``fingerprint`` (what a key stands
    for; default: a hash of the body; ``None`` for no check), ``ttl_header`` (default
    ``x-dedupe-ttl``), ``defer_base``, ``defer_cap``, ``defer_wait``. ``dead_letter_producer``: what
    publishes Kafka's dead letters: by default the ``KafkaBroker`` that consumed the message, else
    the one given here (another ``KafkaBroker``, or a started ``aiokafka.AIOKafkaProducer``).
    """
    return DedupeMiddleware(dedupe, options=options, dead_letter_producer=dead_letter_producer, **keywords)
