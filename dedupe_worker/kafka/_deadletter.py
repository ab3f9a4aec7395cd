"""Producing dead letters to Kafka and waiting for the broker to confirm them.

A dead letter is the original record (same key, same value, original headers kept) with the
``x-dedupe-*`` headers of :func:`dedupe_worker.deadletter.dead_letter_headers` appended, written
to ``dead_letter_topic.format(topic=<original topic>)`` (``<topic>.dlq`` by default). The consumer
commits past a message only after :meth:`DeadLetterProducer.send` reported its delivery; a failed
delivery leaves the message undecided, so it is retried, never lost.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._engine import Decision
from .._messages.deadletter import dead_letter_headers
from .._messages.envelope import from_kafka

__all__ = ["DELIVERY_TIMEOUT", "DeadLetter", "DeadLetterProducer", "producer_config"]

log = logging.getLogger(__name__)

#: Seconds the dead-letter producer waits for the broker to take a record, unless told otherwise.
DELIVERY_TIMEOUT = 30.0

#: Consumer settings that also apply to the producer (connection and security).
_SHARED_PREFIXES = ("bootstrap.servers", "security.", "sasl.", "ssl.", "client.", "socket.", "broker.")


def producer_config(consumer_config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None,
                    timeout: float = DELIVERY_TIMEOUT) -> dict[str, Any]:
    """The dead-letter producer's settings: the connection settings of ``consumer_config``, a
    delivery timeout of ``timeout`` seconds, ``acks=all``, then ``overrides``."""
    config = {k: v for k, v in consumer_config.items() if k.startswith(_SHARED_PREFIXES)}
    config.update({"acks": "all", "linger.ms": 5, "message.timeout.ms": int(timeout * 1000)})
    config.update(overrides or {})
    return config


@dataclass(frozen=True)
class DeadLetter:
    """One record to dead-letter: the consumed ``message``, the verdict, the key (if one could be
    derived) and how many times the handler was attempted."""

    message: Any
    decision: Decision
    key: str | None = None
    attempts: int = 0


class DeadLetterProducer:
    """Writes :class:`DeadLetter` records and reports, per record, whether the broker took it."""

    def __init__(self, producer: Any, topic_format: str = "{topic}.dlq", timeout: float = DELIVERY_TIMEOUT) -> None:
        self.producer = producer
        self.topic_format = topic_format
        self.timeout = timeout

    def topic_for(self, topic: str) -> str:
        """The dead-letter topic of ``topic``."""
        return self.topic_format.format(topic=topic)

    def headers_for(self, letter: DeadLetter) -> list[tuple[str, bytes | str]]:
        """Original headers first, then the ``x-dedupe-*`` ones (a reader keeping the last value
        of a repeated header sees ours)."""
        msg = letter.message
        # from_kafka gives a replayed record the position it had before its first dead-lettering,
        # so a record that fails again keeps naming the position its key was derived from
        seen = from_kafka(msg)
        partition, offset = seen.position or (msg.partition(), msg.offset())
        extra = dead_letter_headers(
            letter.decision, key=letter.key, attempts=letter.attempts,
            original_topic=seen.source, original_partition=str(partition), original_offset=str(offset),
        )
        return [*(msg.headers() or ()), *extra.items()]

    def send(self, letters: Sequence[DeadLetter]) -> list[bool]:
        """Produce every letter, wait up to ``timeout`` for the delivery reports; ``True`` where
        the broker confirmed the record. Never raises for a failed delivery."""
        if not letters:
            return []
        delivered = [False] * len(letters)

        def report(index: int) -> Any:
            def callback(err: Any, _msg: Any) -> None:
                if err is None:
                    delivered[index] = True
                else:
                    log.error("dead letter %d not delivered: %s", index, err)
            return callback

        for i, letter in enumerate(letters):
            msg = letter.message
            topic = self.topic_for(msg.topic())
            try:
                self._produce(topic, msg, self.headers_for(letter), report(i))
            except Exception as exc:  # KafkaException, BufferError after retries, bad topic name
                log.error("could not produce dead letter key=%s to %s: %s", letter.key, topic, exc)
        remaining = self.producer.flush(self.timeout)
        if remaining:
            log.error("%d dead letters still undelivered after %.1fs", remaining, self.timeout)
        return delivered

    def _produce(self, topic: str, msg: Any, headers: list[tuple[str, bytes | str]], callback: Any) -> None:
        for _ in range(100):
            try:
                self.producer.produce(topic, value=msg.value(), key=msg.key(), headers=headers,
                                      on_delivery=callback)
                return
            except BufferError:  # local queue full: let deliveries drain, then try again
                self.producer.poll(0.1)
        raise BufferError("producer queue stayed full")

    def close(self) -> None:
        """Deliver what is queued (up to ``timeout``)."""
        self.producer.flush(self.timeout)
