"""A ``redis_client`` fixture that runs a test module twice: on real Redis, and on the
:func:`~dedupe_worker.testing.in_memory` test double users get. Import it into a test module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from dedupe_worker.testing import in_memory

__all__ = ["redis_or_double"]


@pytest.fixture(name="redis_client", params=["redis", "in_memory"])
def redis_or_double(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Any]:
    """Every test here runs twice: on real Redis, and on the in_memory() test double users get."""
    if request.param == "in_memory":
        double = in_memory()
        yield double.store.client
        double.close()
        return
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
