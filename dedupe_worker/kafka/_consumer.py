"""The deduplicating Kafka consumer loop (confluent-kafka, classic consumer groups).

One thread consumes a batch, derives each message's key, decides the whole batch with the engine's
:func:`~dedupe_worker.decide_many` (each chunk claimed just before its handlers run, each
outcome stored as soon as the handlers that finished since the last store reach ``flush_after``,
together with the next chunk's claim), dead-letters what must be, and then commits, per partition,
the offset after the last message before which everything is decided. The first undecided message
of a partition (in progress elsewhere, Redis down, handler error to retry, dead letter not
delivered) pauses that partition and rewinds it; the other partitions keep flowing.

Crash story: the consumer commits only after a batch is decided, so a crash redelivers at most the
uncommitted messages. Those whose outcome was stored answer DUPLICATE: every finished handler's,
except those that finished within the last ``flush_after`` before the crash. Those, and the one
whose handler was running, stay claimed until their leases run out and then run again (fence
outside effects with :func:`~dedupe_worker.current_claim`). Messages of the batch not started yet
were never claimed, so they run at once after the restart.
"""

from __future__ import annotations

import logging
import operator
import signal
import threading
from collections import Counter, deque
from collections.abc import Callable, Container, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from confluent_kafka import Consumer, Message, Producer, TopicPartition

from .._deduplicator import Deduplicator
from .._engine import (
    ACKED,
    HANDLER_RAN,
    Acted,
    Action,
    ConsumerOptions,
    Decision,
    Done,
    Hooks,
    Identify,
    Pacing,
    Reason,
    RetryPolicy,
    Tally,
    Verdicts,
    bytes_fingerprint,
    is_noop,
    report,
    verdicts_flow,
)
from .._messages.envelope import from_kafka
from .._operate.doctor import check_at_start
from ..keys import DEFAULT_HEADER, KAFKA_DEFAULT, body_fingerprint, default_header_key
from ._deadletter import DELIVERY_TIMEOUT, DeadLetter, DeadLetterProducer, producer_config
from ._flow import TP, PartitionFlow
from ._hooks import ConsumerHooks
from ._positions import DONE, Hold, PartitionState, plan_partition

__all__ = ["DedupeKafkaConsumer", "identify_records"]

log = logging.getLogger(__name__)
T = TypeVar("T")

Handler = Callable[[Message], Any]
BatchHandler = Callable[[list[Message]], Sequence[Any]]


class DedupeKafkaConsumer(PartitionFlow, ConsumerHooks, RetryPolicy):
    """Consume ``topics`` with ``config`` and apply ``handler(message)`` once per idempotency key.

    Guaranteed: ``enable.auto.commit`` is forced off and an offset is committed only when every
    earlier message of its partition is applied, a duplicate or delivered to the dead-letter topic;
    at-least-once delivery is never weakened into at-most-once. A key seen again (other offset,
    other partition, other consumer) is not applied again while its outcome is kept.

    Not guaranteed: a handler killed mid-run may run again after its lease (see the module doc);
    dead letters are written at least once (a crash between delivery and commit repeats one);
    the handler-error attempt count lives in memory and restarts after a rebalance or restart.

    :param config: confluent-kafka consumer settings (``bootstrap.servers``, ``group.id``, ...);
        ``auto.offset.reset`` defaults to ``earliest``.
    :param handler: called with the ``confluent_kafka.Message``; its return value is stored as the
        key's result (JSON). Give ``None`` and a ``batch_handler`` instead to handle batches.
    :param batch_handler: called once per batch with the messages to apply (duplicates left out)
        and returns one result per message; if it raises, every one of them failed (retried, then
        dead-lettered). ``current_claim()`` is not set inside it.
    :param options: the options every integration shares (:class:`~dedupe_worker.ConsumerOptions`:
        ``key_strategy``, default :data:`~dedupe_worker.keys.KAFKA_DEFAULT`; ``fingerprint``;
        ``ttl_header``; ``max_attempts``, ``retry_base``, ``retry_cap``, ``defer_base``,
        ``defer_cap``, ``defer_wait``: a partition held by a key in progress elsewhere resumes as
        soon as that key is decided, waiting at most ``defer_wait`` before it looks again;
        ``flush_after``; ``summary_interval``), whole; or each of them as a keyword, set on top.
    :param batch_size: most messages consumed and decided together.
    :param dead_letter_topic: format string for the dead-letter topic, ``{topic}`` = original.
    :param producer_overrides: extra settings for the dead-letter producer.
    :param dead_letter_timeout: seconds to wait for dead letters to be confirmed.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: Sequence[str],
        handler: Handler | None,
        deduplicator: Deduplicator,
        *,
        batch_handler: BatchHandler | None = None,
        options: ConsumerOptions | None = None,
        batch_size: int = 500,
        poll_timeout: float = 1.0,
        dead_letter_topic: str = "{topic}.dlq",
        producer_overrides: Mapping[str, Any] | None = None,
        dead_letter_timeout: float = DELIVERY_TIMEOUT,
        **shared: Any,
    ) -> None:
        #: The options every integration shares (``options`` with the keywords on top).
        self.options = options = ConsumerOptions.of(options, **shared)
        self.use(options)
        if batch_size < 1 or self.max_attempts < 1:
            raise ValueError("batch_size and max_attempts must be at least 1")
        if (handler is None) == (batch_handler is None):
            raise ValueError("give exactly one of handler and batch_handler")
        self.config = {"auto.offset.reset": "earliest", **config, "enable.auto.commit": False}
        self.topics = list(topics)
        self.handler = handler
        self.batch_handler = batch_handler
        self.dedupe = deduplicator
        #: Each record's key, fingerprint and ttl, or its refusal, and how a record is read for it.
        self.identify, self.read = identify_records(options)
        self.batch_size = batch_size
        self.poll_timeout = poll_timeout
        #: Handler timings carried from batch to batch, to size the claimed chunks.
        self.pacing = Pacing(options.flush_after)
        self.consumer = Consumer(self.config)
        producer = Producer(producer_config(self.config, producer_overrides, dead_letter_timeout))
        self.dead_letters = DeadLetterProducer(producer, dead_letter_topic, dead_letter_timeout)
        #: Count of decisions by reason value, plus ``"dead_lettered"`` and ``"committed"``.
        self.stats: Counter[str] = Counter()
        #: What was done with the messages, for the summary lines.
        self.tally = Tally("kafka consumer", options.summary_interval)
        #: ``(message, key, decision)`` of the ACKs of the batch being processed whose hooks run
        #: after its commit (only collected when ``on_applied`` or ``on_duplicate`` is overridden).
        self._acked: list[tuple[Message, str, Decision]] = []
        self._partitions: dict[TP, PartitionState] = {}
        self._stop = threading.Event()
        self._woken = deque()

    # -- lifecycle ------------------------------------------------------------------------------

    def run(self, install_signal_handlers: bool | None = None) -> None:
        """Consume until :meth:`stop` (or SIGTERM/SIGINT when ``install_signal_handlers``, the
        default in the main thread), then finish the current batch, commit it and leave the group."""
        if install_signal_handlers is None:
            install_signal_handlers = threading.current_thread() is threading.main_thread()
        previous = {}
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda *_: self.stop())
        check_at_start(self.dedupe)
        self.consumer.subscribe(self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_revoke)
        self.tally.begin()
        try:
            while not self._stop.is_set():
                self._resume_due()
                messages = self.consumer.consume(self.batch_size, self._wait())
                if messages:
                    self.process(messages)
                self.tally.tick()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()
            self.tally.close()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current batch (safe from any thread or signal)."""
        self._stop.set()

    def close(self) -> None:
        """Deliver queued dead letters and leave the group, which hands the partitions on."""
        self.dead_letters.close()
        self.consumer.close()

    # -- one batch ------------------------------------------------------------------------------

    def process(self, messages: Sequence[Message]) -> None:
        """Decide a batch, dead-letter, rewind what is undecided and commit what is decided."""
        live: list[Message] = []
        tps: list[TP] = []
        outcomes = self._outcomes(messages, live, tps)
        acked, self._acked = self._acked, []
        self._plan(live, tps, outcomes)
        for msg, key, decision in acked:  # the commit past them is done (or follows a hold): their hooks
            report(self, msg, key, decision, ACKED, None, _where)

    def _plan(self, live: Sequence[Message], tps: Sequence[TP], outcomes: Sequence[Any]) -> None:
        """Commit, per partition, past what is decided before its first hold, and rewind to that hold."""
        rows: dict[TP, list[tuple[int, Any]]] = {}
        for msg, tp, outcome in zip(live, tps, outcomes, strict=True):
            row = rows.get(tp)
            if row is None:
                row = rows[tp] = []
            row.append((msg.offset() or 0, outcome))
        commits: list[TopicPartition] = []
        for tp, outcome_rows in rows.items():
            state = self._partitions[tp]
            outcome_rows.sort()  # by offset: offsets are unique, so the outcomes are never compared
            plan = plan_partition(state, outcome_rows)
            if plan.commit is not None:
                commits.append(TopicPartition(tp[0], tp[1], plan.commit))
            if plan.rewind is not None:
                offset, hold = plan.rewind
                held = next(m for m, t in zip(live, tps, strict=True) if t == tp and (m.offset() or 0) == offset)
                acted = self._hold(tp, state, held, hold)
                if acted is not None:
                    assert hold.decision is not None
                    report(self, held, hold.key, hold.decision, acted, self.tally, _where)
        self._commit(commits)

    def _hold(self, tp: TP, state: PartitionState, msg: Message, hold: Hold) -> Acted | None:
        """The broker step of a message not decided (deferred, or a handler error to retry): rewind
        its partition to it, and wait on its key when it is held elsewhere. ``None`` for a dead
        letter not delivered (logged already)."""
        self._rewind(tp, state, msg.offset() or 0, hold.delay)
        decision = hold.decision
        if decision is None:
            return None
        if self._watchable(decision):
            assert decision.claim is not None
            state.held = msg
            self.dedupe.watcher.watch(decision.claim.stem, partial(self._wake, tp), hold.delay)
        return Acted(Done.RETRIED if decision.action is Action.RETRY else Done.DEFERRED, hold.delay)

    def _watchable(self, decision: Decision) -> bool:
        """A key held elsewhere: its partition waits on the key and resumes once it is decided."""
        return decision.reason is Reason.IN_PROGRESS and decision.claim is not None and self.defer_wait > 0

    def _outcomes(self, batch: Sequence[Message], live: list[Message], tps: list[TP]) -> list[Any]:
        """Fill ``live`` with the messages of ``batch`` to be handled now (:meth:`_accept`) and
        ``tps`` with their partitions; return ``DONE`` or a :class:`Hold` for each of them."""
        letters: list[tuple[int, DeadLetter]] = []
        before = self._admit(batch, live, tps)  # of the messages decided in an earlier batch, in live
        partitions = self._partitions
        outcomes: list[Any] = [None] * len(live)
        indices: Sequence[int] = range(len(live))  # of the messages to decide, in live
        if before:
            for i in before:
                pending = partitions[tps[i]].decided_behind[live[i].offset() or 0]
                if pending is None:
                    outcomes[i] = DONE
                else:
                    letters.append((i, DeadLetter(live[i], pending.decision, pending.key, pending.attempts)))
            indices = _without(indices, set(before))
        messages = live if not before else [live[i] for i in indices]
        keys, fingerprints, ttls, failures = self._identities(messages)
        if failures:  # refused (MissingKey, UndecodableMessage, a bad ttl, a broken strategy): dead-lettered
            failed = dict(failures)
            for n, decision in failures:
                self.stats[decision.reason.value] += 1
                letters.append((indices[n], DeadLetter(messages[n], decision)))
            indices, messages, keys = _without(indices, failed), _without(messages, failed), _without(keys, failed)
            fingerprints, ttls = _without(fingerprints, failed), _without(ttls, failed)
            letters.sort(key=_first)  # in the order of the batch, as they came
        verdicts = self.decide_batch(keys, fingerprints, messages, ttl=ttls)
        # ACK hooks run after the batch's commit (process()); not collected when both are no-ops
        hooked = not (is_noop(self.on_applied, Hooks.on_applied) and is_noop(self.on_duplicate, Hooks.on_duplicate))
        stats = self.stats
        debug = log.isEnabledFor(logging.DEBUG)
        reasons = verdicts.reasons
        applied, duplicates, failed_before = (reasons.count(_APPLIED), reasons.count(_DUPLICATE),
                                              reasons.count(_PREVIOUSLY_FAILED))
        self._act(live, indices, keys, verdicts, outcomes, letters, hooked=hooked, debug=debug)
        for reason, count in ((_APPLIED, applied), (_DUPLICATE, duplicates), (_PREVIOUSLY_FAILED, failed_before)):
            if count:
                stats[reason.value] += count
        self.tally.acked(applied, duplicates + failed_before)
        delivered = self.dead_letters.send([letter for _, letter in letters])
        for (i, letter), ok in zip(letters, delivered, strict=True):
            holds = self._state(letter.message).holds
            outcomes[i] = DONE if ok else Hold(self.defer_delay(holds + 1), letter)
            self._after_dead_letter(letter, ok)
        return outcomes

    def _admit(self, batch: Sequence[Message], live: list[Message], tps: list[TP]) -> list[int]:
        """Fill ``live`` with the messages of ``batch`` to be handled now and ``tps`` with their
        partitions; return the positions in ``live`` of those decided in an earlier batch (behind a
        hold). A record of a partition that flows (:func:`_flows`, asked once a batch, and again
        after each of its records :meth:`_accept` took) costs a set look-up; each other record is
        :meth:`_accept`'s, since every consumed record passes here (bench.kafka_cpu prices it)."""
        partitions, accept = self._partitions, self._accept
        flowing = {tp for tp, state in partitions.items() if _flows(state)}
        before: list[int] = []
        for msg in batch:
            tp = (msg.topic(), msg.partition())
            if msg.error() is None and tp in flowing:
                live.append(msg)
                tps.append(tp)
                continue
            accepted = accept(msg)
            if accepted is None:
                continue
            state = partitions[accepted]
            if state.decided_behind and (msg.offset() or 0) in state.decided_behind:  # decided earlier, behind a hold
                before.append(len(live))
            live.append(msg)
            tps.append(accepted)
            if _flows(state):  # its rewind is over: its next records cost a set look-up again
                flowing.add(accepted)
        return before

    def _act(self, live: Sequence[Message], indices: Sequence[int], keys: Sequence[str], verdicts: Verdicts,
             outcomes: list[Any], letters: list[tuple[int, DeadLetter]], *, hooked: bool, debug: bool) -> None:
        """Each verdict of ``indices`` (in ``live``) as its outcome: DONE for an ACK (its hooks
        collected when ``hooked``, logged at DEBUG), else a :class:`Hold` or a dead letter queued."""
        acked, stats = self._acked, self.stats
        for j, (i, reason) in enumerate(zip(indices, verdicts.reasons, strict=True)):
            if reason is not _APPLIED and reason is not _DUPLICATE and reason is not _PREVIOUSLY_FAILED:
                stats[reason.value] += 1
                outcomes[i] = self._verdict(live[i], keys[j], verdicts[j], letters, i)
                continue
            if debug:
                log.debug("%s key=%s token=%s offset=%s", reason.value, keys[j], verdicts[j].token, live[i].offset())
            if hooked:
                acked.append((live[i], keys[j], verdicts[j]))
            outcomes[i] = DONE

    def _identities(self, messages: Sequence[Message]) -> tuple[list[str], list[Any], list[float | None],
                                                                list[tuple[int, Decision]]]:
        """:attr:`identify` of each of ``messages``, in columns (:meth:`Identify.many
        <dedupe_worker._engine.Identify.many>`): keys, fingerprints, ttls (``None`` in all three at
        a message refused), and the ``(position, refusal)`` of the refused."""
        keys, fingerprints, ttls, failures = self.identify.many(messages, self.read)
        return keys, fingerprints, [None] * len(messages) if ttls is None else ttls, failures

    def decide_batch(self, keys: Sequence[str], fingerprints: Sequence[Any], messages: Sequence[Message], *,
                     ttl: Sequence[float | None] | None = None) -> Verdicts:
        """The dedupe verdicts for ``messages`` (their ``keys`` and ``fingerprints``): the batch
        engine (:func:`~dedupe_worker.decide_many`) calling the handler with each message that
        must run, or the batch handler with all of them; ``ttl``: each message's retention (from
        its ``ttl_header``). A :class:`~dedupe_worker._engine.Verdicts`: an ACK's Decision
        is built only if a hook asks for it."""
        batch = self.batch_handler
        run_batch = None if batch is None else (lambda chosen: batch([messages[i] for i in chosen]))
        return self.dedupe._drive(verdicts_flow(self.dedupe, keys, fingerprints, self.handler or _batched, messages,
                                               run_batch=run_batch, pacing=self.pacing, integration="kafka", ttl=ttl))

    def _verdict(self, msg: Message, key: str, decision: Decision,
                 letters: list[tuple[int, DeadLetter]], index: int) -> Any:
        """Map one decision that is not an ACK to a :class:`Hold` or (queued in ``letters``) a dead
        letter (``stats`` counted it already)."""
        state = self._state(msg)
        offset = msg.offset() or 0
        action = decision.action
        attempts = state.attempts.get(offset, 0)
        if decision.reason in HANDLER_RAN:
            attempts = state.attempts[offset] = attempts + 1
        if action is Action.RETRY and attempts < self.max_attempts:
            delay = self.retry_delay(attempts)
        elif action is Action.DEFER:
            if self._watchable(decision):  # resumed when the key is decided (see _hold)
                delay = min(decision.retry_after + 0.01, self.defer_wait)
            else:
                delay = self.defer_delay(state.holds + 1, decision.retry_after or None)
        else:
            letters.append((index, DeadLetter(msg, decision, key, attempts)))
            return None
        return Hold(delay, decision=decision, key=key)

    def _after_dead_letter(self, letter: DeadLetter, ok: bool) -> None:
        msg, decision = letter.message, letter.decision
        if ok:
            self.stats["dead_lettered"] += 1
            report(self, msg, letter.key, decision, _DEAD_LETTERED, self.tally, _where)
        else:
            log.error("dead letter not delivered key=%s token=%s %s; holding the partition",
                      letter.key, decision.token, _where(msg))


_APPLIED, _DUPLICATE, _PREVIOUSLY_FAILED = Reason.APPLIED, Reason.DUPLICATE, Reason.PREVIOUSLY_FAILED


def identify_records(options: ConsumerOptions) -> tuple[Identify[Any], Callable[[Message], Any]]:
    """The engine's :class:`~dedupe_worker._engine.Identify` for the records of a consumer with
    ``options``, and what it reads a record as. A record is read as its envelope
    (:func:`~dedupe_worker._messages.envelope.from_kafka`), except under the default key strategy
    and fingerprint, which read of an envelope only its headers and its body: then the reading is
    the record's ``(key, fingerprint, headers)`` (:class:`_Records`, a batch's at once), the
    envelope built only for a record without the ``idempotency-key`` header (the rest of the default
    chain), and ``Identify`` takes each from it by position. Every consumed record passes here: its
    envelope costs the duplicates' messages per second more than 10%, and a Python call per record
    adds to every record (docs/performance.md, "Kafka duplicates, issue 37");
    ``tests/test_kafka_identify.py`` holds both readings to the same answers."""
    strategy, fingerprint = options.key_strategy or KAFKA_DEFAULT, options.fingerprint
    if strategy is not KAFKA_DEFAULT or (fingerprint is not None and fingerprint is not body_fingerprint):
        return Identify("kafka", strategy, fingerprint, ttl_header=options.ttl_header), from_kafka
    return (Identify("kafka", _key, None if fingerprint is None else _fingerprint, ttl_header=options.ttl_header,
                     headers=_headers), _Records(fingerprint is not None))


class _Records:
    """``(key, fingerprint, headers)`` of records under the defaults: the key as
    :data:`~dedupe_worker.keys.KAFKA_DEFAULT` reads its envelope, the fingerprint as
    :func:`~dedupe_worker.keys.body_fingerprint` does (``None`` when not ``fingerprinted``), the
    headers as ``from_kafka()`` reads them. :meth:`many` reads a batch (what :class:`Identify`
    asks for), each step over all of its records; a record alone is read as a batch of one."""

    __slots__ = ("fingerprinted",)

    def __init__(self, fingerprinted: bool) -> None:
        self.fingerprinted = fingerprinted

    def __call__(self, msg: Message) -> tuple[str, str | None, dict[str, Any]]:
        return self.many([msg])[0]

    def many(self, messages: Sequence[Message]) -> list[tuple[str, str | None, dict[str, Any]]]:
        # confluent-kafka's records: its methods called unbound (no bound method made a record)
        read_headers, read_value = ((Message.headers, Message.value) if set(map(type, messages)) == _MESSAGE
                                    else (_headers_call, _value_call))
        headers = [dict(pairs) if pairs else {} for pairs in map(read_headers, messages)]
        keys: list[Any] = [value.decode("utf-8", "backslashreplace") if type(value) is bytes and value else None
                           for value in [one.get(DEFAULT_HEADER) for one in headers]]
        if None in keys:  # not a non-empty bytes header: the rest of the default chain
            for n, key in enumerate(keys):
                if key is None:
                    key = default_header_key(headers[n])
                    keys[n] = KAFKA_DEFAULT(from_kafka(messages[n])) if key is None else key
        if not self.fingerprinted:
            return list(zip(keys, [None] * len(messages), headers, strict=True))
        return list(zip(keys, [bytes_fingerprint(body or b"") for body in map(read_value, messages)], headers,
                        strict=True))


#: The key, fingerprint and headers of a :class:`_Records` reading.
_key, _fingerprint, _headers = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)
#: A record's headers and body (any object with the ``Message`` methods).
_headers_call, _value_call = operator.methodcaller("headers"), operator.methodcaller("value")
_MESSAGE = {Message}


_DEAD_LETTERED = Acted(Done.DEAD_LETTERED)


def _flows(state: PartitionState) -> bool:
    """Whether a partition's records are taken as they come: not paused, not rewound (a fetch from
    before the rewind may still come), no offset decided behind a hold."""
    return state.paused_until is None and state.rewound_to is None and not state.decided_behind


def _first(letter: tuple[int, DeadLetter]) -> int:
    return letter[0]


def _without(column: Sequence[T], left_out: Container[int]) -> list[T]:
    """``column`` without the positions in ``left_out``."""
    return [value for n, value in enumerate(column) if n not in left_out]


def _where(msg: Message) -> str:
    """``topic:partition@offset`` of ``msg``, for log lines."""
    return f"{msg.topic()}:{msg.partition()}@{msg.offset()}"


def _batched(_message: Message) -> None:
    """Stands in for the per-message handler when a batch handler runs instead (never called)."""
    raise AssertionError("the engine runs the batch handler, not this one")
