"""Handlers for the consumer processes of ``test_crash_windows.py``: each does its work (a sleep of
``$TEST_WORK`` seconds), then records its effect, as real handlers do.

Every run appends ``started:<id>:<pid>`` before the work and ``applied:<id>:<pid>:<token>`` after it
to the Redis list ``$TEST_EFFECTS`` at ``$TEST_REDIS_URL``; an ``applied`` entry is the effect.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from dedupe_worker import current_claim

_clients: dict[str, redis.Redis] = {}


def _effect(ident: str) -> str:
    url = os.environ["TEST_REDIS_URL"]
    client = _clients.setdefault(url, redis.Redis.from_url(url))
    effects = os.environ["TEST_EFFECTS"]
    client.rpush(effects, f"started:{ident}:{os.getpid()}")
    time.sleep(float(os.environ.get("TEST_WORK", "0")))
    claim = current_claim()
    client.rpush(effects, f"applied:{ident}:{os.getpid()}:{claim.token if claim else 0}")
    return ident


def rabbit_effect(body: Any, message: Any) -> str:
    return _effect(body["id"])


def kafka_effect(message: Any) -> str:
    return _effect((message.value() or b"").decode())
