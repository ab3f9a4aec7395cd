"""Every fenced ``python`` block of every ``docs/*.md`` page and of README.md runs, as a user would
paste it.

A block that defines ``test_*`` functions is run by pytest (the package's plugin gives it the
``dedupe`` fixture); any other block is run by Python. A block that ends by starting a consumer
(``.run()``) must still be running, without a traceback, after a few seconds.

Markers, on the line before a fence:

- ``<!-- docs-test: continues -->``: the block goes on from the block before it on the page (which
  this file runs): they run as one program, as a reader following the page would paste them;
- ``<!-- docs-test: run by tests/test_x.py (name) -->``: a test of its own runs the block and asserts
  on more than "it runs" (a server it starts, Django settings); that file must exist and name the
  block (``"name"``). Not run here, and not counted as skipped;
- ``<!-- docs-test: skip (why) -->``: a fragment that cannot run on its own; keep those few.

Every address the docs use (Redis, RabbitMQ, Kafka, PostgreSQL, MariaDB, whether written
``127.0.0.1``, ``localhost`` or a compose service name) is replaced by the test services', a
PostgreSQL DSN by one whose ``search_path`` is a schema of the test's own, and the namespace
(``namespace="..."``, ``DEDUPE_NAMESPACE``) by the test's own. Nothing else is added: a program
defines everything it uses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit

import psycopg
import pytest
import redis
from kombu import Connection

from dedupe_worker.rabbitmq import delay_queue, dlq

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
SKIP = "<!-- docs-test: skip"
CONTINUES = "<!-- docs-test: continues -->"
RUN_BY = re.compile(r"<!-- docs-test: run by (tests/test_\w+\.py) \(([\w-]+)\) -->")
#: Seconds a block that starts a consumer must keep running.
CONSUMER_SECONDS = 4.0


@dataclass
class Program:
    """Blocks of one page run as one program (one block, or a block and those that continue it)."""

    page: str
    lines: list[int]
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{'+'.join(map(str, self.lines))}"


@dataclass
class Page:
    programs: list[Program] = field(default_factory=list)
    #: ``(line, test file, name)`` of each block a test of its own runs.
    elsewhere: list[tuple[int, str, str]] = field(default_factory=list)
    skipped: int = 0


def marker(text: str, start: int) -> str:
    """The last non-blank line before the fence at ``start``."""
    before = text[:start].rstrip().splitlines()
    return before[-1].strip() if before else ""


def read_page(path: Path) -> Page:
    text, page = path.read_text(), Page()
    previous_runs_here = False
    for found in FENCE.finditer(text):
        mark, line = marker(text, found.start()), text.count("\n", 0, found.start()) + 1
        if mark.startswith(SKIP):
            page.skipped += 1
            previous_runs_here = False
        elif by := RUN_BY.fullmatch(mark):
            page.elsewhere.append((line, by.group(1), by.group(2)))
            previous_runs_here = False
        elif mark == CONTINUES:
            assert previous_runs_here, f"{path.name}:{line} continues a block that this test does not run"
            program = page.programs[-1]
            program.lines.append(line)
            program.code += "\n" + found.group(1)
        else:
            page.programs.append(Program(path.name, [line], found.group(1)))
            previous_runs_here = True
    return page


PAGES = {path.name: read_page(path) for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
PROGRAMS = [program for page in PAGES.values() for program in page.programs]


def test_the_pages_have_runnable_blocks() -> None:
    pages = {program.page for program in PROGRAMS}
    assert {"asyncio.md", "celery.md", "kafka.md", "rabbitmq.md", "sql.md", "testing.md"} <= pages
    assert any("IdempotentTask" in p.code and "def test_" in p.code for p in PROGRAMS if p.page == "testing.md")
    assert sum(page.skipped for page in PAGES.values()) <= 3, "keep the fragments that are not run few"


def test_the_readme_example_runs_here() -> None:
    """The README's first ``python`` block is its example: run by this file as pasted, not skipped
    and not left to another test."""
    readme = (ROOT / "README.md").read_text()
    first = FENCE.search(readme)
    assert first is not None, "the README shows an example"
    assert PAGES["README.md"].programs[0].lines[0] == readme.count("\n", 0, first.start()) + 1
    assert "in_memory()" in first.group(1) or "localhost" in first.group(1)


def test_blocks_run_elsewhere_are_named_by_their_test() -> None:
    """A block marked ``run by tests/test_x.py (name)`` is not run here: that file must exist and
    name the page and the block, so no block goes untested silently."""
    names: dict[str, set[str]] = {}
    for name, page in PAGES.items():
        for line, test_file, block in page.elsewhere:
            path = ROOT / test_file
            assert path.is_file(), f"{name}:{line}: {test_file} does not exist"
            source = path.read_text()
            assert name in source and f'"{block}"' in source, f"{name}:{line}: {test_file} does not run {block!r}"
            assert block not in names.setdefault(name, set()), f"{name}:{line}: {block!r} named twice"
            names[name].add(block)


def localize(code: str, request: pytest.FixtureRequest, namespace: str) -> str:
    """The program with the docs' addresses and namespace replaced by the test's."""
    def netloc(fixture: str) -> str:
        return urlsplit(request.getfixturevalue(fixture)).netloc

    code = re.sub(r'namespace="[^"]*"', f'namespace="{namespace}"', code)
    if re.search(r"redis://(127\.0\.0\.1|localhost|redis)\b", code):
        code = re.sub(r"redis://(127\.0\.0\.1|localhost|redis)(:6379)?", f"redis://{netloc('redis_url')}", code)
    if re.search(r"amqp://guest:guest@(127\.0\.0\.1|localhost|rabbitmq)\b", code):
        code = re.sub(r"amqp://guest:guest@(127\.0\.0\.1|localhost|rabbitmq)(:5672)?",
                      f"amqp://{netloc('rabbitmq_url')}", code)
    if re.search(r"\b(127\.0\.0\.1|localhost|kafka):9092", code):
        code = re.sub(r"\b(127\.0\.0\.1|localhost|kafka):9092", request.getfixturevalue("kafka_bootstrap"), code)
    if "postgresql://" in code:
        dsn = request.getfixturevalue("docs_schema")
        code = re.sub(r"postgresql://[^\"'\s]+", dsn, code)
    if "mysql+pymysql://" in code:
        url = request.getfixturevalue("mysql_url").replace("mysql://", "mysql+pymysql://", 1)
        code = re.sub(r"mysql\+pymysql://[^\"'\s]+", url, code)
    return code


@pytest.fixture
def docs_schema(postgres_dsn: str) -> Iterator[str]:
    """A DSN of the test PostgreSQL whose ``search_path`` is a fresh schema (dropped after)."""
    schema = f"docs_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    separator = "&" if "?" in postgres_dsn else "?"
    yield f"{postgres_dsn}{separator}options={quote(f'-csearch_path={schema}')}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def env(namespace: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p),
            "DEDUPE_NAMESPACE": namespace}


def queues_declared(code: str) -> list[str]:
    """Queues a program declares by name (``Queue("orders")``, a Celery app's
    ``task_default_queue``): removed after the run."""
    return re.findall(r'Queue\("([^"]+)"\)', code) + re.findall(r'task_default_queue = "([^"]+)"', code)


def clean_up(code: str, namespace: str, request: pytest.FixtureRequest) -> None:
    """Delete the queues and the Redis keys the program made."""
    if queues_declared(code):
        with Connection(request.getfixturevalue("rabbitmq_url")) as conn:
            channel = conn.channel()
            for name in queues_declared(code):
                for queue in (name, delay_queue(name), dlq(name)):
                    channel.queue_delete(queue=queue)
    if "redis://" in code:
        with redis.Redis.from_url(request.getfixturevalue("redis_url")) as r:
            keys = list(r.scan_iter(f"{namespace}:*"))
            if keys:
                r.delete(*keys)


@pytest.mark.parametrize("program", PROGRAMS, ids=[program.id for program in PROGRAMS])
def test_docs_block_runs(program: Program, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    namespace = f"docs-{uuid.uuid4().hex[:10]}"
    code = localize(program.code, request, namespace)
    try:
        run(program, code, tmp_path, namespace)
    finally:
        clean_up(code, namespace, request)


def run(program: Program, code: str, tmp_path: Path, namespace: str) -> None:
    if re.search(r"^def test_", code, re.MULTILINE):
        script = tmp_path / f"test_{Path(program.page).stem}_{program.lines[0]}.py"
        script.write_text(code)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)],
                              cwd=tmp_path, env=env(namespace), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{program.id}\n{done.stdout}\n{done.stderr}"
        return
    script = tmp_path / "block.py"
    script.write_text(code)
    consumer = code.rstrip().endswith(".run()")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env(namespace),
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
    assert "Traceback" not in err, f"{program.id}\n{err}"
    if consumer:
        assert running, f"{program.id}: the consumer stopped by itself\n{out}\n{err}"
    else:
        assert not running and proc.returncode == 0, f"{program.id}\n{out}\n{err}"


def test_the_readme_is_a_front_door_whose_two_commands_do_the_set_up() -> None:
    """At most 250 lines; its set-up is ``make demo`` and ``make test``, each of which installs
    everything first (the Makefile's install stamp); every file it links exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    commands = re.search(r"## Two commands\n.*?```bash\n(.*?)```", readme, re.S)
    assert commands is not None
    assert [line.split("#")[0].strip() for line in commands.group(1).splitlines()] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}: \$\(STAMP\)$", makefile, re.M), target
    assert re.search(r"^\$\(STAMP\):.*\n(\t.*\n)*\t.*pip install .*-e \"\.\[\$\(EXTRAS\)", makefile, re.M)
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target
