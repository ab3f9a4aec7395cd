"""Compatibility path: key strategies and fingerprints live in :mod:`dedupe_worker.messages.keys`."""

from __future__ import annotations

from .messages.keys import *  # noqa: F403
from .messages.keys import __all__ as __all__
