"""Real HTTP servers for the Idempotency-Key tests: each test app under its own server with two
worker processes, on a free loopback port, stopped (process group and all) when done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from . import services

ROOT = Path(__file__).resolve().parent.parent

#: name: the command serving ``{app}`` on ``{port}`` with two workers.
SERVERS = {
    "fastapi-uvicorn": [sys.executable, "-m", "uvicorn", "tests.http_apps.asgi_app:app", "--host", "127.0.0.1",
                        "--port", "{port}", "--workers", "2", "--log-level", "warning"],
    "flask-gunicorn": [sys.executable, "-m", "gunicorn", "tests.http_apps.flask_app:app", "-b", "127.0.0.1:{port}",
                       "-w", "2", "-k", "gthread", "--threads", "16", "--log-level", "warning"],
    "django-gunicorn": [sys.executable, "-m", "gunicorn", "tests.http_apps.django_app:application",
                        "-b", "127.0.0.1:{port}", "-w", "2", "-k", "gthread", "--threads", "16",
                        "--log-level", "warning"],
}


#: The server process of each base URL that :func:`serve` yielded (for tests that watch its memory).
PIDS: dict[str, int] = {}


@contextmanager
def serve(name: str, redis_url: str, namespace: str, timeout: float = 60.0) -> Iterator[str]:
    """Start server ``name`` on the test apps; yield its base URL once ``/health`` answers."""
    port = services.free_port()
    env = {**os.environ, "HTTP_TEST_REDIS_URL": redis_url, "HTTP_TEST_NAMESPACE": namespace,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([part.format(port=port) for part in SERVERS[name]], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"{name} did not start:\n{log.read().decode(errors='replace')[-3000:]}")
                try:
                    if httpx.get(base + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            PIDS[base] = proc.pid
            yield base
        finally:
            PIDS.pop(base, None)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
