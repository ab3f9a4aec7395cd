"""The pytest plugin of dedupe-worker (registered through the ``pytest11`` entry point).

Fixture ``dedupe``: a fresh :func:`~dedupe_worker.testing.in_memory` deduplicator for each test
(lease 30 s, namespace ``test``), closed afterwards. A ``dedupe`` fixture of your own conftest
takes precedence. Nothing is imported from fakeredis until a test asks for the fixture.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._deduplicator import Deduplicator

__all__ = ["dedupe"]


@pytest.fixture
def dedupe() -> Iterator[Deduplicator]:
    """A :class:`Deduplicator` on an in-memory store of this test's own."""
    from .testing import in_memory

    d = in_memory()
    yield d
    d.close()
