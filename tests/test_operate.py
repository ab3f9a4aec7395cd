"""Operating it: ``inspect``, ``forget`` (with its refusals), ``stats`` and ``doctor`` against seeded keys
and against private Redis servers configured well and badly."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from dedupe_worker import Deduplicator, State
from dedupe_worker._operate import diagnose
from dedupe_worker.cli import main

from . import services


@pytest.fixture(params=[1, 2], ids=["format1", "format2"])
def seeded(dedupe: Deduplicator, request: pytest.FixtureRequest) -> Deduplicator:
    dedupe.store.write_format(request.param)  # inspect, stats and forget read results in both formats
    dedupe.run("done", lambda: {"charged": 100})
    dedupe.begin("held")
    failed = dedupe.begin("failed")
    dedupe.fail(failed, ValueError("card declined"))
    dedupe.run("k" * 300, lambda: "hashed")  # stored under its sha256
    return dedupe


def cli(capsys: pytest.CaptureFixture[str], redis_url: str, namespace: str, *args: str) -> tuple[int, str]:
    code = main([args[0], "--redis-url", redis_url, "--namespace", namespace, *args[1:]])
    return code, capsys.readouterr().out


def test_inspect_reports_every_state(seeded: Deduplicator, capsys: pytest.CaptureFixture[str], redis_url: str,
                                     namespace: str) -> None:
    code, out = cli(capsys, redis_url, namespace, "inspect", "--json", "done", "held", "failed", "k" * 300, "free")
    reports = {r["key"]: r for r in map(json.loads, out.splitlines())}
    assert code == 0
    assert reports["done"]["state"] == "done" and '"charged":100' in reports["done"]["result_preview"]
    assert reports["done"]["started_ttl_ms"] == -2 and 0 < reports["done"]["result_ttl_ms"] <= 60_000
    assert reports["held"]["state"] == "in_progress" and 0 < reports["held"]["remaining_lease_ms"] <= 5000
    assert reports["failed"]["state"] == "failed" and "card declined" in reports["failed"]["result_preview"]
    assert reports["k" * 300]["original_key"] == "k" * 300 and "sha256:" in reports["k" * 300]["redis_key"]
    assert reports["free"]["state"] == "free" and reports["free"]["token"] == 0
    code, text = cli(capsys, redis_url, namespace, "inspect", "held")
    assert "in_progress" in text and "lease runs" in text


def test_forget_removes_refuses_and_dry_runs(seeded: Deduplicator, capsys: pytest.CaptureFixture[str],
                                            redis_url: str, namespace: str) -> None:
    held = seeded.status("held")
    code, out = cli(capsys, redis_url, namespace, "forget", "--dry-run", "done", "held")
    assert code == 0 and "would be removed" in out and "only with --force" in out
    assert seeded.status("done").state is State.DONE  # the dry run changed nothing
    code, out = cli(capsys, redis_url, namespace, "forget", "done", "held")
    assert code == 1 and "done: removed" in out and "held: refused: a live lease" in out
    assert seeded.status("held").state is State.IN_PROGRESS
    code, out = cli(capsys, redis_url, namespace, "forget", "--if-token", "1", "held", "--force")
    assert code == 1 and "refused: it carries token" in out
    code, out = cli(capsys, redis_url, namespace, "forget", "--if-token", str(held.token), "held")
    assert code == 0 and "held: removed" in out
    assert seeded.status("held").state is State.FREE
    assert seeded.begin("done").acquired  # a forgotten key is new work again ...
    assert seeded.begin("held").token > held.token  # ... and tokens still only grow


def test_forget_in_python(dedupe: Deduplicator) -> None:
    claim = dedupe.begin("k")
    assert not dedupe.forget("k")  # a live lease, not forced
    assert not dedupe.forget("k", token=claim.token - 1)
    assert dedupe.forget("k", token=claim.token)
    assert not dedupe.forget("k")  # nothing left
    dedupe.begin("k2")
    assert dedupe.forget("k2", force=True)


def test_stats_counts_by_state_and_projects_memory(seeded: Deduplicator, capsys: pytest.CaptureFixture[str],
                                                   redis_url: str, namespace: str) -> None:
    code, out = cli(capsys, redis_url, namespace, "stats", "--json", "--rate", "50", "--result-ttl", "60")
    report = json.loads(out)
    assert code == 0 and report["keys"] == 4
    assert report["states"] == {"done": 2, "in_progress": 1, "failed": 1}
    assert report["bytes_per_key"] > 0
    assert report["projection_bytes"] == int(50 * seeded.result_ttl * report["bytes_per_key"])


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[services.RedisServer]:
    if shutil.which("redis-server") is None:
        services.unavailable("redis-server binary")
    s = services.RedisServer(extra=tuple(request.param)).start()
    yield s
    s.stop()


def marks(checks: list[Any]) -> dict[str, str]:
    return {c.name: c.mark for c in checks}


@pytest.mark.parametrize("server", [("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")], indirect=True)
def test_doctor_fails_an_evicting_redis_without_persistence(server: services.RedisServer,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    checks = marks(diagnose(redis.Redis(port=server.port)))
    assert checks["eviction"] == "FAIL" and checks["persistence"] == "FAIL"
    code = main(["doctor", "--redis-url", server.url])
    out = capsys.readouterr().out
    assert code == 1 and "allkeys-lru" in out and "maxmemory-policy noeviction" in out


@pytest.mark.parametrize("server", [("--maxmemory-policy", "noeviction", "--appendonly", "yes",
                                     "--appendfsync", "always", "--maxmemory", "1gb")], indirect=True)
def test_doctor_passes_noeviction_with_aof(server: services.RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    checks = marks(diagnose(redis.Redis(port=server.port), rate=10, result_ttl=3600))
    assert checks == {"eviction": "ok", "memory": "ok", "persistence": "ok", "replication": "WARN",
                      "functions": "ok", "scripts": "ok", "cluster": "ok", "clock": "ok"}
    assert main(["doctor", "--redis-url", server.url, "--rate", "1"]) == 0
    assert "no check failed" in capsys.readouterr().out


@pytest.mark.parametrize("server", [("--maxmemory-policy", "noeviction", "--appendonly", "yes",
                                     "--maxmemory", "10mb")], indirect=True)
def test_doctor_projects_memory_against_maxmemory(server: services.RedisServer) -> None:
    checks = {c.name: c for c in diagnose(redis.Redis(port=server.port), rate=1000, result_ttl=86400)}
    assert checks["memory"].mark == "FAIL" and "projection" in checks["memory"].detail
    assert checks["persistence"].mark == "WARN"  # appendfsync everysec
