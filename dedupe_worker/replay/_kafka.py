"""Replay a Kafka dead-letter topic (confluent-kafka).

How one run goes: every partition of the dead-letter topic is assigned to this process (no group
join, so a run starts at once) from the replay group's committed offsets, or from the beginning
when the group has none. High watermarks are never used to find the end (compaction and some
brokers report them wrong). A partition ends at the first record written after the run started
(record timestamp later than the start), and the run ends when every partition has ended, when
nothing arrived for ``idle_timeout`` seconds (counted from the moment every partition answered a
first fetch, with a record or an end-of-partition event, so a slow first fetch does not end the
run early), or at ``limit`` records.

Records are handled in batches. Each batch is judged by the
:class:`~dedupe_worker.replay.Planner` in one Redis round trip, then each record:

- DROP: nothing is produced;
- REPLAY: the record (key, value, headers; see :func:`replay_headers`) is produced to the
  destination, into the original partition when the destination is the original topic;
- LEAVE: Kafka cannot keep a record in place while the group moves past it, so a verbatim copy is
  produced to the end of the dead-letter topic (same partition, headers untouched); being newer
  than the run's start it ends the partition and waits for the next run;
- failure (Redis down, no destination, a failed delivery): that partition stops at this record.

After the producer's delivery reports are in, the group's offsets are committed synchronously:
past every record whose step was carried out, and never past a failed one.

Crash story: nothing is committed before its copy is acknowledged by the broker, so killing the
replay loses nothing. A kill between the delivery report and the commit makes the next run see
those records again: already applied ones are dropped, the others are produced once more and the
consumer's deduplication answers the extra copy as a duplicate (a LEAVE copy may be duplicated in
the dead-letter topic the same way). Do not run two replays of one dead-letter topic at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from .._extras import require
from .._messages.deadletter import ORIGINAL_PARTITION, ORIGINAL_TOPIC, REASON
from .._messages.envelope import Envelope, from_kafka, original_position
from ._plan import Entry, Pacer, Planner, Step, replay_headers
from ._summary import ReplayOptions, Summary

__all__ = ["lookup_envelope", "replay_kafka"]

log = logging.getLogger(__name__)

NO_DESTINATION = "no destination: no x-dedupe-original-topic header, use --to"

#: Seconds to wait for every partition's first answer before the idle clock starts anyway.
STARTUP_TIMEOUT = 30.0


def lookup_envelope(record: Any) -> Envelope:
    """The envelope the consumer saw: the dead-lettered record with the original topic, partition
    and offset (from ``x-dedupe-original-*``) as its position, so position-based keys match."""
    return _as_consumed(from_kafka(record))


def _as_consumed(envelope: Envelope) -> Envelope:
    """:func:`lookup_envelope` of the record ``envelope`` was made from."""
    original = original_position(envelope)
    if original is not None:
        return dataclasses.replace(envelope, source=original[0], position=original[1])
    topic = envelope.header(ORIGINAL_TOPIC)
    return envelope if topic is None else dataclasses.replace(envelope, source=topic)


@dataclasses.dataclass
class _Pending:
    record: Any
    entry: Entry
    ok: bool | None = None  # None: waiting for the delivery report (or nothing to deliver)
    error: str = ""


class _KafkaReplay:
    def __init__(self, config: dict[str, Any], topic: str, group: str, planner: Planner,
                 destination: str | None, options: ReplayOptions, idle_timeout: float,
                 batch_size: int, delivery_timeout: float) -> None:
        self.ck = require("confluent_kafka", "kafka")
        self.topic, self.planner, self.destination = topic, planner, destination
        self.options, self.idle_timeout = options, idle_timeout
        # With a rate, a batch lasts about a second, so progress is committed about once a second.
        self.batch_size = max(1, min(batch_size, int(options.rate))) if options.rate else batch_size
        self.delivery_timeout = delivery_timeout
        self.summary = Summary.start(options)
        self.pacer = Pacer(options.rate)
        self.consumer = self.ck.Consumer({
            **config, "group.id": group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "enable.auto.offset.store": False, "enable.partition.eof": True,
        })
        self.dry_run = options.dry_run
        self.producer: Any = None if self.dry_run else self.ck.Producer({**config, "acks": "all"})
        self.ended: set[int] = set()
        self.answered: set[int] = set()  # partitions that sent a record or an end-of-partition event
        self.started_ms = int(time.time() * 1000)

    def assign(self) -> list[int]:
        metadata = self.consumer.list_topics(self.topic, timeout=10)
        found = metadata.topics.get(self.topic)
        if found is None or found.error is not None or not found.partitions:
            raise LookupError(f"dead-letter topic {self.topic!r} not found: {found.error if found else ''}")
        partitions = sorted(found.partitions)
        tps = [self.ck.TopicPartition(self.topic, p) for p in partitions]
        committed = self.consumer.committed(tps, timeout=10)
        for tp in committed:
            if tp.offset < 0:
                tp.offset = self.ck.OFFSET_BEGINNING
        self.consumer.assign(committed)
        return partitions

    def run(self) -> Summary:
        try:
            partitions = self.assign()
            if self.options.on_start is not None:
                self.options.on_start(None)
            began = time.monotonic()
            idle_since: float | None = None  # the idle clock starts once every partition answered
            while len(self.ended) < len(partitions) and not self._limit_reached():
                want = self.batch_size
                if self.options.limit is not None:
                    want = min(want, self.options.limit - self.summary.examined)
                records = [r for r in self.consumer.consume(num_messages=want, timeout=0.2)
                           if not self._skip(r)]
                now = time.monotonic()
                if records:
                    idle_since = now
                    self._handle(records)
                elif idle_since is None:
                    if self.answered >= set(partitions) or now - began >= STARTUP_TIMEOUT:
                        idle_since = now
                elif now - idle_since >= self.idle_timeout:
                    break
        finally:
            self.consumer.close()
            self.producer = None  # every batch was flushed; anything unflushed was not committed
        return self.summary

    def _limit_reached(self) -> bool:
        return self.options.limit is not None and self.summary.examined >= self.options.limit

    def _skip(self, record: Any) -> bool:
        """True for events that are not records (end of partition, errors librdkafka recovers from
        by itself) and for records past a partition's end. Raises for fatal errors."""
        error = record.error()
        self.answered.add(record.partition())
        if error is not None:
            if error.fatal():
                raise self.ck.KafkaException(error)
            if error.code() != self.ck.KafkaError._PARTITION_EOF:
                log.warning("consumer error on %s (retried by the client): %s", self.topic, error)
            return True
        if record.partition() in self.ended:
            return True
        kind, timestamp = record.timestamp()
        if kind != self.ck.TIMESTAMP_NOT_AVAILABLE and timestamp > self.started_ms:
            log.info("partition %s of %s ends at offset %s (written after the replay started)",
                     record.partition(), self.topic, record.offset())
            self._end(record.partition())
            return True
        return False

    def _end(self, partition: int) -> None:
        self.ended.add(partition)
        self.consumer.pause([self.ck.TopicPartition(self.topic, partition)])

    def _handle(self, records: list[Any]) -> None:
        """Judge the batch (one Redis round trip), produce what it needs, wait for the delivery
        reports (one flush), commit."""
        seen = [from_kafka(record) for record in records]
        entries = self.planner.judge_many([(_as_consumed(s), s.header(REASON) or "") for s in seen])
        pending: list[_Pending] = []
        stopped: set[int] = set()  # partitions with a failure earlier in this batch
        for record, envelope, entry in zip(records, seen, entries, strict=True):
            if record.partition() in stopped:
                continue  # judged, but neither acted on nor counted: the next run sees it again
            item = _Pending(record, entry)
            pending.append(item)
            target = self._target(envelope) if entry.step is Step.REPLAY else (None, {})
            if entry.step is Step.REPLAY and target[0] is None:
                item.entry = dataclasses.replace(item.entry, note=NO_DESTINATION)
                item.ok, item.error = False, NO_DESTINATION
                stopped.add(record.partition())
            elif not self.dry_run and not self._start(item, target):
                stopped.add(record.partition())
        if not self.dry_run:
            remaining = self.producer.flush(self.delivery_timeout)
            if remaining:
                log.error("%d deliveries not reported within %ss", remaining, self.delivery_timeout)
        self._count_and_commit(pending)

    def _start(self, item: _Pending, target: tuple[str | None, dict[str, Any]]) -> bool:
        """Produce what ``item``'s step needs (``target``: where a REPLAY goes); ``False`` when it
        failed before producing."""
        record, entry = item.record, item.entry
        if entry.unavailable:
            item.ok, item.error = False, entry.note
            return False
        if entry.step is Step.DROP:
            item.ok = True
            return True
        if entry.step is Step.LEAVE:
            return self._produce(item, self.topic, record.headers() or [], partition=record.partition())
        topic, extra = target
        assert topic is not None  # checked by _handle
        self.pacer.wait()
        return self._produce(item, topic, replay_headers(record.headers() or []), **extra)

    def _target(self, seen: Envelope) -> tuple[str | None, dict[str, Any]]:
        """Where a replayed record (as ``seen``) goes, and ``partition=`` when it returns to its
        original topic."""
        original_topic = seen.header(ORIGINAL_TOPIC)
        target = self.destination or original_topic
        partition = seen.header(ORIGINAL_PARTITION)
        if target == original_topic and partition is not None and partition.isdigit():
            return target, {"partition": int(partition)}
        return target, {}

    def _produce(self, item: _Pending, topic: str, headers: list[tuple[str, Any]], **extra: Any) -> bool:
        """Queue a copy of ``item``'s record; its delivery report sets ``item.ok``."""

        def report(err: Any, _msg: Any) -> None:
            item.ok, item.error = err is None, str(err or "")

        try:
            self.producer.produce(topic, value=item.record.value(), key=item.record.key(), headers=headers,
                                  on_delivery=report, **extra)
        except (self.ck.KafkaException, BufferError) as exc:
            item.ok, item.error = False, f"produce to {topic} refused: {exc}"
            return False
        self.producer.poll(0)
        return True

    def _count_and_commit(self, pending: list[_Pending]) -> None:
        """Count every item and commit each partition up to its first failure."""
        commit: dict[int, int] = {}
        failed: set[int] = set()
        for item in pending:
            partition, offset = item.record.partition(), item.record.offset()
            if self.dry_run:
                self.summary.record(item.entry, ok=item.ok is not False)
                continue
            if partition in failed:
                continue  # left for the next run, not counted in this one
            if item.ok:
                commit[partition] = offset + 1
                self.summary.record(item.entry)
                log.info("replay key=%s token=%s %s (%s[%s]@%s)", item.entry.key, item.entry.token,
                         item.entry.step.value, self.topic, partition, offset)
                continue
            failed.add(partition)
            self.summary.record(item.entry, ok=False)
            log.error("replay key=%s token=%s failed, partition %s stops at offset %s: %s",
                      item.entry.key, item.entry.token, partition, offset, item.error or "no delivery report")
        if commit:
            offsets = [self.ck.TopicPartition(self.topic, p, o) for p, o in commit.items()]
            self.consumer.commit(offsets=offsets, asynchronous=False)
        for partition in failed:
            self._end(partition)


def replay_kafka(config: dict[str, Any], topic: str, group: str, planner: Planner, *,
                 destination: str | None = None, options: ReplayOptions | None = None,
                 idle_timeout: float = 5.0, batch_size: int = 100,
                 delivery_timeout: float = 30.0) -> Summary:
    """Replay the dead-letter ``topic`` as consumer group ``group``; see the module docstring.

    ``config`` is librdkafka configuration shared by the consumer and the producer (at least
    ``bootstrap.servers``). ``destination`` overrides the topic records go to (default: the
    ``x-dedupe-original-topic`` of each). Broker errors propagate; nothing uncommitted is lost.
    """
    return _KafkaReplay(config, topic, group, planner, destination, options or ReplayOptions(),
                        idle_timeout, batch_size, delivery_timeout).run()
