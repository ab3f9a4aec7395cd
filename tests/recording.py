"""The record the framework tests' handlers keep in Redis: one ``kind:id:token`` entry per
handler start (``started``) and per applied effect (``applied``), in order."""

from __future__ import annotations

import pytest
import redis

__all__ = ["entries", "record"]


@pytest.fixture
def record(namespace: str) -> str:
    """The Redis list the handlers of one test append to."""
    return f"{namespace}:record"


def entries(client: redis.Redis, record: str, kind: str) -> list[tuple[str, int]]:
    """``(id, token)`` of every ``kind`` (``started``/``applied``) entry, in order."""
    out = []
    for raw in client.lrange(record, 0, -1):
        entry_kind, ident, token = raw.decode().split(":")
        if entry_kind == kind:
            out.append((ident, int(token)))
    return out
