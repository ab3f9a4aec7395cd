"""Compatibility path: ``current_claim`` lives in :mod:`dedupe_worker.engine.context`."""

from __future__ import annotations

from .engine.context import bind_claim, current_claim

__all__ = ["bind_claim", "current_claim"]
