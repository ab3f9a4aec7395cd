"""Helpers for the replay tests: dead-letter queues and topics filled directly with the headers the
consumers write, outcomes stored through a real :class:`Deduplicator`, snapshots of Redis, and
running the ``dedupe-worker replay`` CLI in-process or as a subprocess."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from dedupe_worker import Deduplicator, Envelope
from dedupe_worker.cli import main
from dedupe_worker.keys import body_fingerprint

__all__ = [
    "apply_before",
    "body_of",
    "cli",
    "killed_on_exit",
    "redis_snapshot",
    "replay_process",
    "unique",
]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def body_of(i: int) -> bytes:
    return json.dumps({"id": f"k{i}", "amount": i}).encode()


def apply_before(dedupe: Deduplicator, key: str, body: bytes, *, fail: bool = False) -> None:
    """Store an outcome for ``key`` the way a consumer would have: begin (with the consumer's body
    fingerprint), then complete, or ``fail`` for a stored permanent failure."""
    claim = dedupe.begin(key, fingerprint=body_fingerprint(Envelope(body=body)))
    assert claim.acquired, claim
    if fail:
        dedupe.fail(claim, ValueError("bad order"))
    else:
        dedupe.complete(claim, {"applied": key})


def redis_snapshot(client: redis.Redis, namespace: str) -> dict[bytes, Any]:
    """Every key of ``namespace`` with its type and contents (TTLs left out: they tick)."""
    out: dict[bytes, Any] = {}
    for name in client.scan_iter(match=f"{namespace}:*", count=1000):
        kind = client.type(name)
        out[name] = (kind, client.hgetall(name) if kind == b"hash" else client.dump(name))
    return out


def cli(args: Sequence[str]) -> tuple[int, str]:
    """Run ``dedupe-worker <args>`` in this process; return the exit status and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(list(args))
    return status, out.getvalue()


def replay_process(args: Sequence[str]) -> subprocess.Popen[bytes]:
    """``python -m dedupe_worker <args>`` as a child process (stdout/stderr to pipes)."""
    return subprocess.Popen([sys.executable, "-m", "dedupe_worker", *args], env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@contextlib.contextmanager
def killed_on_exit(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
