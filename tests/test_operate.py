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
from dedupe_worker._operate.doctor import EARLIER_CLAIM_SHAS, has_format_2_outcome
from dedupe_worker._operate.survey import survey
from dedupe_worker._protocol.layout import KeyLayout
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
    stem = seeded.request("done").stem
    assert reports["done"]["result_key"] == (KeyLayout.record(stem) if seeded.store.record_format == 2
                                             else KeyLayout.result(stem))
    assert reports["held"]["result_key"] == "" and reports["held"]["result_ttl_ms"] == -2
    code, text = cli(capsys, redis_url, namespace, "inspect", "held")
    assert "in_progress" in text and "lease runs" in text
    code, text = cli(capsys, redis_url, namespace, "inspect", "done")
    assert f"outcome {reports['done']['result_key']} ttl" in text


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


def test_stats_counts_outcomes_of_both_formats_in_one_namespace(
        dedupe: Deduplicator, redis_client: redis.Redis, namespace: str) -> None:
    """Through the switch to format 2 a namespace holds outcomes of both formats: the stem's
    string and the ``:result`` hash are each one outcome, with its size and TTL; a key's other
    records are not."""
    dedupe.store.write_format(1)
    dedupe.run("f1", lambda: "x" * 10)
    failed = dedupe.begin("f1-failed")
    dedupe.fail(failed, ValueError("declined"))
    dedupe.store.write_format(2)
    dedupe.run("f2", lambda: "y" * 20)
    dedupe.begin("held")
    dedupe.store.write_format(1)
    dedupe.begin("held-1")  # claims are the same whatever the format
    found = survey(redis_client, namespace, progress=None)
    assert found.keys == 5 and found.states == {"done": 2, "failed": 1, "in_progress": 2}
    assert sorted(found.result_bytes)[:2] == [12, 22]  # the JSON strings' lengths, read from either format
    assert len(found.result_ttls_ms) == 3 and all(0 < ms <= 60_000 for ms in found.result_ttls_ms)
    assert len(found.memory) == len(found.ttls_ms) == 5
    stems = {dedupe.request(k).stem for k in ("f1", "f1-failed", "f2")}
    names = {n.decode() for n in redis_client.scan_iter(match=f"{namespace}:*")}
    assert {n for n in names if KeyLayout.kind(n) in ("record", "result")} == {
        KeyLayout.record(dedupe.request("f2").stem), *(KeyLayout.result(s) for s in stems - {
            dedupe.request("f2").stem})}
    assert has_format_2_outcome(redis_client, namespace, limit=10**8) is True  # the shared Redis holds more
    assert has_format_2_outcome(redis_client, namespace + "-none", limit=10**8) is False


def test_stats_counts_records_the_scripts_cannot_read_as_unreadable(
        seeded: Deduplicator, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str], redis_url: str,
        namespace: str) -> None:
    """A key of another Redis type under one of a key's names, or a malformed outcome, is counted
    ``unreadable`` (what ``claim.lua`` answers for its key), never a WRONGTYPE traceback; the
    readable keys beside them are counted as before."""
    def stem(key: str) -> str:
        return seeded.request(key).stem

    redis_client.sadd(KeyLayout.record(stem("a-set")), "another program's set")
    redis_client.set(KeyLayout.started(stem("a-string")), "1")
    redis_client.rpush(KeyLayout.result(stem("a-list")), "x")
    redis_client.set(KeyLayout.record(stem("truncated")), b"C" + bytes(8) + b"\x00\x40fp")
    redis_client.hset(KeyLayout.result(stem("a-letter")), mapping={"s": "z", "t": "1", "v": "1"})
    redis_client.zadd(KeyLayout.sent(stem("a-mark")), {"x": 1})
    odd = ("a-set", "a-string", "a-list", "truncated", "a-letter")
    assert [seeded.begin(key).outcome.name for key in odd] == ["UNREADABLE"] * len(odd)
    code, out = cli(capsys, redis_url, namespace, "stats", "--json")
    report = json.loads(out)
    assert code == 0 and report["keys"] == 4 + 6
    assert report["states"] == {"done": 2, "in_progress": 1, "failed": 1, "unreadable": 6}
    code, text = cli(capsys, redis_url, namespace, "stats")
    assert code == 0 and "unreadable" in text and "forget KEY --force" in text


def test_the_earlier_releases_are_known_by_the_sha_they_load() -> None:
    """doctor's ``records`` check tells a worker of an earlier release by its ``claim.lua``'s SHA."""
    import hashlib
    from pathlib import Path

    data = Path(__file__).parent / "data"
    shas = {hashlib.sha1((data / folder / "claim.lua").read_bytes()).hexdigest()
            for folder in ("lua_previous", "lua_older")}
    assert shas == set(EARLIER_CLAIM_SHAS)


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


@pytest.mark.parametrize("server", [("--maxmemory-policy", "noeviction", "--appendonly", "yes")], indirect=True)
def test_doctor_warns_of_format_2_outcomes_where_an_earlier_release_runs(
        server: services.RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    client = redis.Redis(port=server.port)
    dedupe = Deduplicator(client, namespace="ns", lease=5.0)
    dedupe.store.write_format(2)
    dedupe.run("order-1", lambda: 1)
    checks = {c.name: c for c in diagnose(client, namespace="ns")}
    assert checks["records"].mark == "ok" and "format-2 outcomes are stored" in checks["records"].detail
    client.script_load((Path(__file__).parent / "data" / "lua_previous" / "claim.lua").read_text())
    checks = {c.name: c for c in diagnose(client, namespace="ns")}
    assert checks["records"].mark == "WARN" and "0.1.0" in checks["records"].detail
    assert {c.name: c.mark for c in diagnose(client, namespace="other")}["records"] == "ok"
    assert main(["doctor", "--redis-url", server.url, "--namespace", "ns"]) == 0
    out = capsys.readouterr().out
    assert "records" in out and "DEDUPE_RECORD_FORMAT=1" in out
    dedupe.close()
