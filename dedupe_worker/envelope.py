"""Compatibility path: the envelope lives in :mod:`dedupe_worker.messages.envelope`."""

from __future__ import annotations

from .messages.envelope import Envelope, from_kafka, from_kombu, original_position

__all__ = ["Envelope", "from_kafka", "from_kombu", "original_position"]
