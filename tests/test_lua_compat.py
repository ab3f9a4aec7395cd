"""Rolling upgrades: workers running the previous release's scripts and workers running ours share
one Redis, so each must read the other's records as its own.

``tests/data/lua_previous/`` holds the scripts as the previous release shipped them and
``tests/data/lua_older/`` those of the release before. Results change format in two phases: this
release reads both formats and writes record format 1 (the hash at ``<stem>:result`` every
release reads) unless switched to format 2 (the compact string at the stem itself,
``DEDUPE_RECORD_FORMAT=2``), which only this release and later ones read. So the pairs that share
a namespace during an upgrade are: previous and ours (phase one), older and ours (a skipped
release), and ours writing format 1 with ours writing format 2 (phase two: the switch rolled out
worker by worker, or rolled back). An earlier release never meets a format-2 outcome if the
phases are kept in order; what it would do with one is shown at the end (it cannot see it).

Every scenario below (one message key through claims, completions, releases, renewals, expiries,
watches, inspections and forgets) runs once with the previous scripts only, which gives the
reference, and then, for each pair, with the versions mixed: the newer only, alternating step by
step, and switched over at every step in both directions. Every mix must answer exactly as the
reference (tokens compared by their order of appearance, remaining lease times by being
positive), and every token acquired must be larger than each one seen before.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

from dedupe_worker import Stored
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker._transport.record import StoredResult, parse_result, read_result
from dedupe_worker._transport.script_flow import SCRIPT_NAMES
from dedupe_worker._transport.scripts import load_script

from .lua_releases import EarlierCalls, StandaloneCalls

PREVIOUS = Path(__file__).parent / "data" / "lua_previous"
OLDER = Path(__file__).parent / "data" / "lua_older"
#: The versions that share a namespace during an upgrade, each pair ``(earlier, later)``.
PAIRS = [("previous", "ours"), ("older", "ours"), ("ours", "ours2")]
LEASE_MS, RETENTION_MS, RESULT_TTL_MS = 5000, 60_000, 60_000
VALUE = b'{"status":"charged","amount":1250}'


class Scripts:
    """One version of the protocol scripts, called with the arguments the store sends (writing
    results in ``record_format`` where the scripts know of formats)."""

    def __init__(self, client: redis.Redis, texts: dict[str, str], record_format: int = 1,
                 earlier: bool = False) -> None:
        self.client = client
        self.calls = EarlierCalls() if earlier else StandaloneCalls()
        self.calls.write_format(record_format)
        self.earlier = earlier
        self.texts = texts
        self.sha = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in texts.items()}
        for text in texts.values():
            client.script_load(text)

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return self.client.evalsha(self.sha[name], len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        except redis.exceptions.NoScriptError:  # another test flushed the scripts (it ran nothing)
            self.client.script_load(self.texts[name])
            return self.client.evalsha(self.sha[name], len(keys), *keys, *args)  # type: ignore[no-untyped-call]

    def state_keys(self, stem: str) -> tuple[str, ...]:
        """The KEYS of ``inspect``/``watch`` (``forget`` adds the notice list) in this version."""
        return (KeyLayout.started(stem), KeyLayout.result(stem)) if self.earlier else KeyLayout.records(stem)

    def run(self, calls: Sequence[tuple[str, Sequence[str], Sequence[Any]]]) -> Any:
        [(name, keys, args)] = calls
        return self.call(name, keys, args)

    def claim(self, items: Sequence[tuple[str, str, str]], lease_ms: int = LEASE_MS) -> list[Any]:
        return StandaloneCalls.claim_replies(self.run(self.calls.claim_calls(items, lease_ms, RETENTION_MS)))


@pytest.fixture
def versions(redis_client: redis.Redis) -> dict[str, Scripts]:
    ours = {n: load_script(n) for n in SCRIPT_NAMES}
    return {
        "previous": Scripts(redis_client, {n: (PREVIOUS / f"{n}.lua").read_text() for n in SCRIPT_NAMES},
                            earlier=True),
        "older": Scripts(redis_client, {n: (OLDER / f"{n}.lua").read_text() for n in SCRIPT_NAMES}, earlier=True),
        "ours": Scripts(redis_client, ours),
        "ours2": Scripts(redis_client, ours, record_format=2),
    }


class Run:
    """One scenario under one assignment of script versions to its steps, the answers normalised."""

    def __init__(self, client: redis.Redis, versions: dict[str, Scripts], plan: Sequence[str]) -> None:
        self.client, self.versions, self.plan = client, versions, plan
        self.stem = KeyLayout(f"t-{uuid.uuid4().hex[:12]}").stem("order-1")
        self.ids: dict[int, int] = {}
        self.highest = 0
        self.step = 0

    def token(self, value: Any, acquired: bool = False) -> int:
        """A token by its order of appearance (0 stays 0); an acquired one must be the largest yet."""
        value = int(value)
        if acquired:
            assert value > self.highest, f"token {value} acquired after {self.highest} (plan {self.plan})"
        self.highest = max(self.highest, value)
        return self.ids.setdefault(value, len(self.ids) + 1) if value else 0

    def do(self, op: str, *args: Any) -> Any:
        if op == "sleep":
            time.sleep(args[0] / 1000)
            return None
        if op == "ahead":  # the counter left by a primary whose clock ran ahead (see claim.lua)
            value = self.highest + 10**10
            self.client.hset(KeyLayout.started(self.stem), "next", value)
            return self.token(value)
        v = self.versions[self.plan[self.step]]
        self.step += 1
        stem = self.stem
        keys, notice = v.state_keys(stem), KeyLayout.notice(stem)
        c = v.calls
        if op == "claim":
            fp, lease_ms = args[0], (args[1] if len(args) > 1 else LEASE_MS)
            (reply,) = v.claim([(stem, fp, "")], lease_ms)
            acquired = reply.outcome.value == 1
            return (reply.outcome.name, self.token(reply.token, acquired), reply.status and reply.status.value,
                    reply.value, reply.remaining_ms > 0)
        if op == "complete":
            token = self.tokens[args[0]]
            status = args[1] if len(args) > 1 else Stored.COMPLETED
            return v.run(c.complete_calls([(stem, token, status, VALUE)], RESULT_TTL_MS))
        if op == "release":
            return v.run(c.release_calls([(stem, self.tokens[args[0]])], RETENTION_MS))
        if op == "renew":
            return v.run(c.renew_calls([(stem, self.tokens[args[0]])], args[1], RETENTION_MS))
        if op == "inspect":
            code, token, a, b = v.call("inspect", keys, ())
            return int(code), self.token(token), a if int(code) == 2 else int(a) > 0, b
        if op == "watch":
            held, remaining = v.call("watch", keys, ())
            return int(held), int(remaining) > 0
        if op == "forget":
            token = "" if args[0] is None else self.tokens[args[0]]
            code, found = v.call("forget", (*keys, notice), (token, "1" if args[1] else "0"))
            return int(code), self.token(found)
        raise AssertionError(op)

    @property
    def tokens(self) -> dict[int, int]:
        return {i: value for value, i in self.ids.items()}

    def notices(self) -> list[int]:
        return [self.token(t) for t in self.client.lrange(KeyLayout.notice(self.stem), 0, -1)]

    def originals(self) -> tuple[Any, Any]:
        stored = read_result(self.client, self.stem)
        return (self.client.hget(KeyLayout.started(self.stem), "orig"), stored.original or None if stored else None)


#: Each scenario: steps ``(op, *args)``; a token argument is its order of appearance (1 = first).
#: ``notices`` reads the key's notice list, ``ahead`` sets the token counter far ahead of the
#: clock, ``sleep`` waits (no script runs in these three).
SCENARIOS: dict[str, list[tuple[Any, ...]]] = {
    "fingerprints while held and after completion": [
        ("claim", "fp-a"), ("claim", "fp-a"), ("claim", "fp-b"), ("claim", ""), ("complete", 1),
        ("claim", "fp-a"), ("claim", "fp-b"), ("claim", ""), ("inspect",)],
    "no fingerprint, then any fingerprint is a duplicate": [
        ("claim", ""), ("claim", "fp-b"), ("complete", 1, Stored.OMITTED), ("claim", "fp-b"), ("claim", "")],
    "a release frees the key and keeps the counter": [
        ("claim", "fp-a"), ("release", 1), ("release", 1), ("inspect",), ("claim", "fp-b"), ("complete", 1),
        ("complete", 2), ("claim", "fp-a"), ("claim", "fp-b")],
    "a fingerprint does not outlive its released claim": [
        ("claim", "fp-a"), ("release", 1), ("claim", ""), ("claim", "fp-b"), ("complete", 2), ("claim", "fp-b")],
    "a fingerprint does not outlive its expired claim": [
        ("claim", "fp-a", 30), ("sleep", 60), ("inspect",), ("claim", ""), ("claim", "fp-b"), ("complete", 1),
        ("renew", 1, LEASE_MS), ("complete", 2), ("claim", "fp-b")],
    "tokens stay above a counter ahead of the clock": [
        ("claim", "", 30), ("ahead",), ("sleep", 60), ("claim", ""), ("release", 3), ("ahead",), ("claim", "fp-a"),
        ("inspect",), ("complete", 5), ("claim", "")],
    "renewals extend only the owner's lease": [
        ("claim", "", 30), ("renew", 1, LEASE_MS), ("sleep", 60), ("inspect",), ("claim", ""), ("release", 1),
        ("renew", 1, LEASE_MS), ("claim", "fp-a"), ("renew", 2, LEASE_MS), ("inspect",), ("complete", 2)],
    "a retried completion answers as the first one": [
        ("claim", "fp-a"), ("complete", 1, Stored.FAILED), ("complete", 1), ("inspect",), ("claim", "fp-a"),
        ("claim", "")],
    "watchers are told of a completion": [
        ("claim", ""), ("watch",), ("watch",), ("complete", 1), ("notices",), ("watch",), ("claim", "")],
    "watchers are told of a release, once": [
        ("claim", "fp-a"), ("watch",), ("release", 1), ("notices",), ("claim", ""), ("watch",), ("release", 2),
        ("notices",), ("claim", "fp-b"), ("release", 3), ("notices",)],
    "forget a lease, then a stored outcome": [
        ("claim", "fp-a"), ("forget", None, False), ("forget", 1, True), ("inspect",), ("forget", None, False),
        ("claim", ""), ("complete", 2), ("forget", 1, False), ("forget", 2, False), ("claim", "")],
}


NOT_SCRIPTED = ("sleep", "notices", "ahead")


def _plans(steps: int, earlier: str = "previous", later: str = "ours") -> Iterator[tuple[str, ...]]:
    """Every way one version can follow the other: all the later one, alternating (both ways
    round), and a switch-over after each step, in both directions."""
    yield (later,) * steps
    yield tuple(earlier if i % 2 else later for i in range(steps))
    yield tuple(later if i % 2 else earlier for i in range(steps))
    for cut in range(1, steps):
        yield (earlier,) * cut + (later,) * (steps - cut)
        yield (later,) * cut + (earlier,) * (steps - cut)


def _play(client: redis.Redis, versions: dict[str, Scripts], steps: list[tuple[Any, ...]],
          plan: Sequence[str]) -> list[Any]:
    run = Run(client, versions, plan)
    answers = []
    for op, *args in steps:
        answers.append(run.notices() if op == "notices" else run.do(op, *args))
    return answers


@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_mixed_versions_answer_as_the_previous_release(
        name: str, pair: tuple[str, str], redis_client: redis.Redis, versions: dict[str, Scripts]) -> None:
    steps = SCENARIOS[name]
    scripted = sum(op not in NOT_SCRIPTED for op, *_ in steps)
    reference = _play(redis_client, versions, steps, ("previous",) * scripted)
    for plan in _plans(scripted, *pair):
        assert _play(redis_client, versions, steps, plan) == reference, plan


def test_the_reference_runs_are_what_the_protocol_promises(
        redis_client: redis.Redis, versions: dict[str, Scripts]) -> None:
    """The answers every mix is held to, spelled out for two scenarios (so a scenario that went
    wrong in both versions alike cannot pass)."""
    steps = SCENARIOS["a fingerprint does not outlive its released claim"]
    assert _play(redis_client, versions, steps, ("previous",) * 6) == [
        ("ACQUIRED", 1, None, None, False), [1], ("ACQUIRED", 2, None, None, False),
        ("IN_PROGRESS", 2, None, None, True), [1], ("DUPLICATE", 2, "c", VALUE, False)]
    steps = SCENARIOS["watchers are told of a completion"]
    assert _play(redis_client, versions, steps, ("ours",) * 6) == [
        ("ACQUIRED", 1, None, None, False), (1, True), (1, True), [1], [1, 1], (0, False),
        ("DUPLICATE", 1, "c", VALUE, False)]


@pytest.mark.parametrize(("writer", "reader"), [
    *((w, r) for earlier, later in PAIRS for w in (earlier, later) for r in (earlier, later)),
    ("previous", "ours2")])  # phase two reads what the previous release left
def test_a_batch_of_every_kind_of_key_reads_alike(
        writer: str, reader: str, redis_client: redis.Redis, versions: dict[str, Scripts]) -> None:
    """One claim call over keys in every state (stored, conflicting, held, released, expired, new)
    written by one version and claimed by the other: the same answers as the previous release's."""

    def answers(writer: str, reader: str) -> list[Any]:
        w, r = versions[writer], versions[reader]
        layout = KeyLayout(f"t-{uuid.uuid4().hex[:12]}")
        stems = {kind: layout.stem(kind) for kind in ("done", "done-fp", "held", "released", "expired", "new")}
        c = w.calls
        tokens = [reply.token for reply in w.claim([(stems[k], "fp-a", "") for k in ("done", "done-fp", "held",
                                                                                        "released")])]
        (expired,) = w.claim([(stems["expired"], "fp-a", "")], lease_ms=20)
        w.run(c.complete_calls([(stems["done"], tokens[0], Stored.COMPLETED, VALUE),
                                (stems["done-fp"], tokens[1], Stored.FAILED, b"{}")], RESULT_TTL_MS))
        w.run(c.release_calls([(stems["released"], tokens[3])], RETENTION_MS))
        time.sleep(0.04)
        replies = r.claim([(stems["done"], "", ""), (stems["done-fp"], "fp-b", ""), (stems["done-fp"], "fp-a", ""),
                           (stems["held"], "fp-b", ""), (stems["held"], "", ""), (stems["released"], "fp-b", ""),
                           (stems["expired"], "", ""), (stems["new"], "", "the original key")])
        seconds, micros = redis_client.time()
        now_us = seconds * 1_000_000 + micros
        new = replies[-1]
        assert new.outcome.name == "ACQUIRED" and 0 <= now_us - new.token < 5_000_000
        assert replies[4].token == tokens[2]
        assert replies[5].token > tokens[3] and replies[6].token > expired.token
        assert redis_client.hget(KeyLayout.started(stems["new"]), "orig") == b"the original key"
        return [(x.outcome.name, x.status, x.value, x.remaining_ms > 0) for x in replies]

    assert answers(writer, reader) == answers("previous", "previous") == [
        ("DUPLICATE", Stored.COMPLETED, VALUE, False), ("CONFLICT", None, None, False),
        ("DUPLICATE", Stored.FAILED, b"{}", False), ("CONFLICT", None, None, False),
        ("IN_PROGRESS", None, None, True), ("ACQUIRED", None, None, False), ("ACQUIRED", None, None, False),
        ("ACQUIRED", None, None, False)]


@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_original_keys_are_kept_by_either_version(
        pair: tuple[str, str], redis_client: redis.Redis, versions: dict[str, Scripts]) -> None:
    for claimer in pair:
        for completer in pair:
            run = Run(redis_client, versions, ())
            (reply,) = versions[claimer].claim([(run.stem, "fp-a", "the original key")])
            assert run.originals() == (b"the original key", None)
            calls = versions[completer].calls
            versions[completer].run(calls.complete_calls([(run.stem, reply.token, Stored.COMPLETED, VALUE)],
                                                         RESULT_TTL_MS))
            assert run.originals() == (None, b"the original key")


def test_our_records_leave_out_empty_fields(redis_client: redis.Redis, versions: dict[str, Scripts]) -> None:
    """A missing field reads as the empty one did (the tests above), so ours are not written: a
    first claim without a fingerprint holds three fields, its result three."""
    ours = versions["ours"]
    run = Run(redis_client, versions, ())
    started, result = KeyLayout.started(run.stem), KeyLayout.result(run.stem)
    (reply,) = ours.claim([(run.stem, "", "")])
    token = str(reply.token).encode()
    assert redis_client.hgetall(started) == {b"next": token, b"owner": token, b"deadline": redis_client.hget(
        started, "deadline")}
    assert 55_000 < redis_client.pttl(started) <= 60_000
    ours.run(ours.calls.complete_calls([(run.stem, reply.token, Stored.COMPLETED, VALUE)], RESULT_TTL_MS))
    assert redis_client.hgetall(result) == {b"s": b"c", b"v": VALUE, b"t": token}
    assert 55_000 < redis_client.pttl(result) <= 60_000
    # a fingerprint is kept in both records
    run = Run(redis_client, versions, ())
    (reply,) = ours.claim([(run.stem, "fp-a", "")])
    assert redis_client.hget(KeyLayout.started(run.stem), "fp") == b"fp-a"
    ours.run(ours.calls.complete_calls([(run.stem, reply.token, Stored.COMPLETED, VALUE)], RESULT_TTL_MS))
    assert redis_client.hget(KeyLayout.result(run.stem), "f") == b"fp-a"


def test_format_2_is_one_string_at_the_floor_of_memory(
        redis_client: redis.Redis, versions: dict[str, Scripts]) -> None:
    """Record format 2: the status letter, the token in 8 bytes, the value, one ``SET ... PX`` at the
    stem itself; the completed key then holds nothing else, and takes no more memory than a plain
    ``SET`` of the same key name and value."""
    ours2 = versions["ours2"]
    run = Run(redis_client, versions, ())
    result = KeyLayout.record(run.stem)
    assert result == run.stem
    (reply,) = ours2.claim([(run.stem, "", "")])
    assert ours2.run(ours2.calls.complete_calls([(run.stem, reply.token, Stored.COMPLETED, VALUE)],
                                                RESULT_TTL_MS)) == [1]
    raw = redis_client.get(result)
    assert raw == b"c" + reply.token.to_bytes(8, "big") + VALUE
    assert parse_result(raw) == StoredResult(b"c", reply.token, VALUE)
    assert 55_000 < redis_client.pttl(result) <= 60_000
    assert not redis_client.exists(KeyLayout.started(run.stem), KeyLayout.result(run.stem))
    used = redis_client.memory_usage(result)
    redis_client.set(result, VALUE, px=RESULT_TTL_MS)
    assert used <= redis_client.memory_usage(result)
    # with a fingerprint and an original key, both are kept before the value
    run = Run(redis_client, versions, ())
    (reply,) = ours2.claim([(run.stem, "fp-a", "the original key")])
    ours2.run(ours2.calls.complete_calls([(run.stem, reply.token, Stored.FAILED, b"{}")], RESULT_TTL_MS))
    assert read_result(redis_client, run.stem) == StoredResult(
        b"f", reply.token, b"{}", b"fp-a", b"the original key")
    assert ours2.claim([(run.stem, "fp-b", "")])[0].outcome.name == "CONFLICT"
    duplicate = ours2.claim([(run.stem, "fp-a", "")])[0]
    assert (duplicate.outcome.name, duplicate.token, duplicate.status, duplicate.value) == (
        "DUPLICATE", reply.token, Stored.FAILED, b"{}")


def test_format_1_reads_back_in_python_alike(redis_client: redis.Redis, versions: dict[str, Scripts]) -> None:
    run = Run(redis_client, versions, ())
    ours = versions["ours"]
    (reply,) = ours.claim([(run.stem, "fp-a", "the original key")])
    ours.run(ours.calls.complete_calls([(run.stem, reply.token, Stored.OMITTED, b"")], RESULT_TTL_MS))
    assert redis_client.type(KeyLayout.result(run.stem)) == b"hash"
    assert not redis_client.exists(run.stem)
    assert read_result(redis_client, run.stem) == StoredResult(
        b"o", reply.token, b"", b"fp-a", b"the original key")
    assert read_result(redis_client, run.stem + "-none") is None


@pytest.mark.parametrize("earlier", ["previous", "older"])
def test_an_earlier_release_cannot_see_a_format_2_outcome(
        earlier: str, redis_client: redis.Redis, versions: dict[str, Scripts]) -> None:
    """Why the switch to format 2 waits until no worker of an earlier release is left (docs/protocol.md's
    upgrade order; ``doctor`` warns when it finds both): such a worker looks for the outcome at
    ``<stem>:result`` only, so it takes a key completed in format 2 for a new one and would run its
    message again. This release, writing either format, answers DUPLICATE."""
    run = Run(redis_client, versions, ())
    ours2 = versions["ours2"]
    (reply,) = ours2.claim([(run.stem, "", "")])
    ours2.run(ours2.calls.complete_calls([(run.stem, reply.token, Stored.COMPLETED, VALUE)], RESULT_TTL_MS))
    for ours in ("ours", "ours2"):
        (again,) = versions[ours].claim([(run.stem, "", "")])
        assert (again.outcome.name, again.token, again.value) == ("DUPLICATE", reply.token, VALUE)
    (wrong,) = versions[earlier].claim([(run.stem, "", "")])
    assert wrong.outcome.name == "ACQUIRED"
    assert parse_result(redis_client.get(run.stem)).token == reply.token  # the outcome itself is untouched
