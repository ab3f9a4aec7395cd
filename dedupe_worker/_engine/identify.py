"""Identify once: a message as what the engine claims (key, fingerprint, ttl), or its refusal.

Every integration and the replay turn what they consumed into an :class:`Identity` through one
:class:`Identify` (built once per consumer from its options) and nothing else:

=========================================  ===============  ==========================================
the message                                the answer       its error (the dead letter's reason text)
=========================================  ===============  ==========================================
the key strategy finds no key              ``invalid_key``  :class:`~dedupe_worker.MissingKey`
the strategy, the fingerprint or reading   ``invalid_key``  what it raised (a broken strategy never
the message raises                                          stops the loop)
a body the strategy cannot decode          ``undecodable``  :class:`~dedupe_worker.UndecodableMessage`
(``field_key`` on a body that is not JSON)
the ttl header is not a positive number    ``undecodable``  :class:`~dedupe_worker.UndecodableMessage`
of seconds (see :mod:`.ttl`)                                naming the header and the value
=========================================  ===============  ==========================================

A refusal is the engine's verdict like any other (:func:`~dedupe_worker._engine.single.refused`,
reported to the observers): the integration dead-letters it as it would a conflict. A key that is
found but empty, too long or not text is refused one step later, by the claim, with the same
``invalid_key``.

What a message is read from is the integration's: an :class:`~dedupe_worker.Envelope` (RabbitMQ,
Kafka, FastStream, the replay), or the call (Celery's task arguments and request, Dramatiq's
actor, message and arguments). :class:`Identify` is given how to read it, and keeps the one
:class:`~.ttl.TtlHeader` reader of its consumer.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from hashlib import sha256
from typing import Any, Generic, NamedTuple, TypeVar

from .._protocol import content_hash
from .decision import Decision, poison
from .single import refused
from .ttl import TTL_HEADER, TtlHeader

__all__ = ["Identify", "Identity", "body_fingerprint", "bytes_fingerprint"]

M = TypeVar("M")


class Identity(NamedTuple):
    """What one message is claimed as: its key, its payload fingerprint (``None``: no conflict
    check) and the seconds its outcome is kept (``None``: the client's ``result_ttl``)."""

    key: str
    fingerprint: Any = None
    ttl: float | None = None


def body_fingerprint(envelope: Any) -> str:
    """Fingerprint of a message: the hash of its body bytes (``envelope.body``)."""
    return bytes_fingerprint(envelope.body)


def bytes_fingerprint(body: bytes) -> str:
    """:func:`body_fingerprint` of a message whose body is ``body`` (no envelope needed)."""
    if type(body) is bytes:  # content_hash() without its text check (once per consumed message)
        return sha256(body).hexdigest()[:32]
    return content_hash(body)


#: ``Identity(key, fingerprint, ttl)`` without the named tuple's ``__new__`` in Python (one a message).
_identity = functools.partial(tuple.__new__, Identity)


class Identify(Generic[M]):
    """How one consumer identifies its messages: ``identify(message)`` is the message's
    :class:`Identity`, or the refused :class:`~dedupe_worker.Decision` (see the module doc).

    :param integration: named in the observers' verdict counts; ``None`` (the replay, which
        decides nothing): a refusal is not reported.
    :param key: ``message -> key`` (a key strategy over an envelope, or the integration's own).
    :param fingerprint: ``message -> fingerprint``; ``None``: no conflict check.
    :param ttl_header: the header holding the message's ttl in seconds; ``None``: not read.
    :param headers: ``message -> headers`` the ttl header is read from; ``None``: its ``headers``.
    :param default_ttl: ``message -> ttl`` when the header is absent (a task's or actor's own
        option); ``None``: the client's ``result_ttl``.
    """

    __slots__ = ("_ttl", "default_ttl", "fingerprint", "headers", "integration", "key", "ttl_of")

    def __init__(self, integration: str | None, key: Callable[[M], str],
                 fingerprint: Callable[[M], Any] | None = None, *, ttl_header: str | None = TTL_HEADER,
                 headers: Callable[[M], Mapping[str, Any] | None] | None = None,
                 default_ttl: Callable[[M], float | None] | None = None) -> None:
        self.integration = integration
        self.key = key
        self.fingerprint = fingerprint
        #: The consumer's one reader of ``ttl_header`` (it remembers the other header names seen).
        self.ttl_of = TtlHeader(ttl_header) if ttl_header else None
        # called as its bound __call__: the interpreter runs a bound method in its own loop, an
        # instance through its type's call slot (once per message, docs/performance.md)
        self._ttl = None if self.ttl_of is None else self.ttl_of.__call__
        self.headers = headers
        self.default_ttl = default_ttl

    def __call__(self, message: Any, read: Callable[[Any], M] | None = None) -> Identity | Decision:
        """The :class:`Identity` of ``message``, read first by ``read`` when given (``from_kafka``:
        what reading raises is refused too), or its refusal (its ``error`` is what was raised).
        Never raises."""
        try:
            if read is not None:
                message = read(message)
            key = self.key(message)
            fingerprint = None if self.fingerprint is None else self.fingerprint(message)
            ttl_of, headers = self._ttl, self.headers
            ttl = None if ttl_of is None else ttl_of(message.headers if headers is None else headers(message))
            if ttl is None and self.default_ttl is not None:
                ttl = self.default_ttl(message)
        except Exception as exc:  # MissingKey, UndecodableMessage (a bad ttl too), a broken strategy
            return poison(exc) if self.integration is None else refused(exc, self.integration)
        return _identity((key, fingerprint, ttl))

    def many(self, messages: Sequence[Any], read: Callable[[Any], M] | None = None) -> Columns:
        """What :meth:`__call__` answers for each of ``messages`` (read first by ``read`` when
        given; a ``read`` with a ``many`` method reads them all at once by it, as ``map(read,
        messages)`` would), in columns: keys, fingerprints, ttls (``None`` for all: no message has a ttl), and
        the ``(position, refusal)`` of the refused (``None`` in their keys, fingerprints and ttls).

        Each step runs over the whole batch (``map``: no Python call of ours and no
        :class:`Identity` a message), the ttl header looked for in every message at once
        (:meth:`~.ttl.TtlHeader.many`). When a step raises, the batch is identified again message by
        message, so each refusal is that message's own: a key strategy or fingerprint may then be
        called twice for a message. Every consumed record of a batch consumer passes here
        (docs/performance.md, "Kafka duplicates, issue 37")."""
        count = len(messages)
        try:
            read_all = getattr(read, "many", None)
            readings = messages if read is None else read_all(messages) if read_all else list(map(read, messages))
            keys = list(map(self.key, readings))
            fingerprints = [None] * count if self.fingerprint is None else list(map(self.fingerprint, readings))
            ttls = None
            if self.ttl_of is not None:
                ttls = self.ttl_of.many(list(map(_headers_of if self.headers is None else self.headers, readings)))
            if self.default_ttl is not None:
                default = self.default_ttl
                ttls = [default(message) for message in readings] if ttls is None else [
                    default(message) if ttl is None else ttl for message, ttl in zip(readings, ttls, strict=True)]
        except Exception:  # one message's refusal: each is identified on its own
            return self._each(messages, read)
        return keys, fingerprints, ttls, []

    def _each(self, messages: Sequence[Any], read: Callable[[Any], M] | None) -> Columns:
        """:meth:`many`, message by message."""
        count = len(messages)
        keys: list[Any] = [None] * count
        fingerprints: list[Any] = [None] * count
        ttls: list[float | None] = [None] * count
        failures: list[tuple[int, Decision]] = []
        for n, message in enumerate(messages):
            found = self(message, read)
            if isinstance(found, Identity):
                keys[n], fingerprints[n], ttls[n] = found
            else:
                failures.append((n, found))
        return keys, fingerprints, ttls, failures


#: :meth:`Identify.many`'s answer: keys, fingerprints, ttls (``None``: none), ``(position, refusal)``.
Columns = tuple[list[Any], list[Any], "list[float | None] | None", list[tuple[int, Decision]]]

#: A message's headers, where its ``headers`` attribute holds them.
_headers_of = operator.attrgetter("headers")
