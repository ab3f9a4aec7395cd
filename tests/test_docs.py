"""Every fenced ``python`` block of every ``docs/*.md`` page runs, as a user would paste it.

A block that defines ``test_*`` functions is run by pytest (the package's plugin gives it the
``dedupe`` fixture); any other block is run by Python. A block that ends by starting a consumer
(``.run()``) must still be running, without a traceback, after a few seconds. The local addresses
the docs use (Redis 127.0.0.1:6379, RabbitMQ guest@127.0.0.1:5672, Kafka 127.0.0.1:9092) are
replaced by the test services'. A fragment that cannot run on its own is marked on the line
before its fence with ``<!-- docs-test: skip (why) -->``; keep those few.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from kombu import Connection

from dedupe_worker.rabbitmq import delay_queue, dlq

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
SKIP = "<!-- docs-test: skip"
#: Seconds a block that starts a consumer must keep running.
CONSUMER_SECONDS = 4.0


def blocks() -> Iterator[tuple[str, int, str]]:
    """``(page, line, code)`` of each runnable python block of ``docs/*.md``."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for found in FENCE.finditer(text):
            before = text[:found.start()].rstrip().splitlines()
            if before and before[-1].startswith(SKIP):
                continue
            yield page.name, text.count("\n", 0, found.start()) + 1, found.group(1)


BLOCKS = list(blocks())


def test_the_pages_have_runnable_blocks() -> None:
    pages = {page for page, _, _ in BLOCKS}
    assert {"asyncio.md", "celery.md", "kafka.md", "rabbitmq.md", "testing.md"} <= pages
    assert any("IdempotentTask" in code and "def test_" in code for page, _, code in BLOCKS if page == "testing.md")
    skipped = sum((ROOT / "docs" / page).read_text().count(SKIP) for page in {p for p, _, _ in BLOCKS})
    assert skipped <= 3, "keep the fragments that are not run few"


def localize(code: str, request: pytest.FixtureRequest) -> str:
    """The block with the docs' local addresses replaced by the test services'."""
    if "127.0.0.1:6379" in code:
        code = code.replace("127.0.0.1:6379", urlsplit(request.getfixturevalue("redis_url")).netloc)
    if "guest:guest@127.0.0.1:5672" in code:
        code = code.replace("guest:guest@127.0.0.1:5672", urlsplit(request.getfixturevalue("rabbitmq_url")).netloc)
    if "127.0.0.1:9092" in code:
        code = code.replace("127.0.0.1:9092", request.getfixturevalue("kafka_bootstrap"))
    return code


def env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p)}


def queues_declared(code: str) -> list[str]:
    """Queues a block declares by name (``Queue("orders")``): removed after the run."""
    return re.findall(r'Queue\("([^"]+)"\)', code)


@pytest.mark.parametrize(("page", "line", "code"), BLOCKS, ids=[f"{p}:{n}" for p, n, _ in BLOCKS])
def test_docs_block_runs(page: str, line: int, code: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    code = localize(code, request)
    if re.search(r"^def test_", code, re.MULTILINE):
        script = tmp_path / f"test_{Path(page).stem}_{line}.py"
        script.write_text(code)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)],
                              cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{page}:{line}\n{done.stdout}\n{done.stderr}"
        return
    script = tmp_path / "block.py"
    script.write_text(code)
    consumer = code.rstrip().endswith(".run()")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + (CONSUMER_SECONDS if consumer else 60)
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        running = proc.poll() is None
        if running:
            proc.terminate()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        if "Queue(" in code:
            with Connection(request.getfixturevalue("rabbitmq_url")) as conn:
                channel = conn.channel()
                for name in queues_declared(code):
                    for queue in (name, delay_queue(name), dlq(name)):
                        channel.queue_delete(queue=queue)
    assert "Traceback" not in err, f"{page}:{line}\n{err}"
    if consumer:
        assert running, f"{page}:{line}: the consumer stopped by itself\n{out}\n{err}"
    else:
        assert not running and proc.returncode == 0, f"{page}:{line}\n{out}\n{err}"
