"""Replay a RabbitMQ dead-letter queue (AMQP 0-9-1 through kombu's ``pyamqp`` transport).

How one run goes: the queue's ready-message count is read once at the start and at most that many
messages are taken with ``basic.get`` (so messages dead-lettered again during the run wait for the
next run). Messages are taken in batches; each batch is judged by the
:class:`~dedupe_worker.replay.Planner` in one Redis round trip, then each message:

- DROP: acked (removed from the dead-letter queue);
- REPLAY: published with ``mandatory`` under publisher confirms (the copies of a batch are
  published together and their confirms awaited once); only after the broker confirmed a copy
  (and did not return it as unroutable) is its dead-lettered message acked. A nack, a return or a
  missing destination leaves it where it is, counted as failed;
- LEAVE: kept unacknowledged until the end of the run, then rejected with ``requeue``, so it is
  not taken twice in one run and returns to the queue.

Crash story: messages are only ever acked after their copy is confirmed, so killing the replay at
any moment loses nothing; the broker requeues everything unacked when the connection drops. A
kill between the confirm and the ack leaves the message both in the destination and in the
dead-letter queue; the next run republishes it if the consumer has not applied it yet, and the
consumer's deduplication answers the second copy as a duplicate.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._extras import require
from .._messages.deadletter import ORIGINAL_QUEUE, REASON
from .._messages.envelope import from_kombu
from ._plan import Pacer, Planner, Step, replay_headers
from ._summary import ReplayOptions, Summary

if TYPE_CHECKING:
    from .._republish import Republisher

__all__ = ["Destination", "original_destination", "replay_rabbitmq"]

log = logging.getLogger(__name__)

NO_DESTINATION = "no destination: no x-dedupe-original-queue or x-death header, use --to"


@dataclass(frozen=True)
class Destination:
    """Where to republish: an exchange (``""`` is the default exchange) and a routing key."""

    exchange: str
    routing_key: str

    def __str__(self) -> str:
        return f"exchange {self.exchange!r} routing key {self.routing_key!r}"

    @classmethod
    def parse(cls, text: str) -> Destination:
        """``EXCHANGE/ROUTING_KEY``; ``/QUEUE`` or a bare ``QUEUE`` publish straight to a queue."""
        exchange, sep, routing_key = text.partition("/")
        return cls(exchange, routing_key) if sep else cls("", text)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _first_death(headers: Mapping[str, Any]) -> Mapping[str, Any]:
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        return deaths[0]
    return {}


def original_destination(headers: Mapping[str, Any]) -> Destination | None:
    """The queue a message was dead-lettered from, published to through the default exchange:
    ``x-dedupe-original-queue`` (our dead-lettering), else the newest ``x-death`` entry (RabbitMQ's
    own dead-lettering). ``None`` when neither says."""
    queue = headers.get(ORIGINAL_QUEUE) or _first_death(headers).get("queue")
    return Destination("", _text(queue)) if queue else None


def dead_letter_reason(headers: Mapping[str, Any]) -> str:
    """``x-dedupe-reason``, else the ``x-death`` reason (``rejected``, ``expired``, ...)."""
    reason = headers.get(REASON) or _first_death(headers).get("reason") or ""
    return _text(reason)


def replay_rabbitmq(connection: Any, queue: str, planner: Planner, *,
                    destination: Destination | None = None, options: ReplayOptions | None = None,
                    confirm_timeout: float = 30.0, batch_size: int = 100) -> Summary:
    """Replay the dead-letter ``queue`` over the kombu ``connection``; see the module docstring.

    ``destination`` overrides where messages go (default: the queue each came from). Messages are
    taken ``batch_size`` at a time: one Redis round trip judges a batch and one confirm round trip
    covers its republished copies. Raises :class:`LookupError` when ``queue`` does not exist.
    Connection and channel errors propagate; whatever was not acked by then stays in the queue.
    """
    require("kombu", "rabbitmq")
    from .._republish import Republisher

    options = options or ReplayOptions()
    summary = Summary.start(options)
    pacer = Pacer(options.rate)
    # With a rate, a batch lasts about a second, so nothing waits long unacked.
    batch_size = max(1, min(batch_size, int(options.rate))) if options.rate else max(1, batch_size)
    channel = connection.channel()
    held: list[int] = []
    try:
        ready = _ready_messages(channel, queue)
        total = ready if options.limit is None else min(ready, options.limit)
        if options.on_start is not None:
            options.on_start(total)
        publisher = None if options.dry_run else Republisher(channel, getattr(connection, "userid", None),
                                                             confirm_timeout)
        while summary.examined < total:
            batch = _take(channel, queue, min(batch_size, total - summary.examined))
            if not batch:
                break
            _replay_batch(channel, queue, planner, batch, destination, publisher, pacer, summary, held)
    finally:
        _give_back(channel, held)
    return summary


def _take(channel: Any, queue: str, count: int) -> list[tuple[Any, Any]]:
    """Up to ``count`` messages (``basic.get``), each as ``(raw, kombu message)``."""
    batch: list[tuple[Any, Any]] = []
    while len(batch) < count and (raw := channel.basic_get(queue=queue, no_ack=False)) is not None:
        batch.append((raw, channel.message_to_python(raw)))
    return batch


def _replay_batch(channel: Any, queue: str, planner: Planner, batch: list[tuple[Any, Any]],
                  destination: Destination | None, publisher: Republisher | None, pacer: Pacer,
                  summary: Summary, held: list[int]) -> None:
    """Judge ``batch``, publish its REPLAY copies and wait for their confirms, then finish every
    message in order: ack what was dropped or confirmed, hold the rest for the end of the run."""
    from .._republish import Copy

    origins = [original_destination(message.headers or {}) for _, message in batch]
    entries = planner.judge_many([
        (from_kombu(message, origin.routing_key if origin else ""), dead_letter_reason(message.headers or {}))
        for (_, message), origin in zip(batch, origins, strict=True)])
    copies: dict[int, Copy] = {}
    for i, ((_, message), origin, entry) in enumerate(zip(batch, origins, entries, strict=True)):
        target = destination or origin
        if publisher is not None and entry.step is Step.REPLAY and target is not None:
            pacer.wait()
            headers = dict(replay_headers((message.headers or {}).items()))
            copies[i] = Copy(message, target.routing_key, headers, target.exchange)
    problems = dict(zip(copies, publisher.publish_many(list(copies.values())), strict=True)) \
        if publisher is not None and copies else {}
    for i, ((raw, _), origin, entry) in enumerate(zip(batch, origins, entries, strict=True)):
        tag, target = raw.delivery_tag, destination or origin
        if entry.step is Step.REPLAY and target is None:
            held.append(tag)
            log.error("replay key=%s token=%s left in %s: %s", entry.key, entry.token, queue, NO_DESTINATION)
            summary.record(dataclasses.replace(entry, note=NO_DESTINATION), ok=False)
        elif publisher is None or entry.step is Step.LEAVE:
            held.append(tag)
            if entry.step is Step.LEAVE:
                log.info("replay key=%s token=%s left in %s (%s): %s", entry.key, entry.token, queue,
                         entry.state.value, entry.note)
            summary.record(entry)
        elif entry.step is Step.DROP:
            channel.basic_ack(tag)
            log.info("replay key=%s token=%s already applied, dropped from %s", entry.key, entry.token, queue)
            summary.record(entry)
        elif (problem := problems[i]) is not None:
            held.append(tag)
            log.error("replay key=%s token=%s failed, left in %s: %s", entry.key, entry.token, queue, problem)
            summary.record(entry, ok=False)
        else:
            channel.basic_ack(tag)
            log.info("replay key=%s token=%s republished to %s", entry.key, entry.token, target)
            summary.record(entry)


def _ready_messages(channel: Any, queue: str) -> int:
    amqp = require("amqp", "rabbitmq")
    try:
        return int(channel.queue_declare(queue=queue, passive=True).message_count)
    except amqp.exceptions.NotFound as exc:
        raise LookupError(f"dead-letter queue {queue!r} not found") from exc


def _give_back(channel: Any, held: list[int]) -> None:
    """Requeue the messages left in place; if the channel is gone the broker already did."""
    if not channel.is_open:
        return
    try:
        for tag in held:
            channel.basic_reject(tag, requeue=True)
        channel.close()
    except Exception as exc:  # the connection dropped: unacked messages are requeued anyway
        log.warning("could not requeue %d messages explicitly (the broker requeues them): %s", len(held), exc)
