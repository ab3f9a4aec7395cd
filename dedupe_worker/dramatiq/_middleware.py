"""``DedupeMiddleware``: every actor on a Dramatiq broker applies its work once per idempotency key.

Usage::

    broker = RabbitmqBroker(url="amqp://...")
    broker.add_middleware(DedupeMiddleware(Deduplicator.from_url("redis://...")))

    @dramatiq.actor(idempotency_key=lambda order_id, amount: f"charge:{order_id}")
    def charge(order_id, amount):
        token = current_claim().token       # fence your writes with it
        ...

The middleware wraps each actor's function: the worker's call goes through the engine
(:func:`dedupe_worker.decide`), which claims the key, runs the actor with its lease renewed
and ``current_claim()`` set, stores its return value, and gives a verdict. The middleware maps the
verdict onto Dramatiq and holds no dedupe logic of its own:

===================  ======================================================================
verdict              the message ...
===================  ======================================================================
applied              is acked; the actor's return value is stored (and is the result)
duplicate            is acked without running the actor; the stored value is the result
previously_failed    is acked without running the actor (its result is ``None``)
in_progress          first waits up to ``defer_wait`` on the key (the worker thread stays
                     busy): acked as a duplicate as soon as the holder stores its outcome, or
                     run if the holder released the key or its lease ran out; then, as below
lease_lost,          goes back through Dramatiq's ``Retries`` with a delay that starts at tens
store_unavailable    of ms and never outlasts the holder's lease; it does not spend
                     ``max_retries`` and is repeated until it runs
handler_error        the claim is released and the exception is Dramatiq's as usual:
                     ``Retries`` retries it (``max_retries``, ``min_backoff``, ``throws``) and
                     dead-letters it when they are spent
conflict, invalid_    is dead-lettered with the reason: on ``RabbitmqBroker`` a copy goes to the
key, permanent_       queue's ``.XQ`` with ``x-dedupe-*`` headers and ``dedupe_*`` options, and
failure, unserial-    the original is acked; on other brokers the message is failed into the
izable_result         broker's own dead-letter queue and the reason is logged
===================  ======================================================================

**The key.** The actor option ``idempotency_key`` is called with the message's arguments
(``*args, **kwargs``) and returns the key. Without it the key is the message id: Dramatiq keeps
``message_id`` through its retries, delays and redeliveries, so the actor runs once per *sent*
message, but a producer that sends the same work twice sends two ids (give a key for that).
``idempotency_fingerprint`` (a callable over the arguments, or ``False`` for no check) says what
payload a key stands for; by default a hash of the actor name and the arguments, so a key reused
with other arguments is dead-lettered as ``conflict`` instead of answered with a wrong result.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import dramatiq
from dramatiq.common import q_name, xq_name
from dramatiq.middleware import Middleware, MiddlewareError, Retries, SkipMessage

try:
    import pika
    from dramatiq.brokers.rabbitmq import RabbitmqBroker
except ImportError:  # dramatiq without its rabbitmq extra: other brokers dead-letter by failing
    RabbitmqBroker = None  # type: ignore[assignment,misc]

from .._deduplicator import Deduplicator
from .._engine import (
    ACKED,
    Acted,
    ConsumerOptions,
    Decision,
    Done,
    Hooks,
    Identify,
    RetryPolicy,
    decide,
    dispatch,
    parse_ttl,
)
from .._errors import EvictionPolicyError, InvalidKey
from .._messages.deadletter import dead_letter_headers
from .._messages.envelope import Envelope
from .._operate.doctor import check_at_start
from ..keys import fingerprint_of, message_id_key

__all__ = ["DEFERRALS_OPTION", "DeadLettered", "DedupeMiddleware"]

log = logging.getLogger(__name__)

#: Message option counting how often a message was deferred (drives the backoff, not max_retries).
DEFERRALS_OPTION = "dedupe_deferrals"

#: The options of :class:`~dedupe_worker.ConsumerOptions` the middleware takes as keywords.
OPTION_NAMES = ("ttl_header", "defer_base", "defer_cap", "defer_wait")

#: Set on an actor function once it is wrapped.
_WRAPPED = "__dedupe_wrapped__"

_message: contextvars.ContextVar[Any] = contextvars.ContextVar("dedupe_dramatiq_message", default=None)


class DeadLettered(SkipMessage):
    """Raised out of the actor call once a message was dead-lettered: Dramatiq then skips it (no
    retry, no result) and acks it, or nacks it into the broker's dead-letter queue when the
    copy could not be published (``message.failed``)."""

    def __init__(self, decision: Decision, key: str | None) -> None:
        super().__init__(f"{decision.reason.value}: {decision.detail}")
        self.decision = decision
        self.key = key


class DedupeMiddleware(Middleware, Hooks, RetryPolicy):
    """Applies every actor of the broker once per idempotency key (see the module doc).

    **Crash safety.** Dramatiq acks a message after the actor returned, so a worker that dies
    mid-actor (SIGKILL, OOM) leaves it un-acked and the broker redelivers it. The dead worker's
    claim stays held until its lease runs out (nobody renews it), so the redelivery is deferred
    until then and runs the actor again under a larger fencing token. Effects the dead worker made
    before dying are not undone: fence them with ``current_claim().token``.

    **Deferral without spending retries.** A deferral raises ``dramatiq.Retry(delay=...)``, which
    Dramatiq's ``Retries`` middleware (required) re-enqueues with the delay; the message's
    ``retries`` is lowered by one first, so the re-sent copy carries the count it came with and
    ``max_retries`` is left whole for real failures. An actor ``retry_when`` predicate is asked
    about the ``Retry`` too: it must not refuse it.

    **Options.** ``ttl_header``, ``defer_base``, ``defer_cap`` and ``defer_wait`` as in every
    integration (:class:`~dedupe_worker.ConsumerOptions`, whole as ``options=`` or as keywords);
    handler errors follow Dramatiq's own ``max_retries``/``min_backoff``/``max_backoff``/``throws``,
    so ``max_attempts``, ``retry_base`` and ``retry_cap`` are not used here, and the key and the
    fingerprint are the actor's options (see the module doc). Hooks:
    :class:`~dedupe_worker.Hooks`, ``message`` being Dramatiq's message.

    **Not guaranteed.** An actor called directly (``charge(1, 5)``, not through a worker) runs as
    a plain function, without a claim. ``async def`` actors (with Dramatiq's ``AsyncIO``
    middleware) run on its event loop thread; ``current_claim()`` is set inside their coroutine
    too (the coroutine is handed to the loop with a copy of the worker thread's context).
    """

    def __init__(self, dedupe: Deduplicator, *, options: ConsumerOptions | None = None, **keywords: Any) -> None:
        self.dedupe = dedupe
        #: The options every integration shares (``options`` with the keywords on top).
        self.options = options = ConsumerOptions.of(options, names=OPTION_NAMES, **keywords)
        self.use(options)
        #: Each call's key, fingerprint and ttl (the ``ttl_header`` message option, else the
        #: actor's ``idempotency_ttl``), or its refusal.
        self.identify: Identify[_Call] = Identify("dramatiq", _key, _fingerprint, ttl_header=options.ttl_header,
                                                  headers=_options, default_ttl=_actor_ttl)

    @property
    def actor_options(self) -> set[str]:
        return {"idempotency_key", "idempotency_fingerprint", "idempotency_ttl"}

    # -- Dramatiq's hooks -----------------------------------------------------------------------

    def after_declare_actor(self, broker: dramatiq.Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        """Wrap the actor's function so that the worker's call goes through the engine."""
        self.wrap(actor)

    def before_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        """Refuse to start without ``Retries`` (deferrals go through it) or on a Redis that may
        evict our records (:func:`~dedupe_worker._operate.check_at_start`); wrap actors declared
        before this middleware was added."""
        if not any(isinstance(m, Retries) for m in broker.middleware):
            # dramatiq logs any other exception of a boot hook and boots anyway
            raise MiddlewareError("DedupeMiddleware defers messages through dramatiq's Retries middleware: add it")
        try:
            check_at_start(self.dedupe)
        except EvictionPolicyError as exc:
            raise MiddlewareError(str(exc)) from exc
        for name in broker.get_declared_actors():
            self.wrap(broker.get_actor(name))

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        """Remember the message for the wrapped actor function (same worker thread)."""
        _message.set(message)

    def after_process_message(self, broker: dramatiq.Broker, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        _message.set(None)

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        _message.set(None)

    # -- machinery ------------------------------------------------------------------------------

    def wrap(self, actor: dramatiq.Actor[Any, Any]) -> None:
        """Route ``actor``'s calls by a worker through :meth:`process` (once per actor)."""
        fn = actor.fn
        if getattr(fn, _WRAPPED, False):
            return

        @functools.wraps(fn)
        def once(*args: Any, **kwargs: Any) -> Any:
            message = _message.get()
            if message is None or message.actor_name != actor.actor_name:  # a direct call
                return fn(*args, **kwargs)
            return self.process(actor, message, fn, args, kwargs)

        setattr(once, _WRAPPED, True)
        actor.fn = once

    def process(self, actor: dramatiq.Actor[Any, Any], message: Any, fn: Callable[..., Any],
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Identify the call, let :func:`decide` claim its key and run ``fn``, and act on its verdict."""
        found = self.identify(_Call(actor, message, args, kwargs))
        if isinstance(found, Decision):
            return self.act(actor.broker, message, found, None)
        key, fingerprint, ttl = found
        body = functools.partial(fn, *args, **kwargs)
        decision = decide(self.dedupe, key, body, fingerprint=fingerprint, wait=self.defer_wait,
                          integration="dramatiq", ttl=ttl)
        return self.act(actor.broker, message, decision, key)

    @staticmethod
    def key_for(actor: dramatiq.Actor[Any, Any], message: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> str:
        """The ``idempotency_key`` option's key for these arguments, else the message id.
        Raises :class:`InvalidKey` when the option fails or gives no key."""
        option = actor.options.get("idempotency_key")
        if option is None:
            return message_id_key()(Envelope(b"", message_id=message.message_id))
        try:
            key = option(*args, **kwargs)
        except Exception as exc:  # a key function that fails on this input: dead-letter it
            raise InvalidKey(f"idempotency_key of {actor.actor_name} failed on these arguments: {exc!r}") from exc
        if key is None or key == "":
            raise InvalidKey(f"idempotency_key of {actor.actor_name} gave no key for these arguments")
        return key if isinstance(key, str) else str(key)

    @staticmethod
    def fingerprint_for(actor: dramatiq.Actor[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``None`` (no check) when the option is ``False``; the option's value when callable;
        else a hash of the actor name and the arguments."""
        option = actor.options.get("idempotency_fingerprint")
        if option is False:
            return None
        try:
            if callable(option):
                return option(*args, **kwargs)
            return fingerprint_of([actor.actor_name, list(args), kwargs])
        except Exception as exc:
            raise InvalidKey(f"idempotency_fingerprint of {actor.actor_name} failed: {exc!r}") from exc

    def act(self, broker: dramatiq.Broker, message: Any, decision: Decision, key: str | None) -> Any:
        """Act on the engine's verdict through :func:`~dedupe_worker._engine.dispatch.dispatch`
        (hooks after the action): return the value, or raise what carries the action out
        (``Retry`` for ``Retries``, the handler's error, :class:`DeadLettered`)."""
        dispatch(_MessageSteps(self, broker, key), self, message, key, decision)
        return decision.value

    def defer(self, message: Any, decision: Decision, key: str | None) -> Acted:
        """Set the message up to come back later without spending ``max_retries`` (see the class
        doc); returns the deferral with the ``Retry`` that ``Retries`` re-enqueues it on."""
        deferrals = int(message.options.get(DEFERRALS_OPTION, 0)) + 1
        delay = self.defer_delay(deferrals, decision.retry_after or None)
        message.options[DEFERRALS_OPTION] = deferrals
        message.options["retries"] = message.options.get("retries", 0) - 1  # Retries adds it back
        return Acted(Done.DEFERRED, delay, then=dramatiq.Retry(delay=max(1, round(delay * 1000))))

    def dead_letter(self, broker: dramatiq.Broker, message: Any, decision: Decision, key: str | None) -> Acted:
        """Set the message aside with its reason (see the module doc); returns it with the
        :class:`DeadLettered` that makes Dramatiq neither retry it nor store a result."""
        headers = dead_letter_headers(decision, key=key, original_queue=q_name(message.queue_name))
        message.options.update({"dedupe_reason": decision.reason.value, "dedupe_error": decision.detail,
                                "dedupe_key": key})
        if not self._publish_dead_letter(broker, message, headers):
            message.fail()  # the broker's own dead-letter queue, without the headers
        return Acted(Done.DEAD_LETTERED, then=DeadLettered(decision, key))

    @staticmethod
    def _publish_dead_letter(broker: dramatiq.Broker, message: Any, headers: dict[str, str]) -> bool:
        """Publish a copy with ``headers`` to the RabbitMQ queue's ``.XQ``; ``False`` when the
        broker is not RabbitMQ or the publish failed (the caller then fails the message)."""
        if RabbitmqBroker is None or not isinstance(broker, RabbitmqBroker):
            return False
        try:
            broker.channel.basic_publish(exchange="", routing_key=xq_name(q_name(message.queue_name)),
                                         body=message.encode(),
                                         properties=pika.BasicProperties(delivery_mode=2, headers=headers))
        except Exception as exc:  # the caller nacks the original into the XQ instead
            log.warning("dead-letter publish failed message_id=%s: %s", message.message_id, exc)
            return False
        return True


class _Call(NamedTuple):
    """One call of an actor by a worker: what :attr:`DedupeMiddleware.identify` reads."""

    actor: dramatiq.Actor[Any, Any]
    message: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _key(call: _Call) -> str:
    return DedupeMiddleware.key_for(call.actor, call.message, call.args, call.kwargs)


def _fingerprint(call: _Call) -> Any:
    return DedupeMiddleware.fingerprint_for(call.actor, call.args, call.kwargs)


def _options(call: _Call) -> dict[str, Any]:
    """Where a Dramatiq message carries the ttl header: its options."""
    options: dict[str, Any] = call.message.options
    return options


def _actor_ttl(call: _Call) -> float | None:
    """The actor option ``idempotency_ttl`` (the ttl when the message carries none)."""
    option = call.actor.options.get("idempotency_ttl")
    if option is None:
        return None
    return parse_ttl(option, f"idempotency_ttl of {call.actor.actor_name}")  # the label only when there is a value


class _MessageSteps:
    """The dispatch port of :class:`DedupeMiddleware` (:class:`~dedupe_worker._engine.dispatch.Broker`)
    for one message."""

    __slots__ = ("broker", "key", "middleware")

    def __init__(self, middleware: DedupeMiddleware, broker: dramatiq.Broker, key: str | None) -> None:
        self.middleware = middleware
        self.broker = broker
        self.key = key

    def ack(self, message: Any, decision: Decision) -> Acted:
        return ACKED  # Dramatiq acks once the actor returns

    def defer(self, message: Any, decision: Decision) -> Acted:
        return self.middleware.defer(message, decision, self.key)

    def retry(self, message: Any, decision: Decision) -> Acted:
        # Dramatiq's Retries counts it, backs off, dead-letters when spent
        return Acted(Done.HANDED_OVER, then=decision.error)

    def dead_letter(self, message: Any, decision: Decision) -> Acted:
        return self.middleware.dead_letter(self.broker, message, decision, self.key)

    def where(self, message: Any) -> str:
        return f"message_id={message.message_id}"
