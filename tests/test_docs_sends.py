"""The code blocks of the docs about deduplicated sends run as written, against the real services
(host names and queue names replaced by the test's own)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from . import celery_fixtures
from .kafka_fixtures import kafka_topics

__all__ = ["kafka_topics"]

DOCS = Path(__file__).resolve().parent.parent / "docs"


def blocks(page: str, heading: str) -> list[str]:
    """The ``python`` code blocks of the section ``heading`` of ``docs/<page>``."""
    text = (DOCS / page).read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run(code: list[str], replace: dict[str, str]) -> dict[str, Any]:
    scope: dict[str, Any] = {"__name__": "docs"}
    for block in code:
        for old, new in replace.items():
            block = block.replace(old, new)
        exec(compile(block, "<docs>", "exec"), scope)  # the docs' own examples
    return scope


def test_celery_deduplicating_sends(rabbitmq_url: str, redis_url: str, namespace: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    code = blocks("celery.md", "## Deduplicating sends")
    assert len(code) == 3
    queue = f"docs-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("DEDUPE_NAMESPACE", namespace)
    scope = run(code, {"amqp://guest:guest@rabbitmq//": rabbitmq_url, "redis://redis:6379/0": redis_url,
                       '"shop"': f'"{queue}"'})
    app = scope["app"]
    try:
        with app.connection_for_write() as conn:  # the first send and the unchecked one
            assert conn.default_channel.queue_declare(queue, passive=True).message_count == 2
    finally:
        celery_fixtures.delete_queue(app, queue)
        celery_fixtures.delete_namespace(redis_url, namespace)
        app.close()


def test_producing_with_the_key(rabbitmq_url: str, redis_url: str, namespace: str, kafka_bootstrap: str,
                                kafka_topics: Any) -> None:
    queue = f"docs-{uuid.uuid4().hex[:10]}"
    topic = kafka_topics.create()
    replace = {"amqp://guest:guest@rabbitmq//": rabbitmq_url, "redis://redis:6379/0": redis_url,
               '"orders"': f'"{queue}"', "kafka:9092": kafka_bootstrap, '"shop"': f'"{namespace}"',
               '"payments"': f'"{topic}"'}
    scope = run(blocks("rabbitmq.md", "## Producing with the key"), replace)
    try:
        assert scope["sent"].published and not scope["again"].published
        scope = run(blocks("kafka.md", "## Producing with the key"), replace)
        assert scope["sent"].published and not scope["again"].published
        run(blocks("faststream.md", "## Producing with the key"), replace)  # it asserts itself
    finally:
        with redis.Redis.from_url(redis_url) as r:
            keys = list(r.scan_iter(f"{namespace}:*"))
            if keys:
                r.delete(*keys)
