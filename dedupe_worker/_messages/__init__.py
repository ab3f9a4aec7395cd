"""Messages as the engine sees them: the broker-neutral :class:`Envelope`, idempotency key
strategies and fingerprints (the public :mod:`dedupe_worker.keys`, which builds on the envelope), and
the dead-letter headers (:mod:`.deadletter`)."""

from __future__ import annotations

from .envelope import Envelope, from_kafka, from_kombu, original_position

__all__ = ["Envelope", "from_kafka", "from_kombu", "original_position"]
