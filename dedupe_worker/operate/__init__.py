"""Operating dedupe-worker: check a Redis (:mod:`.doctor`), look at keys (:mod:`.describe`), survey a
namespace (:mod:`.survey`). Used by the ``doctor``, ``inspect``, ``forget`` and ``stats`` commands."""

from __future__ import annotations

from .describe import KeyReport, describe
from .doctor import Check, diagnose, warn_once
from .survey import Survey, survey

__all__ = ["Check", "KeyReport", "Survey", "describe", "diagnose", "survey", "warn_once"]
