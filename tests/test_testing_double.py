"""The test double users get: ``in_memory()``, the pytest plugin's ``dedupe`` fixture, and the way
the docs tell Celery and consumer users to test with it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from dedupe_worker import Outcome, decide_many
from dedupe_worker.testing import in_memory, in_memory_async


def test_each_in_memory_store_is_its_own() -> None:
    a, b = in_memory(), in_memory()
    assert a.begin("k").outcome is Outcome.ACQUIRED
    assert b.begin("k").outcome is Outcome.ACQUIRED  # nothing shared
    assert a.begin("k").outcome is Outcome.IN_PROGRESS


def test_the_async_double_runs_the_same_protocol() -> None:
    async def scenario() -> None:
        a, b = in_memory_async(lease=5), in_memory_async()
        calls: list[int] = []

        async def charge() -> str:
            calls.append(1)
            return "charged"

        assert await a.run("k", charge) == "charged" and await a.run("k", charge) == "charged"
        assert calls == [1]
        assert (await b.begin("k")).outcome is Outcome.ACQUIRED  # nothing shared
        held = await a.begin("held", fingerprint="p")
        assert (await a.begin("held", fingerprint="q")).outcome is Outcome.CONFLICT
        asyncio.get_running_loop().call_later(0.1, lambda: asyncio.ensure_future(a.complete(held, 1)))
        assert (await a.begin("held", fingerprint="p", wait=5)).result == 1  # woken by the completion
        await a.aclose()
        await b.aclose()

    asyncio.run(scenario())


def test_the_pytest_plugin_gives_a_dedupe_fixture(tmp_path: Path) -> None:
    assert any(ep.value == "dedupe_worker._pytest_plugin"
               for ep in metadata.distribution("dedupe-worker").entry_points if ep.group == "pytest11")
    test = tmp_path / "test_user.py"
    test.write_text(textwrap.dedent("""
        def test_runs_once(dedupe):
            calls = []
            assert dedupe.run("k", lambda: calls.append(1) or "v") == "v"
            assert dedupe.run("k", lambda: calls.append(1) or "x") == "v"
            assert calls == [1]
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:dedupe_worker",
                           "-p", "dedupe_worker._pytest_plugin", str(test)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_a_consumer_handler_is_tested_through_the_engine_the_consumers_use() -> None:
    dedupe = in_memory()
    charged: list[int] = []
    batch = [(f"order-{n}", None, (lambda n=n: charged.append(n))) for n in (1, 2, 1)]  # a redelivered copy
    assert [d.reason.value for d in decide_many(dedupe, batch)] == ["applied", "applied", "duplicate"]
    assert charged == [1, 2]


def test_without_the_extra_in_memory_names_it() -> None:
    code = "import sys; sys.modules['fakeredis'] = None\nfrom dedupe_worker.testing import in_memory\n" \
           "try:\n    in_memory()\nexcept ImportError as exc:\n    print(exc)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "pip install 'dedupe-worker[testing]'" in out


@pytest.fixture
def celery_app() -> Any:
    from celery import Celery

    app = Celery("docs-example", set_as_current=False)
    app.conf.task_always_eager = True
    yield app
    app.close()


def test_an_eager_celery_task_is_tested_with_the_double(celery_app: Any) -> None:
    from dedupe_worker.celery import IdempotentTask

    runs: list[int] = []

    @celery_app.task(base=IdempotentTask, idempotency_key=lambda order_id: f"charge:{order_id}")
    def charge(order_id: int) -> int:
        runs.append(order_id)
        return order_id * 10

    charge.deduplicator = in_memory()  # instead of the Redis of the settings
    assert charge.delay(7).get() == charge.delay(7).get() == 70
    assert runs == [7]
