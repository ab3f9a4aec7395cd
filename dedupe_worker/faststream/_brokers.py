"""What differs between FastStream's brokers: how a message looks, how it is put back, how it is set aside.

Broker logic only (no verdicts): :func:`adapter_for` picks the :class:`BrokerAdapter` of a
message by the library that delivered it (aio-pika, aiokafka, nats-py).

=========  ==============================================  =====================================
broker     deferral (``requeue``)                          dead letter (``dead_letter``)
=========  ==============================================  =====================================
RabbitMQ   waits the delay, then ``nack(requeue=True)``    a copy with ``x-dedupe-*`` headers to
           (RabbitMQ has no per-message delay)             ``<queue>.dlq`` on the message's own
                                                           channel, then ack; if that fails,
                                                           ``reject()`` to the queue's DLX
Kafka      waits the delay, then ``nack()``: FastStream    a copy with ``x-dedupe-*`` headers to
           seeks back to the record (the partition         ``<topic>.dlq`` through the
           waits behind it, in order)                      consuming broker (or the
                                                           ``dead_letter_producer``), then commit
NATS       JetStream ``nak(delay=...)``: the server        a copy with ``x-dedupe-*`` headers to
           redelivers it after the delay                   ``<subject>.dlq`` (bind a stream to
                                                           keep it), then ``term()``
=========  ==============================================  =====================================

The headers are :func:`dedupe_worker._messages.deadletter.dead_letter_headers`, the same as the
RabbitMQ and Kafka consumers write, so ``dedupe-worker replay`` reads FastStream's dead letters too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .._messages import deadletter
from .._messages.envelope import Envelope
from ..keys import KAFKA_DEFAULT, RABBITMQ_DEFAULT

__all__ = ["DLQ_SUFFIX", "BrokerAdapter", "KafkaAdapter", "NatsAdapter", "RabbitAdapter", "adapter_for"]

log = logging.getLogger(__name__)

#: Appended to a queue, topic or subject to name its dead letters.
DLQ_SUFFIX = ".dlq"


class BrokerAdapter:
    """The broker-specific steps; ``msg`` is FastStream's ``StreamMessage``."""

    def default_key(self, envelope: Envelope) -> str:
        """The key when ``dedupe_middleware`` is given no strategy: the ``idempotency-key`` header,
        else the message id, else a hash of the body."""
        return RABBITMQ_DEFAULT(envelope)

    def envelope(self, msg: Any, subscriber: Any) -> Envelope:
        """The message as key strategies and dead-letter headers see it."""
        raise NotImplementedError

    def origin(self, envelope: Envelope) -> dict[str, str]:
        """Dead-letter headers saying where the message came from."""
        return {}

    async def requeue(self, msg: Any, delay: float) -> None:
        """Hand the message back to be delivered again in about ``delay`` seconds; never drop it."""
        await asyncio.sleep(delay)
        await msg.nack()

    async def dead_letter(self, msg: Any, envelope: Envelope, headers: dict[str, str], producer: Any) -> None:
        """Set the message aside with ``headers`` and acknowledge the original (see the module doc)."""
        raise NotImplementedError

    def record_envelope(self, raw: Any) -> Envelope:
        """One record of a batch as key strategies see it (brokers with batch subscribers)."""
        raise NotImplementedError

    async def publish_dead_letter(self, raw: Any, envelope: Envelope, headers: dict[str, str], producer: Any) -> bool:
        """Publish a copy of the record ``raw`` of a batch with ``headers``, leaving it unacknowledged
        (the batch is acknowledged as a whole); False when it could not be published (logged)."""
        raise NotImplementedError


class RabbitAdapter(BrokerAdapter):

    def envelope(self, msg: Any, subscriber: Any) -> Envelope:
        raw = msg.raw_message  # aio_pika.IncomingMessage
        queue = getattr(getattr(subscriber, "queue", None), "name", None) or raw.routing_key or ""
        return Envelope(body=raw.body, headers=dict(raw.headers or {}), message_id=raw.message_id, source=queue)

    def origin(self, envelope: Envelope) -> dict[str, str]:
        return {deadletter.ORIGINAL_QUEUE: envelope.source}

    async def requeue(self, msg: Any, delay: float) -> None:
        await asyncio.sleep(delay)
        await msg.nack(requeue=True)

    async def dead_letter(self, msg: Any, envelope: Envelope, headers: dict[str, str], producer: Any) -> None:
        import aiormq

        raw = msg.raw_message
        queue = envelope.source + DLQ_SUFFIX
        try:
            await raw.channel.queue_declare(queue, durable=True)
            await raw.channel.basic_publish(
                raw.body, exchange="", routing_key=queue,
                properties=aiormq.spec.Basic.Properties(headers={**(raw.headers or {}), **headers},
                                                        message_id=raw.message_id, content_type=raw.content_type,
                                                        delivery_mode=2))
        except Exception as exc:  # reject: the queue's own dead-letter exchange, without our headers
            log.warning("dead-letter publish to %s failed, rejecting key=%s: %s", queue, headers.get(deadletter.KEY),
                        exc)
            await msg.reject(requeue=False)
            return
        await msg.ack()


class KafkaAdapter(BrokerAdapter):
    def default_key(self, envelope: Envelope) -> str:
        """The ``idempotency-key`` header, else the record key with a body hash, else a body hash."""
        return KAFKA_DEFAULT(envelope)

    def envelope(self, msg: Any, subscriber: Any) -> Envelope:
        return self.record_envelope(msg.raw_message)

    def record_envelope(self, raw: Any) -> Envelope:
        """One aiokafka ``ConsumerRecord`` as key strategies see it (a single message, or one
        record of a batch)."""
        return Envelope(body=raw.value or b"", headers=dict(raw.headers or ()), partition_key=raw.key,
                        source=raw.topic, position=(raw.partition, raw.offset))

    def origin(self, envelope: Envelope) -> dict[str, str]:
        partition, offset = envelope.position or (0, 0)
        return {deadletter.ORIGINAL_TOPIC: envelope.source, deadletter.ORIGINAL_PARTITION: str(partition),
                deadletter.ORIGINAL_OFFSET: str(offset)}

    async def dead_letter(self, msg: Any, envelope: Envelope, headers: dict[str, str], producer: Any) -> None:
        if not await self.publish_dead_letter(msg.raw_message, envelope, headers, producer):
            await msg.reject()
            return
        await msg.ack()

    async def publish_dead_letter(self, raw: Any, envelope: Envelope, headers: dict[str, str], producer: Any) -> bool:
        """Publish a copy of the record ``raw`` to ``<topic>.dlq`` with ``headers``; the caller
        commits past it. False (logged) when there is no producer to publish it."""
        if producer is None:
            log.error("no broker to publish the dead letter: committing past poison record %s/%s/%s key=%s reason=%s",
                      raw.topic, raw.partition, raw.offset, headers.get(deadletter.KEY), headers.get(deadletter.REASON))
            return False
        topic = raw.topic + DLQ_SUFFIX
        if hasattr(producer, "send_and_wait"):  # aiokafka's AIOKafkaProducer
            await producer.send_and_wait(topic, value=raw.value, key=raw.key,
                                         headers=[*(raw.headers or ()), *((k, v.encode()) for k, v in headers.items())])
        else:  # FastStream's KafkaBroker
            kept = {k: v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else str(v)
                    for k, v in envelope.headers.items()}
            await producer.publish(raw.value or b"", topic=topic, key=raw.key, headers={**kept, **headers})
        return True


class NatsAdapter(BrokerAdapter):

    def envelope(self, msg: Any, subscriber: Any) -> Envelope:
        return self.record_envelope(msg.raw_message)

    def record_envelope(self, raw: Any) -> Envelope:
        """One ``nats.aio.msg.Msg`` as key strategies see it (a single message, or one of a batch)."""
        headers = dict(raw.headers or {})
        message_id = headers.get("Nats-Msg-Id") or headers.get("message_id")
        return Envelope(body=raw.data, headers=headers, message_id=message_id, source=raw.subject)

    async def requeue(self, msg: Any, delay: float) -> None:
        await msg.nack(delay=delay)  # JetStream redelivers it after the delay

    async def dead_letter(self, msg: Any, envelope: Envelope, headers: dict[str, str], producer: Any) -> None:
        await self.publish_dead_letter(msg.raw_message, envelope, headers, producer)
        await msg.reject()  # term(): JetStream stops redelivering it (MSG_TERMINATED advisory)

    async def publish_dead_letter(self, raw: Any, envelope: Envelope, headers: dict[str, str], producer: Any) -> bool:
        """Publish a copy of ``raw`` to ``<subject>.dlq`` with ``headers``; False (logged) if that failed."""
        subject = raw.subject + DLQ_SUFFIX
        try:
            await raw._client.publish(subject, raw.data, headers={**(raw.headers or {}), **headers})
            await raw._client.flush()
        except Exception as exc:
            log.warning("dead-letter publish to %s failed key=%s: %s", subject, headers.get(deadletter.KEY), exc)
            return False
        return True


def adapter_for(msg: Any) -> BrokerAdapter:
    """The adapter of the library that delivered ``msg`` (``StreamMessage.raw_message``, or the
    first record of a batch)."""
    raw = msg.raw_message
    if isinstance(raw, (tuple, list)) and raw:
        raw = raw[0]
    module = type(raw).__module__
    if module.startswith("aio_pika"):
        return _RABBIT
    if module.startswith("aiokafka") or module.startswith("faststream.kafka"):
        return _KAFKA
    if module.startswith("nats"):
        return _NATS
    raise TypeError(f"dedupe_middleware supports RabbitBroker, KafkaBroker and NatsBroker, not {module}")


_RABBIT, _KAFKA, _NATS = RabbitAdapter(), KafkaAdapter(), NatsAdapter()
