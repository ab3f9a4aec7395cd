"""Compatibility path: the dedupe decision now lives in :mod:`dedupe_worker.engine`."""

from __future__ import annotations

from .engine.batch import decide_many
from .engine.decision import Action, Decision, Reason, outcome, poison, settle
from .engine.single import decide, execute

__all__ = ["Action", "Decision", "Reason", "decide", "decide_many", "execute", "outcome", "poison", "settle"]
