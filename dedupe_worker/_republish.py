"""Copies of a consumed message, published with publisher confirms before the original is acked.

For a consumed queue ``<queue>`` the consumer declares two durable queues:

* ``<queue>.delay``: per-message ``expiration``, dead-lettered by RabbitMQ back to ``<queue>``
  through the default exchange. A message that must come back later (in progress elsewhere,
  lease lost, handler error with attempts left) is copied here and the original acked.
* ``<queue>.dlq``: where messages that cannot be handled end, with the reason in headers.

Both are written through the default exchange (routing key = queue name), ``mandatory`` set and
confirms on. A copy counts as written only when the broker confirmed it and did not return it as
unroutable; only then is the original acked. If the process dies between the confirm and the
ack, the broker redelivers the original too, so the message exists twice: the claim in Redis makes
the second copy a duplicate (or, for a dead letter, the DLQ holds it twice; both say why).

Body and properties (``content_type``, ``content_encoding``, ``message_id``, ``correlation_id``,
``delivery_mode``, ``priority``, ``timestamp``, ``type``, ``app_id``, ``reply_to``, ...) are copied
as they are; the original headers are kept and the given ones added. Not kept: ``expiration`` (a
delayed copy gets its own, a dead-lettered copy none, so it cannot silently expire in the DLQ),
and a ``user_id`` other than our login, which RabbitMQ would refuse (it moves to the
``x-dedupe-original-user-id`` header).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from amqp import spec
from amqp.exceptions import MessageNacked

from ._errors import DedupeError

__all__ = ["DEFERRALS", "DELAY_SUFFIX", "DLQ_SUFFIX", "ORIGINAL_USER_ID", "Copy", "PublishFailed", "Republisher",
           "delay_queue", "dlq"]

log = logging.getLogger(__name__)

DLQ_SUFFIX = ".dlq"
DELAY_SUFFIX = ".delay"
#: Header counting how often a message was deferred (it only grows the deferral backoff; it never
#: counts as a failed attempt).
DEFERRALS = "x-dedupe-deferrals"
#: Header keeping a ``user_id`` property that could not be republished under our login.
ORIGINAL_USER_ID = "x-dedupe-original-user-id"

#: Properties passed to ``prepare_message`` as arguments rather than in ``properties``.
_SEPARATE = ("application_headers", "content_type", "content_encoding", "priority", "expiration")


def dlq(queue: str) -> str:
    """The dead-letter queue of ``queue``."""
    return queue + DLQ_SUFFIX


def delay_queue(queue: str) -> str:
    """The delay queue of ``queue``."""
    return queue + DELAY_SUFFIX


class PublishFailed(DedupeError):
    """The broker nacked a copy or returned it as unroutable; the original must not be acked."""


class Copy(NamedTuple):
    """One copy for :meth:`Republisher.publish_many`: the kombu ``message`` to copy, where it goes
    and its ``headers`` (which replace the original ones: pass them merged)."""

    message: Any
    routing_key: str
    headers: Mapping[str, Any]
    exchange: str = ""


class Republisher:
    """Publishes copies on one channel of its own (kombu's py-amqp transport), confirm mode on.
    Used by the consumer (delay and dead-letter copies) and by the replay (copies back to work).

    Connection errors propagate (the consumer reconnects and the broker redelivers the original);
    a nack or a return raises :class:`PublishFailed`.
    """

    def __init__(self, channel: Any, userid: str | None = None, confirm_timeout: float | None = None) -> None:
        if not hasattr(channel, "basic_publish_confirm"):
            raise TypeError("dedupe-worker needs kombu's py-amqp transport (an amqp:// URL) for RabbitMQ")
        self.channel = channel
        self.userid = userid
        self.confirm_timeout = confirm_timeout
        self._returned: list[tuple[str, str, str]] = []  # (exchange, routing key, why)
        # Publish sequence numbers of the channel (the delivery tags of its confirms), counted from
        # our own confirm.select; None when confirms were on before we came (publish_many then
        # waits for each copy alone).
        self._sequence: int | None = None if getattr(channel, "_confirm_selected", False) else 0
        channel.events["basic_return"].add(self._on_return)

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        self._returned.append((exchange, routing_key, str(exc)))

    def declare(self, queue: str) -> None:
        """Declare ``<queue>.dlq`` and ``<queue>.delay`` (durable; idempotent)."""
        self.channel.queue_declare(queue=dlq(queue), durable=True, auto_delete=False)
        self.channel.queue_declare(
            queue=delay_queue(queue), durable=True, auto_delete=False,
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue},
        )

    def publish(self, message: Any, routing_key: str, headers: Mapping[str, Any],
                expiration: float | None = None, *, exchange: str = "") -> None:
        """Publish a copy of kombu ``message`` to ``exchange`` (default: the default exchange, so
        ``routing_key`` is a queue name) with ``headers`` (which replace the original ones: pass
        them merged) and wait for the broker's confirm."""
        copy = self._prepare(message, headers, expiration)
        self._returned.clear()
        try:
            self.channel.basic_publish_confirm(copy, exchange=exchange, routing_key=routing_key, mandatory=True,
                                               confirm_timeout=self.confirm_timeout)
        except MessageNacked as exc:
            raise PublishFailed(f"broker nacked the copy for {routing_key!r}") from exc
        finally:
            if self._sequence is not None:
                self._sequence += 1
        if self._returned:
            raise PublishFailed(f"broker returned the copy as unroutable ({self._returns()})")

    def publish_many(self, copies: Sequence[Copy]) -> list[str | None]:
        """Publish every copy (``mandatory``), then wait once for the broker's confirms of all of
        them: one confirm round trip per batch instead of one per copy. Returns, per copy, ``None``
        when the broker confirmed it and did not return it, else why it failed (the original must
        then not be acked).

        A return names only its exchange and routing key, so a returned copy fails every copy of
        the batch sent there (a routed one among them only stays in its source queue too, to be
        answered as a duplicate later). Connection errors and a confirm timeout propagate: nothing
        of the batch counts as written."""
        publish = getattr(self.channel, "_basic_publish", None)
        if self._sequence is None or publish is None or len(copies) < 2:
            return [self._publish_alone(copy) for copy in copies]
        if not getattr(self.channel, "_confirm_selected", False):
            self.channel.confirm_select()
            self.channel._confirm_selected = True  # as basic_publish_confirm would have set it
        first = self._sequence + 1
        last = self._sequence + len(copies)
        confirmed_ok: dict[int, bool] = {}

        def confirmed(ok: bool) -> Any:
            def mark(tag: int, multiple: bool) -> None:
                for t in range(max(first, 1 if multiple else tag), min(tag, last) + 1):
                    confirmed_ok.setdefault(t, ok)
            return mark

        on_ack, on_nack = confirmed(True), confirmed(False)
        self.channel.events["basic_ack"].add(on_ack)
        self.channel.events["basic_nack"].add(on_nack)
        self._returned.clear()
        try:
            for copy in copies:
                self._sequence += 1
                publish(self._prepare(copy.message, copy.headers, None), exchange=copy.exchange,
                        routing_key=copy.routing_key, mandatory=True)
            while len(confirmed_ok) < len(copies):
                self.channel.wait([spec.Basic.Ack, spec.Basic.Nack], timeout=self.confirm_timeout)
        finally:
            self.channel.events["basic_ack"].discard(on_ack)
            self.channel.events["basic_nack"].discard(on_nack)
        returned = {(exchange, key): why for exchange, key, why in self._returned}
        problems: list[str | None] = []
        for tag, copy in enumerate(copies, first):
            why = returned.get((copy.exchange, copy.routing_key))
            if not confirmed_ok[tag]:
                problems.append(f"broker nacked the copy for {copy.routing_key!r}")
            elif why is not None:
                problems.append(f"broker returned the copy as unroutable ({copy.routing_key}: {why})")
            else:
                problems.append(None)
        return problems

    def _publish_alone(self, copy: Copy) -> str | None:
        try:
            self.publish(copy.message, copy.routing_key, copy.headers, exchange=copy.exchange)
        except PublishFailed as exc:
            return str(exc)
        return None

    def _returns(self) -> str:
        return "; ".join(f"{key}: {why}" for _, key, why in self._returned)

    def _prepare(self, message: Any, headers: Mapping[str, Any], expiration: float | None) -> Any:
        """The copy of kombu ``message`` to publish, with ``headers``."""
        properties = dict(getattr(message, "properties", None) or {})
        separate = {name: properties.pop(name, None) for name in _SEPARATE}
        if properties.get("user_id") not in (None, self.userid):
            # RabbitMQ refuses (closes the channel on) a user_id other than our login; keep it as
            # a header instead of blocking the message forever.
            headers = {**headers, ORIGINAL_USER_ID: properties.pop("user_id")}
        if expiration is not None:
            properties["expiration"] = str(max(1, int(expiration * 1000)))
        return self.channel.prepare_message(
            message.body, separate["priority"], separate["content_type"], separate["content_encoding"],
            dict(headers), properties,
        )
