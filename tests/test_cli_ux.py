"""The command line as a new user meets it: the real ``dedupe-worker`` script in subprocesses
(handler modules from the current directory, ``-v`` on either side of the subcommand, one-line
errors for an unreachable or evicting Redis) and ``forget --dry-run``, ``inspect``'s hint and the
consumers' start-up projection against real Redis and RabbitMQ."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection

from dedupe_worker import Deduplicator
from dedupe_worker._operate import check_at_start
from dedupe_worker.cli import build_parser
from dedupe_worker.rabbitmq import delay_queue, dlq

from . import services
from .rabbitmq_fixtures import publish

ROOT = Path(__file__).resolve().parent.parent


def script() -> str:
    """The installed console script (its ``sys.path[0]`` is its bin directory, not the caller's)."""
    found = Path(sys.executable).with_name("dedupe-worker")
    if not found.exists():
        pytest.fail("the dedupe-worker console script is not installed next to this Python")
    return str(found)


def env() -> dict[str, str]:
    """The test's environment with this checkout importable (as the tests import it)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p)}


def cli(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([script(), *args], capture_output=True, text=True, cwd=cwd, env=env(), timeout=timeout)


def test_v_counts_before_and_after_the_subcommand() -> None:
    parser = build_parser()
    assert parser.parse_args(["-v", "doctor"]).verbose == 1
    after = parser.parse_args(["doctor", "-vv"])
    assert after.verbose == 0 and after.more_verbose == 2
    both = parser.parse_args(["-v", "rabbitmq", "m:f", "--queue", "q", "-v"])
    assert both.verbose + both.more_verbose == 2


@pytest.fixture
def queue(rabbitmq_url: str) -> Iterator[str]:
    name = f"cli-{uuid.uuid4().hex[:10]}"
    yield name
    with Connection(rabbitmq_url) as conn:
        channel = conn.channel()
        for queue_name in (name, delay_queue(name), dlq(name)):
            channel.queue_delete(queue=queue_name)


def test_rabbitmq_imports_the_handler_from_the_current_directory(tmp_path: Path, queue: str, rabbitmq_url: str,
                                                                 redis_url: str, namespace: str) -> None:
    applied = tmp_path / "applied.txt"
    (tmp_path / "myhandlers.py").write_text(textwrap.dedent(f"""
        def apply(body, message):
            with open({str(applied)!r}, "a") as f:
                f.write(str(body["order"]) + "\\n")
    """))
    with Connection(rabbitmq_url) as conn:
        conn.default_channel.queue_declare(queue=queue, durable=True, auto_delete=False)
        publish(conn, queue, '{"order": 7}', message_id="m-7")
    proc = subprocess.Popen([script(), "rabbitmq", "myhandlers:apply", "--url", rabbitmq_url, "--queue", queue,
                             "--redis-url", redis_url, "--namespace", namespace, "-v"],
                            cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not applied.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "No module named" not in err
    assert applied.read_text() == "7\n"
    assert f"consuming {queue}" in err  # -v after the subcommand turned INFO on


@pytest.mark.parametrize("command", [["doctor"], ["inspect", "k"], ["stats"], ["forget", "k"],
                                     ["forget", "--dry-run", "k"]])
def test_unreachable_redis_is_one_line_and_exit_2(command: list[str]) -> None:
    url = f"redis://127.0.0.1:{services.free_port()}/0"
    done = cli(*command, "--redis-url", url)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith(f"dedupe-worker {command[0]}: cannot reach Redis")


def test_a_consumer_refuses_an_evicting_redis_in_one_line(tmp_path: Path, rabbitmq_url: str, queue: str) -> None:
    if shutil.which("redis-server") is None:
        services.unavailable("redis-server binary")
    server = services.RedisServer(extra=("--maxmemory-policy", "allkeys-lru")).start()
    try:
        (tmp_path / "h.py").write_text("def apply(body, message):\n    pass\n")
        done = cli("rabbitmq", "h:apply", "--url", rabbitmq_url, "--queue", queue, "--redis-url", server.url,
                   cwd=tmp_path)
    finally:
        server.stop()
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "refusing to start" in done.stderr and "allkeys-lru" in done.stderr and "--allow-eviction" in done.stderr


def test_forget_dry_run_says_what_the_real_run_would(dedupe: Deduplicator, capsys: pytest.CaptureFixture[str],
                                                     redis_url: str, namespace: str) -> None:
    from dedupe_worker.cli import main

    dedupe.run("done", lambda: 1)
    held = dedupe.begin("held")
    common = ["--redis-url", redis_url, "--namespace", namespace]
    assert main(["forget", "--dry-run", "missing", "done", "held", *common]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "missing: nothing to remove"
    assert out[1].startswith("done: would be removed")
    assert out[2].startswith("held: would be refused: a live lease") and "--force" in out[2]
    main(["forget", "--dry-run", "--if-token", str(held.token + 1), "held", *common])
    assert f"would be refused: it carries token {held.token}" in capsys.readouterr().out
    main(["forget", "missing", *common])  # the real run agrees
    assert capsys.readouterr().out == "missing: nothing to remove\n"


def test_inspect_hints_at_an_empty_namespace(dedupe: Deduplicator, capsys: pytest.CaptureFixture[str],
                                             redis_url: str, namespace: str) -> None:
    from dedupe_worker.cli import main

    main(["inspect", "k", "--redis-url", redis_url, "--namespace", f"{namespace}-typo"])
    captured = capsys.readouterr()
    assert "free, token 0" in captured.out
    assert "holds no keys at all" in captured.err and "--namespace" in captured.err
    dedupe.run("other", lambda: 1)
    main(["inspect", "k", "--redis-url", redis_url, "--namespace", namespace])
    assert "hint" not in capsys.readouterr().err  # the namespace has keys: k is merely new


def test_start_up_projection_uses_doctors_default_rate(private_redis: services.RedisServer,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    d = Deduplicator(redis.Redis(port=private_redis.port), namespace="p", result_ttl=3600)
    with caplog.at_level(logging.WARNING, logger="dedupe_worker._operate.doctor"):
        check_at_start(d)
    memory = next(r.getMessage() for r in caplog.records if "check memory" in r.getMessage())
    assert "(100 msg/s x 3600 s" in memory and "projection 0 bytes" not in memory
