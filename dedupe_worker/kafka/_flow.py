"""Partition flow control for the Kafka consumer: pause, rewind, resume, commit, rebalance.

A held partition is paused and sought back to its first undecided message; it resumes when its
delay is over. Messages fetched before a rewind are dropped (they come again after it). Commits
are synchronous and explicit; a failed commit only means the next owner reads a few decided
messages again (they answer DUPLICATE).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from .._engine import call_hook
from ._positions import PartitionState

__all__ = ["TP", "PartitionFlow", "tp_of"]

log = logging.getLogger(__name__)

#: ``(topic, partition)``
TP = tuple[str, int]


def tp_of(msg: Message) -> TP:
    """The ``(topic, partition)`` of a message."""
    return (msg.topic() or "", msg.partition() or 0)


class PartitionFlow:
    """Mixin owning ``consumer`` and the per-partition states; hooks come from the subclass."""

    consumer: Consumer
    poll_timeout: float
    defer_base: float
    stats: Any
    _partitions: dict[TP, PartitionState]
    on_commit: Callable[[list[Any]], None]
    on_assign: Callable[[list[Any]], None]
    on_revoke: Callable[[list[Any]], None]
    process: Callable[[list[Message]], None]

    def _accept(self, msg: Message) -> TP | None:
        """The ``(topic, partition)`` of ``msg`` when it is to be handled now: not an error, and its
        partition is ours and not rewound past it (a fetch from before a rewind comes again after
        the resume); else ``None``."""
        err = msg.error()
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", err)
            return None
        tp = (msg.topic() or "", msg.partition() or 0)  # tp_of(), once per message
        state = self._partitions.get(tp)
        if state is None or state.paused_until is not None:
            return None
        if state.rewound_to is not None:
            offset = msg.offset() or 0
            if offset < state.rewound_to:
                return None
            if offset > state.rewound_to:  # the seek did not take: rewind again
                log.warning("partition %s:%s delivered offset %s after a rewind to %s; rewinding again",
                            tp[0], tp[1], offset, state.rewound_to)
                self._rewind(tp, state, state.rewound_to, self.defer_base)
                return None
            state.rewound_to = None
        return tp

    def _state(self, msg: Message) -> PartitionState:
        return self._partitions[tp_of(msg)]

    def _rewind(self, tp: TP, state: PartitionState, offset: int, delay: float) -> None:
        """Pause ``tp``, seek it back to ``offset`` and schedule its resume in ``delay`` seconds."""
        position = TopicPartition(tp[0], tp[1], offset)
        state.paused_until = time.monotonic() + delay
        state.rewound_to = offset
        try:
            self.consumer.pause([position])
            self.consumer.seek(position)
        except KafkaException as exc:  # caught again by _accept's offset check after the resume
            log.warning("could not rewind %s:%s to %s: %s", tp[0], tp[1], offset, exc)

    #: Partitions whose held key was decided (appended by the key watcher's thread): resumed now.
    _woken: deque[TP]

    def _wake(self, tp: TP) -> None:
        """Called by the key watcher when the key ``tp`` waits on is completed or released."""
        self._woken.append(tp)

    def _resume_due(self) -> None:
        now = time.monotonic()
        woken = set()
        while self._woken:
            woken.add(self._woken.popleft())
        for tp in woken:  # decide the held message again now, without waiting for a fetch
            state = self._partitions.get(tp)
            if state is not None and state.paused_until is not None and state.held is not None:
                self._decide_held(tp, state)
        due = [tp for tp, s in self._partitions.items() if s.paused_until is not None and s.paused_until <= now]
        for tp in due:
            self._partitions[tp].paused_until = None
            self._partitions[tp].held = None
        if due:
            self.consumer.resume([TopicPartition(t, p) for t, p in due])

    def _decide_held(self, tp: TP, state: PartitionState) -> None:
        """The key the held message waited on was decided: decide the message again (librdkafka
        takes about a second to fetch again after a resume). If it is decided now, the partition
        goes on past it; if it is held again, it stays paused."""
        msg, state.held, state.paused_until = state.held, None, None
        self.process([msg])
        if state.paused_until is None:  # decided: move on from the next offset
            self._resume_at(tp, state, (msg.offset() or 0) + 1)

    def _resume_at(self, tp: TP, state: PartitionState, offset: int) -> None:
        position = TopicPartition(tp[0], tp[1], offset)
        state.rewound_to = offset
        try:
            self.consumer.seek(position)
            self.consumer.resume([position])
        except KafkaException as exc:  # caught again by _accept's offset check
            log.warning("could not resume %s:%s at %s: %s", tp[0], tp[1], offset, exc)

    def _wait(self) -> float:
        """Poll timeout: ``poll_timeout``, shorter when a paused partition is due sooner."""
        pending = [s.paused_until for s in self._partitions.values() if s.paused_until is not None]
        if not pending:
            return self.poll_timeout
        # a held key can be decided any moment: look for the watcher's word every 20 ms
        return max(0.0, min(self.poll_timeout, 0.02, min(pending) - time.monotonic()))

    def _commit(self, offsets: list[TopicPartition]) -> None:
        if not offsets:
            return
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:  # e.g. a rebalance: the next owner answers DUPLICATE
            log.warning("commit of %s failed: %s", offsets, exc)
            return
        self.stats["committed"] += 1
        call_hook(self.on_commit, offsets)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._partitions[(tp.topic, tp.partition)] = PartitionState()
        try:  # a partition we paused before losing it starts flowing again
            consumer.resume(partitions)
        except KafkaException as exc:
            log.debug("resume on assign: %s", exc)
        log.info("assigned %s", [(tp.topic, tp.partition) for tp in partitions])
        call_hook(self.on_assign, partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Batches run in this thread, so the last one is decided and committed already; what was
        # held is simply read again by the next owner from the committed offset.
        for tp in partitions:
            self._partitions.pop((tp.topic, tp.partition), None)
        log.info("revoked %s", [(tp.topic, tp.partition) for tp in partitions])
        call_hook(self.on_revoke, partitions)
