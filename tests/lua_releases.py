"""The script calls of this release and of earlier ones, built without a Redis client: shared by
the rolling-upgrade tests (``tests/test_lua_compat.py``) and ``bench.lua_cost``."""

from __future__ import annotations

from types import SimpleNamespace

from dedupe_worker._protocol.calls import StoreCalls
from dedupe_worker._protocol.layout import KeyLayout

__all__ = ["EarlierCalls", "StandaloneCalls"]


class StandaloneCalls(StoreCalls):
    """The calls ``RedisStore`` sends for a standalone server (one call per batch)."""

    scripts = SimpleNamespace(is_cluster=False)


class EarlierCalls(StandaloneCalls):
    """The calls of the releases before record format 2: their scripts take the started and
    result keys, not the stem (the KEYS those releases' stores send)."""

    @staticmethod
    def claim_keys(stem: str) -> tuple[str, ...]:
        return KeyLayout.started(stem), KeyLayout.result(stem)

    @staticmethod
    def complete_keys(stem: str) -> tuple[str, ...]:
        return KeyLayout.started(stem), KeyLayout.result(stem), KeyLayout.notice(stem)
