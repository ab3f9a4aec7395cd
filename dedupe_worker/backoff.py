"""Backoff with full jitter, shared by every integration's deferrals and retries."""

from __future__ import annotations

import random

__all__ = ["backoff"]


def backoff(attempt: int, *, base: float = 0.5, cap: float = 60.0, floor: float = 0.0) -> float:
    """Seconds to wait before attempt ``attempt`` (1-based): ``floor`` plus a random value in
    ``[0, min(cap, base * 2 ** (attempt - 1))]`` ("full jitter").

    ``floor`` is a least wait added in front (0 by default).
    """
    ceiling = min(cap, base * (2 ** max(0, attempt - 1)))
    return floor + random.uniform(0.0, ceiling)
