"""FastStream batch subscribers (``KafkaBroker``'s ``@broker.subscriber(topic, batch=True)``,
``NatsBroker``'s JetStream ``pull_sub=PullSub(batch=True)``) through the asyncio batch engine,
:func:`dedupe_worker.asyncio.decide_many`.

**The FastStream API this relies on.** A batch reaches the middleware's ``consume_scope`` as one
message whose ``raw_message`` is the tuple of aiokafka ``ConsumerRecord`` s (Kafka,
``AioKafkaBatchParser.parse_batch``) or the list of ``nats.aio.msg.Msg`` (NATS,
``BatchParser.parse_batch``), whose ``body`` is the list of their values and whose
``batch_headers`` is the list of their headers. The handler's list is decoded lazily from
``raw_message`` (``decode_batch`` of both parsers), and ``StreamMessage.__copy__`` gives a copy its own decode
cache. So the handler is called once, through ``call_next``, on a ``copy.copy`` of the message
whose ``raw_message``, ``body`` and ``batch_headers`` hold only the records that must run: the
handler sees a shorter list than FastStream decoded. Acknowledgement stays on the original
message (FastStream's ``AcknowledgementMiddleware`` holds it), so the batch is committed or
handed back as a whole (Kafka: commit, or ``nack`` seeking each partition back; NATS:
``ack``/``nak(delay)`` of every message of the batch). RabbitMQ has no batch subscriber in
FastStream.

**Each record** is identified exactly as a single message is (the middleware's ``key_strategy``,
else the Kafka default; its ``fingerprint``; the ``ttl_header``).
Records already done answer from Redis and are not handed to the handler.

**The results.** If the handler returns a list as long as the list it was given, element ``i``
is the result of item ``i``; any other return value (``None``, a dict, a list of another length)
is every item's result. Each is stored as that record's outcome (a later copy of the record
answers it).

**The verdicts, for the batch as a whole** (nothing is lost in any row):

=============================  =================================================================
the batch has ...              then
=============================  =================================================================
only applied, duplicate and    the dead-letter records are published to ``<topic>.dlq`` with
dead-letter records            ``x-dedupe-*`` headers (as a single message's), then the batch is
                               committed: by FastStream after the handler's value is returned
                               (and published as usual), or by the middleware when nothing ran
                               (on NATS the dead-letter records are acked with the batch)
an item deferred (in progress  nothing is dead-lettered yet; after the deferral delay the batch
elsewhere, lease lost, Redis   is nacked (FastStream seeks each partition back to its earliest
unavailable)                   record; NATS naks every message with the delay) and comes
                               again: applied items answer DUPLICATE then, the deferred ones
                               run once their holder is done
a handler error (no deferral)  the claims of the items handed to the handler are released, the
                               dead-letter records are published, and the handler's exception
                               goes to FastStream, whose ``ack_policy`` decides
                               (``NACK_ON_ERROR`` redelivers the batch: its duplicates answer
                               from Redis, its dead letters are published again)
=============================  =================================================================

Hooks run per record after the batch's step, through :func:`~dedupe_worker._engine.dispatch.report`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

from faststream.exceptions import AckMessage, NackMessage

from .._engine import Acted, Action, Decision, Done, Reason, report
from .._errors import EvictionPolicyError
from .._messages.deadletter import dead_letter_headers
from .._messages.envelope import Envelope
from ..asyncio import AsyncItem, decide_many
from ._brokers import BrokerAdapter, adapter_for
from ._state import MiddlewareState

__all__ = ["handle_batch", "is_batch"]

log = logging.getLogger(__name__)


def is_batch(msg: Any) -> bool:
    """Whether FastStream handed the middleware a batch (``raw_message`` a tuple or list of records)."""
    return isinstance(msg.raw_message, (tuple, list))


async def _not_called() -> None:  # the batch runs through ``run_batch``, never item by item
    raise AssertionError("a batch item's handler is run through run_batch")


def results(value: Any, count: int) -> list[Any]:
    """Each item's result from the handler's return value (see the module doc)."""
    if isinstance(value, list) and len(value) == count:
        return value
    return [value] * count


async def handle_batch(owner: MiddlewareState, call_next: Callable[[Any], Any], msg: Any, broker: Any) -> Any:
    """Decide every record of the batch ``msg``, run the handler once on those that must run,
    and act on the verdicts as the module doc says."""
    records: Sequence[Any] = msg.raw_message
    adapter = adapter_for(msg)
    envelopes = [adapter.record_envelope(record) for record in records]
    decisions: list[Decision | None] = [None] * len(records)
    keys: list[str | None] = [None] * len(records)
    items: list[AsyncItem] = []
    placed: list[int] = []  # item j is record placed[j]
    ttls: list[float | None] = []
    for i, envelope in enumerate(envelopes):
        found = owner.identify(envelope, adapter.default_key)
        if isinstance(found, Decision):
            decisions[i] = found
            continue
        key, fingerprint, ttl = found
        keys[i] = key
        items.append((key, fingerprint, _not_called))
        placed.append(i)
        ttls.append(ttl)
    returned: list[Any] = []

    async def run_batch(indices: list[int]) -> Sequence[Any]:
        chosen = [placed[j] for j in indices]
        if not chosen:
            return []
        part = copy.copy(msg)  # its own decode cache (StreamMessage.__copy__)
        kept = [records[i] for i in chosen]
        part.raw_message = tuple(kept) if isinstance(records, tuple) else kept  # Kafka: a tuple; NATS: a list
        part.body = [msg.body[i] for i in chosen]
        if len(msg.batch_headers) == len(records):
            part.batch_headers = [msg.batch_headers[i] for i in chosen]
        value = await call_next(part)
        returned.append(value)
        return results(value, len(chosen))

    if items:
        try:
            verdicts = await decide_many(owner.dedupe, items, run_batch=run_batch, integration="faststream",
                                         ttl=ttls if any(t is not None for t in ttls) else None)
        except EvictionPolicyError as exc:  # handed back, never failed (as a single message)
            log.error("Redis may evict our records, deferring the batch message_id=%s: %s", msg.message_id, exc)
            verdicts = [Decision(Reason.STORE_UNAVAILABLE, error=exc)] * len(items)
        for i, verdict in zip(placed, verdicts, strict=True):
            decisions[i] = verdict
    decided = [d for d in decisions if d is not None]
    assert len(decided) == len(records)
    return await _act(owner, adapter, msg, envelopes, keys, decided, returned, broker)


async def _act(owner: MiddlewareState, adapter: BrokerAdapter, msg: Any, envelopes: list[Envelope],
                  keys: list[str | None], decisions: list[Decision], returned: list[Any], broker: Any) -> Any:
    records: Sequence[Any] = msg.raw_message
    actions = [d.action for d in decisions]
    for key, decision in zip(keys, decisions, strict=True):
        if key is not None and decision.action is not Action.DEFER:
            owner._deferrals.pop(key, None)  # decided: a later deferral of the key starts over
    if Action.DEFER in actions:
        first = next(i for i, a in enumerate(actions) if a is Action.DEFER)
        delay = owner.defer_delay(owner.next_deferral(keys[first]), decisions[first].retry_after or None)
        await adapter.requeue(msg, delay)  # nack: FastStream seeks each partition back
        for i, decision in enumerate(decisions):
            acted = Acted(Done.ACKED) if decision.action is Action.ACK else Acted(Done.DEFERRED, delay)
            if decision.action is Action.DEAD_LETTER:
                log.info("dead letter postponed with its batch key=%s token=%s %s", keys[i], decision.token,
                         _where(records[i]))
            report(owner, records[i], keys[i], decision, acted, None, _where)
        raise NackMessage()
    producer = owner.dead_letter_producer or broker
    for i, decision in enumerate(decisions):
        if decision.action is Action.DEAD_LETTER:
            headers = {**dead_letter_headers(decision, key=keys[i]), **adapter.origin(envelopes[i])}
            await adapter.publish_dead_letter(records[i], envelopes[i], headers, producer)
    error = next((d.error for d in decisions if d.action is Action.RETRY), None)
    for i, decision in enumerate(decisions):
        done = {Action.ACK: Done.ACKED, Action.RETRY: Done.HANDED_OVER}.get(decision.action, Done.DEAD_LETTERED)
        report(owner, records[i], keys[i], decision, Acted(done), None, _where)
    if error is not None:
        raise error  # FastStream's ack_policy decides, as for a single message
    if returned:
        return returned[-1]  # FastStream commits the batch and publishes the value as usual
    await msg.ack()
    raise AckMessage()


def _where(record: Any) -> str:
    if hasattr(record, "topic"):  # aiokafka
        return f"record={record.topic}/{record.partition}/{record.offset}"
    return f"subject={record.subject}"  # nats
