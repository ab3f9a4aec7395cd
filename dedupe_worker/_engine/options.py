"""The options every message integration shares, as one frozen object: :class:`ConsumerOptions`.

Each option and its default is written here once and documented once (``docs/configuration.md``,
"Options every integration shares"). Every integration accepts the object whole (``options=``)
and builds it from the same keyword names (the Kafka and RabbitMQ consumers, the Dramatiq and
FastStream middlewares); Celery's task attributes ``dedupe_<name>`` map 1:1 to the same names.
An integration takes the options it uses and ignores the others (the table says which), so one
object can be handed to several of them.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from .identify import body_fingerprint
from .pacing import FLUSH_AFTER
from .ttl import TTL_HEADER

__all__ = ["FASTSTREAM_RENAMED", "RETRY_OPTIONS", "ConsumerOptions"]

#: The options of :class:`~dedupe_worker._engine.RetryPolicy`: given ``None`` as a keyword, each
#: keeps its default (the consumers' keywords always accepted ``None`` so).
RETRY_OPTIONS = ("max_attempts", "retry_base", "retry_cap", "defer_base", "defer_cap", "defer_wait")

#: FastStream's keyword renamed, still accepted (with a ``DeprecationWarning``) for one release: old -> new.
FASTSTREAM_RENAMED = {"key": "key_strategy"}


@dataclass(frozen=True)
class ConsumerOptions:
    """How a consumer identifies, retries and defers its messages (see the module doc)."""

    #: ``Envelope -> key`` (:mod:`dedupe_worker.keys`). ``None``: the integration's default
    #: (``RABBITMQ_DEFAULT``, ``KAFKA_DEFAULT``, FastStream's per broker). Celery and Dramatiq
    #: take the key from the task's or actor's ``idempotency_key`` instead.
    key_strategy: Callable[[Any], str] | None = None
    #: ``Envelope -> fingerprint`` of the payload a key stands for (a key seen again with another
    #: one is a ``conflict``); ``None``: no check. Celery and Dramatiq: ``idempotency_fingerprint``.
    fingerprint: Callable[[Any], Any] | None = body_fingerprint
    #: The header holding a message's ttl in seconds (its outcome is kept that long instead of
    #: ``result_ttl``); a value that is not a positive number refuses the message
    #: (``undecodable``, the reason naming the header). ``None``: not read.
    ttl_header: str | None = TTL_HEADER
    #: Handler attempts before a failing message is dead-lettered (Celery: fails for good).
    max_attempts: int = 5
    #: Backoff between handler attempts: full jitter over ``retry_base * 2 ** (attempt - 1)``
    #: seconds, capped at ``retry_cap``.
    retry_base: float = 1.0
    retry_cap: float = 60.0
    #: Backoff of deferrals (in progress elsewhere, lease lost, Redis down), which never count as
    #: an attempt: full jitter over ``defer_base * 2 ** (deferrals - 1)``, capped at ``defer_cap``
    #: and at the holder's remaining lease. It starts at tens of milliseconds: a live holder
    #: usually finishes long before its lease would run out, and a dead one is taken over as soon
    #: as its lease does.
    defer_base: float = 0.05
    defer_cap: float = 30.0
    #: Seconds a copy of in-flight work may wait on its key (woken when the holder stores its
    #: outcome or releases) before it is deferred, where the integration can wait without
    #: blocking other messages (Celery's task body, the RabbitMQ consumer's waiting room, a
    #: paused Kafka partition, the Dramatiq and FastStream handler). 0 turns waiting off.
    defer_wait: float = 5.0
    #: Seconds of handler time whose finished outcomes may wait to be stored together; also the
    #: target run time of each claimed chunk (the RabbitMQ and Kafka consumers' batches).
    flush_after: float = FLUSH_AFTER
    #: Seconds between the summary lines a consumer logs at INFO (and one at shutdown).
    summary_interval: float = 10.0

    @classmethod
    def of(cls, options: ConsumerOptions | None = None, names: Collection[str] | None = None,
           others: Collection[str] = (), renamed: Mapping[str, str] | None = None, **keywords: Any) -> ConsumerOptions:
        """``options`` (else the defaults) with ``keywords`` set on top: what every integration
        builds its options with. ``names``: the options the integration takes as keywords (default:
        all); another name raises ``TypeError`` naming the choices, ``others`` (the integration's
        own keywords) among them. A keyword of ``renamed`` (old name -> new) still works, with a
        ``DeprecationWarning``; ``None`` for a retry option keeps its value."""
        base = options if options is not None else cls()
        if not keywords:
            return base
        allowed = FIELDS if names is None else tuple(names)
        changes: dict[str, Any] = {}
        for name, value in keywords.items():
            if renamed and name in renamed:
                warnings.warn(f"the option {name!r} is now called {renamed[name]!r}; {name!r} goes in the next release",
                              DeprecationWarning, stacklevel=3)
                name = renamed[name]
            if name not in allowed:
                raise TypeError(f"unknown option {name!r}; the options are {', '.join((*others, *allowed))}")
            if value is None and name in RETRY_OPTIONS:
                continue
            changes[name] = value
        return dataclasses.replace(base, **changes) if changes else base

    def merged(self, values: Mapping[str, Any]) -> ConsumerOptions:
        """These options with ``values`` (option name -> value) set on top, ``None`` skipped."""
        changes = {name: value for name, value in values.items() if value is not None}
        return dataclasses.replace(self, **changes) if changes else self


#: Every option's name, in the order of the class.
FIELDS = tuple(field.name for field in dataclasses.fields(ConsumerOptions))
