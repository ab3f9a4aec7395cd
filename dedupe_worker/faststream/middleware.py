"""``dedupe_middleware``: a FastStream subscriber's handler applied once per idempotency key.

Usage (the same for ``KafkaBroker`` and ``NatsBroker``)::

    dedupe = AsyncDeduplicator.from_url("redis://127.0.0.1:6379/0", namespace="orders")
    broker = RabbitBroker(url, middlewares=[dedupe_middleware(dedupe)])

    @broker.subscriber("orders")
    async def handle(order: Order) -> dict:
        token = current_claim().token          # fence your writes with it
        ...

Every message goes through the asyncio engine (:func:`dedupe_worker.asyncio.decide`): the key is
claimed, the rest of the middleware chain and the handler run with the lease renewed and
``current_claim()`` set, the handler's return value is stored, and the verdict is mapped to the
broker (broker steps in :mod:`.brokers`); no verdict logic lives here:

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
store_unavailable    ms and never outlasts the holder's lease (:mod:`.brokers`); never dropped
handler_error        the claim is released and the exception goes on to FastStream, whose
                     ``ack_policy`` decides (``NACK_ON_ERROR`` redelivers, ``REJECT_ON_ERROR``
                     rejects to the dead-letter exchange)
conflict, invalid_   is dead-lettered with ``x-dedupe-*`` headers (reason, error, key, origin):
key, undecodable,    to ``<queue|topic|subject>.dlq``, see :mod:`.brokers`
permanent_failure,
unserializable_result
===================  ======================================================================

**The key.** ``key`` is a strategy from :mod:`dedupe_worker.messages.keys`
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

from ..asyncio import AsyncClaimClient, decide
from ..engine import Action, Decision, Hooks, Reason, RetryPolicy, refused
from ..engine.hooks import call_hook
from ..errors import InvalidKey, UndecodableMessage
from ..messages.deadletter import dead_letter_headers
from ..messages.envelope import Envelope
from ..messages.keys import KeyStrategy, body_fingerprint
from .brokers import BrokerAdapter, adapter_for

__all__ = ["DedupeMiddleware", "dedupe_middleware"]

log = logging.getLogger(__name__)

#: Deferral counts kept per key (they only grow the backoff); past this many keys, they start over.
MAX_TRACKED_DEFERRALS = 10_000


class DedupeMiddleware(Hooks, RetryPolicy):
    """The middleware factory FastStream calls once per message (``middlewares=[...]``); see the
    module doc. Hooks (:class:`~dedupe_worker.Hooks`) get FastStream's ``StreamMessage``; override
    them in a subclass. ``max_attempts``, ``retry_base`` and ``retry_cap`` are not used: handler
    errors are FastStream's ``ack_policy``'s."""

    def __init__(self, dedupe: AsyncClaimClient, *, key: KeyStrategy | None = None,
                 fingerprint: Callable[[Envelope], Any] | None = body_fingerprint,
                 dead_letter_producer: Any = None, defer_base: float | None = None, defer_cap: float | None = None,
                 defer_wait: float | None = None) -> None:
        self.dedupe = dedupe
        self.key = key
        self.fingerprint = fingerprint
        self.dead_letter_producer = dead_letter_producer
        for name, value in (("defer_base", defer_base), ("defer_cap", defer_cap), ("defer_wait", defer_wait)):
            if value is not None:
                setattr(self, name, value)
        self._deferrals: dict[str, int] = {}

    def __call__(self, msg: Any, /, *, context: Any) -> _Scope:
        return _Scope(msg, context=context, owner=self)

    async def handle(self, call_next: Callable[[Any], Any], msg: Any, subscriber: Any, broker: Any = None) -> Any:
        """Derive the key, let :func:`decide` claim it and run the rest of the chain, act on the
        verdict. ``broker`` (the one consuming ``msg``) publishes Kafka's dead letters when no
        ``dead_letter_producer`` was given."""
        adapter = adapter_for(msg)
        envelope = adapter.envelope(msg, subscriber)
        try:
            key = (self.key or adapter.default_key)(envelope)
            fingerprint = self.fingerprint(envelope) if self.fingerprint is not None else None
        except (InvalidKey, UndecodableMessage) as exc:
            return await self.settle(adapter, msg, envelope, refused(exc, "faststream"), None, broker)
        decision = await decide(self.dedupe, key, functools.partial(call_next, msg), fingerprint=fingerprint,
                                wait=self.defer_wait, integration="faststream")
        return await self.settle(adapter, msg, envelope, decision, key, broker)

    async def settle(self, adapter: BrokerAdapter, msg: Any, envelope: Envelope, decision: Decision,
                     key: str | None, broker: Any = None) -> Any:
        """Map the verdict onto the broker. Raises FastStream's ``AckMessage``/``NackMessage``/
        ``RejectMessage`` after acting, so that nothing is published and FastStream's own
        acknowledgement (already done) is a no-op."""
        reason, action = decision.reason, decision.action
        deferrals = self._deferrals.pop(key, 0) if key is not None else 0
        if reason is Reason.APPLIED:
            call_hook(self.on_applied, msg, decision)
            return decision.value
        if action is Action.ACK:
            log.info("duplicate key=%s token=%s reason=%s", key, decision.token, reason.value)
            await msg.ack()
            call_hook(self.on_duplicate, msg, decision)
            raise AckMessage()
        if action is Action.DEFER:
            assert key is not None
            if reason is Reason.LEASE_LOST:
                call_hook(self.on_lease_lost, msg, decision)
            if len(self._deferrals) >= MAX_TRACKED_DEFERRALS:
                self._deferrals.clear()
            self._deferrals[key] = deferrals + 1
            delay = self.defer_delay(deferrals + 1, decision.retry_after or None)
            log.info("deferring key=%s token=%s reason=%s by %.3fs (deferral %d)", key, decision.token,
                     reason.value, delay, deferrals + 1)
            await adapter.requeue(msg, delay)
            call_hook(self.on_deferred, msg, decision, delay)
            raise NackMessage()
        if action is Action.RETRY:  # FastStream's ack_policy decides, as for any handler exception
            log.info("handler failed, claim released key=%s token=%s: %s", key, decision.token, decision.detail)
            assert decision.error is not None
            raise decision.error
        log.error("dead-lettering key=%s token=%s reason=%s: %s", key, decision.token, reason.value, decision.detail)
        headers = {**dead_letter_headers(decision, key=key), **adapter.origin(envelope)}
        await adapter.dead_letter(msg, envelope, headers, self.dead_letter_producer or broker)
        call_hook(self.on_dead_letter, msg, decision)
        raise RejectMessage()


class _Scope(BaseMiddleware):
    """One message's pass through :class:`DedupeMiddleware`."""

    def __init__(self, msg: Any, /, *, context: Any, owner: DedupeMiddleware) -> None:
        super().__init__(msg, context=context)
        self.owner = owner

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        return await self.owner.handle(call_next, msg, self.context.get_local("handler_"),
                                       self.context.get("broker"))


def dedupe_middleware(dedupe: AsyncClaimClient, *, key: KeyStrategy | None = None,
                      fingerprint: Callable[[Envelope], Any] | None = body_fingerprint,
                      dead_letter_producer: Any = None, **options: Any) -> DedupeMiddleware:
    """The middleware for ``RabbitBroker``/``KafkaBroker``/``NatsBroker(..., middlewares=[...])``.

    ``key``: a key strategy (default: see the module doc). ``fingerprint``: what a key stands for
    (default: a hash of the body; ``None`` for no check). ``dead_letter_producer``: what publishes Kafka's
    dead letters: by default the ``KafkaBroker`` that consumed the message, else the one given here
    (another ``KafkaBroker``, or a started ``aiokafka.AIOKafkaProducer``). ``options``: ``defer_base``,
    ``defer_cap``, ``defer_wait`` (:class:`~dedupe_worker.engine.RetryPolicy`).
    """
    return DedupeMiddleware(dedupe, key=key, fingerprint=fingerprint, dead_letter_producer=dead_letter_producer,
                            **options)
