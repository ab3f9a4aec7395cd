"""Operating dedupe-worker: check a Redis (:mod:`.doctor`), look at keys (:mod:`.describe`), survey a
namespace (:mod:`.survey`). Used by the ``doctor``, ``inspect``, ``forget`` and ``stats`` commands."""

from __future__ import annotations

from .check import Check
from .describe import KeyReport, describe
from .doctor import DEFAULT_RATE, check_at_start, diagnose, warn_once
from .survey import Survey, survey

__all__ = ["DEFAULT_RATE", "Check", "KeyReport", "Survey", "check_at_start", "describe", "diagnose", "survey",
           "warn_once"]
