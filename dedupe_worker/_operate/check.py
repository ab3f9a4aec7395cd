"""One topic of ``dedupe-worker doctor``, on Redis (:mod:`.doctor`) or on a SQL store (:mod:`.sqldoctor`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Check"]


@dataclass(frozen=True)
class Check:
    """One topic: ``ok`` (nothing breaks), ``warn`` (a guarantee is weaker), what was seen and what to do."""

    name: str
    ok: bool
    detail: str
    advice: str = ""
    warn: bool = False

    @property
    def mark(self) -> str:
        return "FAIL" if not self.ok else ("WARN" if self.warn else "ok")
