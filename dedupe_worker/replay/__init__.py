"""Dead-letter replay that never re-applies: move dead-lettered messages back to work.

:class:`Planner` (broker-neutral) decides per message from the key's state in Redis;
:func:`replay_rabbitmq` and :func:`replay_kafka` carry the plan out with publisher confirms /
delivery reports before anything is removed from the dead-letter queue. The broker modules import
their client libraries only when run. See ``docs/replay.md``.
"""

from __future__ import annotations

from ._kafka import replay_kafka
from ._plan import REPLAYED, Entry, Found, Pacer, Planner, Step, replay_headers
from ._rabbitmq import Destination, replay_rabbitmq
from ._summary import Progress, ReplayOptions, Summary, format_table

__all__ = [
    "REPLAYED",
    "Destination",
    "Entry",
    "Found",
    "Pacer",
    "Planner",
    "Progress",
    "ReplayOptions",
    "Step",
    "Summary",
    "format_table",
    "replay_headers",
    "replay_kafka",
    "replay_rabbitmq",
]
