"""The deduplicating kombu consumer: claim, run, then ack, defer, retry or dead-letter.

Per message the consumer identifies it (:class:`~dedupe_worker._engine.Identify`: the key as
``key_strategy(from_kombu(message, queue))``, the fingerprint as ``fingerprint(envelope)``, the
ttl from its ``ttl_header``), asks the engine (:func:`~dedupe_worker.decide_many`
for the messages prefetched together, :func:`~dedupe_worker.decide` with ``batch=False``)
and maps the verdict to broker actions:

=====================  =========================================================================
verdict                broker action
=====================  =========================================================================
applied, duplicate,    ack
previously_failed
in_progress,           copy to ``<queue>.delay`` with an expiration of at least the other
lease_lost             worker's remaining lease (plus jittered backoff), confirm, ack; the copy
                       comes back to ``<queue>``. Not a failed attempt.
store_unavailable      Redis is down: nothing is run or acked; pause (backoff, capped) and
                       requeue. Consumption resumes by itself when Redis answers again.
handler_error          attempts = ``x-dedupe-attempts`` + 1; below ``max_attempts``: copy to
                       ``<queue>.delay`` with the new count and a backoff, confirm, ack; else
                       dead-letter.
conflict, invalid_key, copy to ``<queue>.dlq`` with :func:`~dedupe_worker.deadletter.
undecodable,           dead_letter_headers`, confirm, ack.
unreadable_record, ...
=====================  =========================================================================

Crash story: nothing is acked before its outcome is stored in Redis or its copy confirmed, so a
consumer killed at any point leaves its un-acked messages to the broker, which redelivers them.
Inside a prefetched batch each handler's outcome is stored as soon as it returns (fast handlers
are grouped while their total run time stays under ``flush_after``), and a message is claimed only
when its handler is about to run, so the redeliveries of finished messages answer DUPLICATE. What
can run again: the handler that was running when the consumer died, and the finished handlers of
the last ``flush_after``; their claims answer IN_PROGRESS until their leases run out, then they are
handled again (the handler's half-done side effects are not undone).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._deduplicator import Deduplicator
from .._engine import Action, ConsumerOptions, Decision, Identify, Pacing, Reason, Tally, decide, decide_many, refused
from .._errors import UndecodableMessage
from .._extras import require
from .._messages.envelope import from_kombu
from .._operate.doctor import check_at_start
from .._republish import Republisher
from ..keys import RABBITMQ_DEFAULT
from ._actions import BrokerActions, Item, Stopping

require("kombu", "rabbitmq")
from kombu.connection import Connection  # noqa: E402
from kombu.entity import Queue  # noqa: E402
from kombu.mixins import ConsumerMixin  # noqa: E402

__all__ = ["DedupeConsumer", "Handler"]

log = logging.getLogger(__name__)

#: Keyword options of :class:`DedupeConsumer` of its own (class attributes, so a subclass may set
#: them too); the others are :class:`~dedupe_worker.ConsumerOptions`'.
OPTIONS = ("prefetch_count", "batch", "accept", "outage_cap")

#: ``handler(body, message)``: the decoded body and the kombu message, as kombu callbacks get them.
Handler = Callable[[Any, Any], Any]


class DedupeConsumer(ConsumerMixin, BrokerActions):
    """Consume ``queues`` with ``handler(body, message)``, applying each idempotency key once.

    Guaranteed: a message is acked only after its outcome is stored, a copy of it is confirmed
    in ``<queue>.delay`` or ``<queue>.dlq``, or it is known to be a duplicate; a bad message
    never stops the loop and is never dropped. While a key's outcome lives in Redis its handler
    completes at most once. Each outcome is stored before the next handler starts, except that
    handlers finishing within ``flush_after`` of each other share one round trip. Not
    guaranteed: a handler interrupted by a crash, the finished handlers of the last
    ``flush_after`` before a crash, and a handler whose outcome could not be stored (Redis died
    right after it ran) may run again on redelivery.

    Reconnects to RabbitMQ by itself (kombu's ``ConsumerMixin``); un-acked messages are redelivered
    by the broker. Call :meth:`stop` (e.g. from a SIGTERM handler) to finish the message in hand
    and stop; the other prefetched messages are requeued. Uses kombu's py-amqp transport.
    """

    #: basic.qos prefetch count per queue: how many un-acked messages the broker hands us at once.
    prefetch_count: int = 10
    #: Claim the prefetched messages that are ready together in one Redis round trip.
    batch: bool = True
    #: Content types (or kombu serializer names) the body may be decoded from; others are poison.
    accept: Sequence[str] = ("json", "text/plain", "application/octet-stream")

    def __init__(
        self,
        connection: Connection,
        queues: Sequence[Queue | str],
        handler: Handler,
        deduplicator: Deduplicator,
        *,
        options: ConsumerOptions | None = None,
        **keywords: Any,
    ) -> None:
        """``options``: the options every integration shares (:class:`~dedupe_worker.ConsumerOptions`;
        ``key_strategy`` defaults to :data:`~dedupe_worker.keys.RABBITMQ_DEFAULT`), whole; each of
        them, and each of :data:`OPTIONS`, may also be given as a keyword."""
        self.connection = connection
        self.queues = [q if isinstance(q, Queue) else Queue(q, durable=True)  # type: ignore[no-untyped-call]
                       for q in queues]
        self.handler = handler
        self.dedupe = deduplicator
        for name in OPTIONS:
            if name in keywords:
                setattr(self, name, keywords.pop(name))
        #: The options every integration shares (``options`` with the keywords on top).
        self.options = options = ConsumerOptions.of(options, others=OPTIONS, **keywords)
        self.use(options)
        #: Each message's key, fingerprint and ttl, or its refusal (read from its envelope).
        self.identify: Identify[Any] = Identify("rabbitmq", options.key_strategy or RABBITMQ_DEFAULT,
                                                options.fingerprint, ttl_header=options.ttl_header)
        self.should_stop = False
        #: Set while connected with the queues (and their .delay and .dlq) declared and consumed.
        self.ready = threading.Event()
        self._pending: list[tuple[str, Any, BaseException | None]] = []
        self._waiting: dict[Any, float] = {}
        self._woken: deque[tuple[str, Any, BaseException | None]] = deque()
        self._publisher: Republisher | None = None
        self._outages = 0
        #: Handler timings carried from batch to batch, to size the claimed chunks.
        self.pacing = Pacing(options.flush_after)
        self.tally = Tally("rabbitmq consumer", options.summary_interval)

    # -- the loop --------------------------------------------------------------------------------

    def run(self, _tokens: int = 1, **kwargs: Any) -> None:
        """Consume until :meth:`stop`; reconnects by itself after connection errors. Logs a
        summary line every ``summary_interval`` seconds and once when it returns."""
        self.tally.begin()
        try:
            super().run(_tokens, **kwargs)  # type: ignore[no-untyped-call]
        finally:
            self.tally.close()

    def close(self) -> None:
        """Release the connection given to the constructor (the deduplicator is the caller's)."""
        self.connection.release()  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        """Finish the message in hand, requeue the rest, then return from :meth:`run`."""
        self.should_stop = True

    def get_consumers(self, consumer_cls: Any, channel: Any) -> list[Any]:
        return [
            consumer_cls(
                queues=[queue], accept=list(self.accept), prefetch_count=self.prefetch_count,
                on_message=lambda message, name=queue.name: self._pending.append((name, message, None)),
                # kombu would log and ack a message it cannot decompress; we dead-letter it.
                on_decode_error=lambda message, exc, name=queue.name: self._pending.append(
                    (name, message, exc)),
            )
            for queue in self.queues
        ]

    def on_consume_ready(self, connection: Any, channel: Any, consumers: Any, **kwargs: Any) -> None:
        self._pending.clear()
        self._waiting.clear()  # a new connection: the broker redelivers what waited
        self._woken.clear()
        self._publisher = Republisher(connection.channel(), getattr(connection, "userid", None))
        for queue in self.queues:
            self._publisher.declare(queue.name)
        check_at_start(self.dedupe)
        self.ready.set()
        log.info("consuming %s (prefetch %d)", ", ".join(q.name for q in self.queues), self.prefetch_count)

    def consume(self, limit: int | None = None, timeout: float | None = None,
                safety_interval: float = 1, **kwargs: Any) -> Iterator[None]:
        try:
            with self.consumer_context(**kwargs) as (conn, _channel, _consumers):
                while not self.should_stop:
                    while self._woken:  # waited on a key that is decided now: decide them again
                        self._pending.append(self._woken.popleft())
                    # Deliveries can also arrive while we wait for a publish confirm or a declare.
                    if not self._pending:
                        try:
                            # with messages in the waiting room, look for the watcher's word often
                            conn.drain_events(timeout=0.02 if self._waiting else safety_interval)
                        except TimeoutError:
                            conn.heartbeat_check()
                            self.tally.tick()
                            continue
                    # Whatever else the broker already sent is handled in the same batch.
                    while self.batch and len(self._pending) < self.prefetch_count * len(self.queues):
                        try:
                            conn.drain_events(timeout=0)
                        except TimeoutError:
                            break
                    batch, self._pending = self._pending, []
                    self.handle(batch)
                    self.tally.tick()
                    yield
        finally:
            self.ready.clear()

    # -- one batch -------------------------------------------------------------------------------

    def handle(self, batch: Sequence[tuple[str, Any, BaseException | None]]) -> None:
        """Decide the messages received together and act on each; never raises for bad messages."""
        if len(batch) == 1:  # prefetch 1, or one message ready: what follows, without the lists
            self._handle_one(*batch[0])
            return
        items = [self._prepare(queue, message, error) for queue, message, error in batch]
        todo = [item for item in items if item.decision is None]
        if len(todo) > 1 and self.batch:
            decisions = decide_many(self.dedupe, [(i.key or "", i.fingerprint, i.call or _noop) for i in todo],
                                    pacing=self.pacing, integration="rabbitmq", ttl=[i.ttl for i in todo])
        else:
            decisions = [decide(self.dedupe, i.key or "", i.call or _noop, fingerprint=i.fingerprint,
                                integration="rabbitmq", ttl=i.ttl) for i in todo]
        for item, decision in zip(todo, decisions, strict=True):
            item.decision = decision
        unavailable = [i for i in items if i.decision and i.decision.reason is Reason.STORE_UNAVAILABLE]
        self._outages = self._outages + 1 if unavailable else 0
        # (never while messages wait un-acked in the waiting room: ack(multiple) would take them)
        acked = len(items) > 1 and not self._waiting and all(
            i.decision and i.decision.action is Action.ACK and not i.message.acknowledged for i in items)
        if acked:
            # One basic.ack(multiple) for the batch: every message delivered on this channel and
            # not acknowledged yet is in it (those delivered meanwhile have higher delivery tags).
            max(items, key=lambda i: int(i.message.delivery_tag)).message.ack(multiple=True)
        for item in items:
            if item.decision is None or item.decision.reason is not Reason.STORE_UNAVAILABLE:
                self._act(item, acked=acked)
        if unavailable:
            self._requeue_later(unavailable)

    def _handle_one(self, queue: str, message: Any, error: BaseException | None) -> None:
        """:meth:`handle` for a batch of one: decided by :func:`decide`, acted on alone."""
        item = self._prepare(queue, message, error)
        decision = item.decision
        if decision is None:
            decision = item.decision = decide(self.dedupe, item.key or "", item.call or _noop,
                                              fingerprint=item.fingerprint, integration="rabbitmq", ttl=item.ttl)
        if decision.reason is Reason.STORE_UNAVAILABLE:
            self._outages += 1
            self._requeue_later([item])
        else:
            self._outages = 0
            self._act(item)

    def _prepare(self, queue: str, message: Any, error: BaseException | None) -> Item:
        item = Item(queue, message)
        found = self.identify(message, functools.partial(from_kombu, queue=queue))
        if isinstance(found, Decision):
            item.decision = found
            return item
        item.key, item.fingerprint, item.ttl = found
        try:
            if error is not None:
                raise error
            body = message.decode()
        except Exception as exc:
            item.decision = refused(UndecodableMessage(f"cannot decode body ({message.content_type}): "
                                                       f"{type(exc).__name__}: {exc}"), "rabbitmq")
            return item

        def call() -> Any:
            if self.should_stop:
                raise Stopping("consumer is stopping")
            return self.handler(body, message)

        item.call = call
        return item


def _noop() -> None:
    return None
