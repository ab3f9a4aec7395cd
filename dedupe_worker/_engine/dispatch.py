"""One dispatch: a :class:`~dedupe_worker.Decision` becomes broker actions, log lines,
counts and hooks, in the same order in every integration.

Each integration implements :class:`Broker`, the port: the few broker steps a verdict can need
(``ack``, ``defer``, ``retry``, ``dead_letter``). :func:`dispatch` calls the step the verdict's
action asks for; the step does the broker work and says what it did (an :class:`Acted`). Only then
does :func:`report` log it, count it and call the hooks, so a hook always runs after the broker
action it reports (the contract in :mod:`~dedupe_worker._engine.hooks`):

=================  ==========================================================================
step did           then
=================  ==========================================================================
ACKED              ``on_applied`` (verdict APPLIED) or ``on_duplicate`` (any other ACK)
DEFERRED           ``on_lease_lost`` (verdict LEASE_LOST), then ``on_deferred(delay)``
RETRIED            ``on_deferred(delay)``: a handler error with attempts left
DEAD_LETTERED      ``on_dead_letter`` (also a handler error whose attempts are spent)
HANDED_OVER        no hook: the error went to the framework, whose own retries decide
NOT_DONE           no hook: the step could not be carried out (e.g. a copy was not
                   confirmed) and the message was put back as it was; the step logged why
=================  ==========================================================================

Where the framework carries a step out by an exception (Celery's ``Retry`` once the copy is
published, Dramatiq's ``Retry`` for ``Retries`` to re-enqueue, FastStream's ``NackMessage``), the
step returns that exception in :attr:`Acted.then` instead of raising it: :func:`dispatch` runs
the hooks first and raises it last, so what a hook raises or how long it takes never changes it.

Integrations that carry a step out for many messages at once (the Kafka consumer's dead letters,
rewinds and commit per batch; the RabbitMQ consumer's ``ack(multiple)`` and its requeue while
Redis is down) call :func:`report` for each message once the step is done.

:class:`Tally` counts what was done and logs the summary line of a long-running consumer.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from .decision import Action, Decision, Reason
from .hooks import Hooks, call_hook

__all__ = ["ACKED", "Acted", "AsyncBroker", "Broker", "Done", "Tally", "dispatch", "dispatch_async", "is_noop",
           "report", "step"]

log = logging.getLogger(__name__)


class Done(enum.Enum):
    """What a broker step did with the message."""

    ACKED = "acked"
    DEFERRED = "deferred"
    RETRIED = "retried"
    DEAD_LETTERED = "dead_lettered"
    HANDED_OVER = "handed_over"
    NOT_DONE = "not_done"


class Acted:
    """What a step did: ``done``; ``delay``, the seconds before a DEFERRED or RETRIED message
    comes back; ``then``, an exception the integration raises to carry the step out, raised by
    :func:`dispatch` after the hooks."""

    __slots__ = ("delay", "done", "then")

    def __init__(self, done: Done, delay: float = 0.0, then: BaseException | None = None) -> None:
        self.done = done
        self.delay = delay
        self.then = then

    def __repr__(self) -> str:
        return f"Acted({self.done.name}, delay={self.delay:.3f}, then={self.then!r})"


#: An ACK needs nothing more from the broker, or its ack is the framework's once the call returns.
ACKED = Acted(Done.ACKED)


class Broker(Protocol):
    """The port: one method per :class:`~dedupe_worker.Action`, called with the message
    the integration consumed and its verdict. Each does the broker work (and logs what only it
    knows, such as a failed publish) and returns what it did; none calls a hook."""

    def ack(self, message: Any, decision: Decision) -> Acted:
        """APPLIED, DUPLICATE, PREVIOUSLY_FAILED: ack the message as done."""
        ...

    def defer(self, message: Any, decision: Decision) -> Acted:
        """IN_PROGRESS, LEASE_LOST, STORE_UNAVAILABLE: bring the message back later, without
        counting an attempt."""
        ...

    def retry(self, message: Any, decision: Decision) -> Acted:
        """HANDLER_ERROR: bring it back after a backoff while attempts are left (RETRIED), else
        dead-letter it (DEAD_LETTERED); or hand the error to the framework (HANDED_OVER)."""
        ...

    def dead_letter(self, message: Any, decision: Decision) -> Acted:
        """CONFLICT, INVALID_KEY, UNDECODABLE, PERMANENT_FAILURE, UNSERIALIZABLE_RESULT: set the
        message aside with its reason."""
        ...

    def where(self, message: Any) -> str:
        """Where the message is, for log lines (``task=... id=...``, ``topic:partition@offset``)."""
        ...


class AsyncBroker(Protocol):
    """:class:`Broker` with coroutine steps (``where`` stays a plain method)."""

    async def ack(self, message: Any, decision: Decision) -> Acted: ...
    async def defer(self, message: Any, decision: Decision) -> Acted: ...
    async def retry(self, message: Any, decision: Decision) -> Acted: ...
    async def dead_letter(self, message: Any, decision: Decision) -> Acted: ...
    def where(self, message: Any) -> str: ...


def dispatch(broker: Broker, hooks: Hooks, message: Any, key: str | None, decision: Decision,
             tally: Tally | None = None) -> Acted:
    """Carry out ``decision`` on ``message`` through ``broker``, then :func:`report` it; raise
    :attr:`Acted.then` last when the step set one. Returns what the step did."""
    acted: Acted = step(broker, decision.action)(message, decision)
    report(hooks, message, key, decision, acted, tally, broker.where)
    if acted.then is not None:
        raise acted.then
    return acted


async def dispatch_async(broker: AsyncBroker, hooks: Hooks, message: Any, key: str | None, decision: Decision,
                         tally: Tally | None = None) -> Acted:
    """:func:`dispatch` for a port whose steps are coroutines (FastStream): the same steps,
    awaited, and the same :func:`report`."""
    acted: Acted = await step(broker, decision.action)(message, decision)
    report(hooks, message, key, decision, acted, tally, broker.where)
    if acted.then is not None:
        raise acted.then
    return acted


def step(broker: Any, action: Action) -> Callable[[Any, Decision], Any]:
    """The port's method for ``action``."""
    if action is Action.ACK:
        return broker.ack  # type: ignore[no-any-return]
    if action is Action.DEFER:
        return broker.defer  # type: ignore[no-any-return]
    if action is Action.RETRY:
        return broker.retry  # type: ignore[no-any-return]
    return broker.dead_letter  # type: ignore[no-any-return]


def report(hooks: Hooks, message: Any, key: str | None, decision: Decision, acted: Acted,
           tally: Tally | None = None, where: Callable[[Any], str] | None = None) -> None:
    """Log what was done with ``message``, count it in ``tally`` and call the hooks it calls for
    (see the module doc), in that order. ``where(message)`` places the message in log lines."""
    done, reason = acted.done, decision.reason
    if tally is not None:
        tally.count(done, reason)
    if done is Done.ACKED:
        if log.isEnabledFor(logging.DEBUG):  # once per message: its arguments cost more than the check
            log.debug("%s key=%s token=%s%s", reason.value, key, decision.token, _at(where, message))
        if reason is Reason.APPLIED:
            call_hook(hooks.on_applied, message, decision)
        else:
            call_hook(hooks.on_duplicate, message, decision)
    elif done is Done.DEFERRED:
        log.info("deferred key=%s token=%s reason=%s%s by %.3fs", key, decision.token, reason.value,
                 _at(where, message), acted.delay)
        if reason is Reason.LEASE_LOST:
            call_hook(hooks.on_lease_lost, message, decision)
        call_hook(hooks.on_deferred, message, decision, acted.delay)
    elif done is Done.RETRIED:
        log.warning("handler failed key=%s token=%s%s, retry in %.3fs: %s", key, decision.token,
                    _at(where, message), acted.delay, decision.detail)
        call_hook(hooks.on_deferred, message, decision, acted.delay)
    elif done is Done.DEAD_LETTERED:
        log.error("dead-lettered key=%s token=%s reason=%s%s: %s", key, decision.token, reason.value,
                  _at(where, message), decision.detail)
        call_hook(hooks.on_dead_letter, message, decision)
    elif done is Done.HANDED_OVER:
        log.info("handler failed, claim released key=%s token=%s%s: %s", key, decision.token,
                 _at(where, message), decision.detail)


def _at(where: Callable[[Any], str] | None, message: Any) -> str:
    return "" if where is None else f" {where(message)}"


def is_noop(hook: Callable[..., None], base: Callable[..., None]) -> bool:
    """Whether the bound ``hook`` is the no-op ``base`` (not overridden): a batch path may then
    skip :func:`report` for its ACKs and count them with :meth:`Tally.acked`."""
    return getattr(hook, "__func__", None) is base


class Tally:
    """What a consumer did since it started, and its summary line at INFO: every ``interval``
    seconds (checked by :meth:`tick`, which the consumer's loop calls between batches) and once
    more from :meth:`close` at shutdown. ``clock`` is injectable for tests."""

    def __init__(self, name: str, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.interval = interval
        self.clock = clock
        self.started = clock()
        self.due = self.started + interval
        self.applied = self.duplicates = self.deferred = self.retried = self.dead_lettered = 0

    def begin(self) -> None:
        """Start the clock (the consumer starts consuming): the next line is ``interval`` away."""
        self.started = self.clock()
        self.due = self.started + self.interval

    def count(self, done: Done, reason: Reason) -> None:
        """Count one message that ``done`` reports on."""
        if done is Done.ACKED:
            if reason is Reason.APPLIED:
                self.applied += 1
            else:
                self.duplicates += 1
        elif done is Done.DEFERRED:
            self.deferred += 1
        elif done is Done.RETRIED or done is Done.HANDED_OVER:
            self.retried += 1
        elif done is Done.DEAD_LETTERED:
            self.dead_lettered += 1

    def acked(self, applied: int, duplicates: int) -> None:
        """Count ACKs done without :func:`report` (a batch whose ACK hooks are no-ops)."""
        self.applied += applied
        self.duplicates += duplicates

    def tick(self) -> None:
        """Log the summary line when ``interval`` has passed since the last one."""
        now = self.clock()
        if now >= self.due:
            self.due = now + self.interval
            self.log("running")

    def close(self) -> None:
        """Log the last summary line (at shutdown)."""
        self.log("stopped")

    def log(self, state: str) -> None:
        log.info("%s %s for %.0fs: applied=%d duplicates=%d deferred=%d retried=%d dead_lettered=%d", self.name,
                 state, self.clock() - self.started, self.applied, self.duplicates, self.deferred, self.retried,
                 self.dead_lettered)
