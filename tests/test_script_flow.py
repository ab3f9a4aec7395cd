"""The script runners' shared core (``_transport/script_flow.py``), driven without Redis: what it
asks for, in which order, after a ``NOSCRIPT``; the sync and asyncio runners only carry these
requests (their Redis behaviour is tested in test_held_connection, test_async_protocol, test_failover)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from dedupe_worker import StoreUnavailable
from dedupe_worker._protocol.calls import NotDurable
from dedupe_worker._transport.script_flow import (
    INFO,
    LOAD_ORDER,
    PER_CALL,
    SCRIPT_NAMES,
    SCRIPTS_ENV,
    SENDER_SCRIPTS,
    Library,
    ScriptFlows,
    drive,
    function_missing,
    library_text,
    refused,
    split_definitions,
)
from dedupe_worker._transport.scripts import load_script

SOURCE = {name: f"#!lua flags=allow-oom\nreturn '{name}'" for name in ("send", *LOAD_ORDER)}


def run(flow: Any, replies: list[Any]) -> tuple[Any, list[Any]]:
    """Drive ``flow`` with ``replies`` in order (an exception is raised into it); what it asked."""
    asked: list[Any] = []

    def send(request: Any) -> Any:
        asked.append(request)
        reply = replies.pop(0)
        if isinstance(reply, Exception) and not isinstance(request, list):
            raise reply
        return reply

    return drive(flow, send), asked


def test_a_noscript_loads_every_script_then_sends_only_the_calls_that_ran_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCRIPTS_ENV, "eval")  # EVALSHA forced on Redis 7
    flows = ScriptFlows(dict(SOURCE))
    calls = [("complete", ["a"], [1]), ("release", ["b"], [2]), ("claim", ["c"], [3])]
    texts = {name: SOURCE[name] for name in SOURCE}  # Redis 7: the #!lua line is kept
    result, asked = run(flows.call_all(calls, wait=(1, 100)), [
        {"redis_version": "7.0.15"},                                   # INFO server
        [1, NoScriptError("NOSCRIPT"), 3, 0],                          # the round trip, WAIT last
        *[b"sha"] * (1 + len(LOAD_ORDER)),                             # SCRIPT LOAD each
        2,                                                             # release.lua again
        1,                                                             # WAIT again
    ])
    assert result == [1, 2, 3]
    assert asked[0] is INFO
    assert [c[0] for c in asked[1]] == ["EVALSHA"] * 3 + ["WAIT"]
    assert asked[2:2 + 1 + len(LOAD_ORDER)] == [texts["send"], *(texts[n] for n in LOAD_ORDER)]
    assert flows.sha is not None
    assert asked[-2:] == [("EVALSHA", flows.sha["release"], 1, "b", 2), ("WAIT", 1, 100)]


def test_redis_6_gets_the_texts_without_flags_and_an_error_reply_to_info_means_no_flags() -> None:
    for info in ({"redis_version": "6.2.14"}, ResponseError("unknown command 'INFO'")):
        flows = ScriptFlows(dict(SOURCE))
        result, _ = run(flows.call("claim", ["k"], []), [info, "ok"])
        assert result == "ok" and not flows.text["claim"].startswith("#!")


def test_failures_are_store_unavailable_and_few_replicas_not_durable() -> None:
    flows = ScriptFlows(dict(SOURCE))
    with pytest.raises(StoreUnavailable, match=r"claim\.lua"):
        run(flows.call("claim", ["k"], []), [{"redis_version": "7.0.0"}, RedisConnectionError("down")])
    with pytest.raises(StoreUnavailable, match=r"complete\.lua"):
        run(flows.call_all([("complete", ["a"], []), ("claim", ["b"], [])]), [[ResponseError("WRONGTYPE"), 1]])
    with pytest.raises(NotDurable) as caught:
        run(flows.call_all([("claim", ["a"], [])], wait=(2, 50)), [["x", 1]])
    assert caught.value.replies == ["x"]


def test_redis_7_calls_functions_reloads_the_library_when_missing_and_falls_back_when_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCRIPTS_ENV, raising=False)
    flows = ScriptFlows(dict(SOURCE))
    calls = [("complete", ["a"], [1]), ("claim", ["c"], [3])]
    missing = ResponseError("Function not found")
    result, asked = run(flows.call_all(calls), [
        {"redis_version": "7.2.4"},                   # INFO server (Valkey says 7.2.4 too)
        [1, missing],                                 # claim's function is gone (FUNCTION FLUSH)
        "OK",                                         # FUNCTION LOAD REPLACE
        3,                                            # claim again, still an FCALL
    ])
    fn = flows.library + "_claim"
    assert result == [1, 3] and flows.functions and flows.loads == 1
    assert [c[:2] for c in asked[1]] == [("FCALL", flows.library + "_complete"), ("FCALL", fn)]
    assert asked[2] == Library(flows.library, library_text(SOURCE, flows.library))
    assert asked[3] == ("FCALL", fn, 1, "c", 3)
    # FUNCTION LOAD refused (an ACL without +function): the scripts are loaded, EVALSHA from now on
    result, asked = run(flows.call("claim", ["k"], []), [
        missing, NoPermissionError("NOPERM this user has no permissions to run the 'function|load' command"),
        *[b"sha"] * (1 + len(LOAD_ORDER)), "ok"])
    assert result == "ok" and not flows.functions and flows.loads == 2
    assert isinstance(asked[1], Library) and asked[-1][0] == "EVALSHA"


def test_the_library_wraps_each_script_file_with_its_flags() -> None:
    text = library_text({"claim": "return 1", "complete": "#!lua flags=allow-oom\nreturn 2",
                         "inspect": "return 3"}, "dedupe_x")
    assert text.startswith("#!lua name=dedupe_x\n")
    assert "function_name='dedupe_x_claim', callback=function(KEYS, ARGV)\nreturn 1\nend, flags={}}" in text
    assert ("function_name='dedupe_x_complete', callback=function(KEYS, ARGV)\nreturn 2\nend, "
            "flags={'allow-oom'}}") in text
    assert "flags={'no-writes'}" in text


def test_the_library_defines_a_scripts_helpers_once_at_load_and_runs_the_rest_per_call() -> None:
    script = "#!lua flags=allow-oom\nlocal function f(x) return x end\n-- per call\nreturn f(ARGV[1])"
    assert split_definitions(script) == ("local function f(x) return x end\n", "return f(ARGV[1])")
    assert split_definitions("return 1") == ("", "return 1")
    text = library_text({"complete": script, "inspect": "return 3"}, "dedupe_x")
    assert ("do\nlocal function f(x) return x end\nredis.register_function{function_name='dedupe_x_complete', "
            "callback=function(KEYS, ARGV)\nreturn f(ARGV[1])\nend, flags={'allow-oom'}}\nend") in text
    assert "function_name='dedupe_x_inspect', callback=function(KEYS, ARGV)\nreturn 3\nend" in text


@pytest.mark.parametrize("name", [*SENDER_SCRIPTS, *SCRIPT_NAMES])
def test_what_a_script_defines_once_reads_no_keys_argv_or_redis_at_load(name: str) -> None:
    """At load a library has no KEYS or ARGV (they are each call's) and cannot call Redis: the
    definitions before a script's ``-- per call`` line may only use them inside function bodies,
    and only through their arguments for KEYS and ARGV."""
    definitions, per_call = split_definitions(load_script(name))
    code = "\n".join(line.split("--", 1)[0] for line in definitions.splitlines())
    assert not re.search(r"\b(KEYS|ARGV)\b", code), name
    blocks: list[str] = []  # the Lua blocks open: a redis. outside every function body runs at load
    for line in code.splitlines():
        words = re.findall(r"\bfunction\b|\bif\b|\bdo\b|\brepeat\b|\bend\b|\buntil\b|\bredis\.",
                           re.sub(r"'[^']*'", "''", line))
        for word in words:
            if word == "redis.":
                assert "function" in blocks, (name, line)
            elif word in ("end", "until"):
                blocks.pop()
            else:
                blocks.append(word)
    assert not blocks, name
    assert per_call.strip()
    if name in ("claim", "complete", "send"):  # the per-message scripts: their helpers are defined once
        assert f"\n{PER_CALL}\n" in load_script(name) and definitions


def test_only_a_refusal_of_functions_switches_to_evalsha() -> None:
    assert refused(NoPermissionError("this user has no permissions to run the 'fcall' command"))
    assert refused(NoPermissionError("this user has no permissions to run the 'function|load' command"))
    assert refused(ResponseError("unknown command 'FCALL', with args beginning with: "))
    assert not refused(NoPermissionError("No permissions to access a key"))  # EVALSHA: the same
    assert not refused(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    assert function_missing(ResponseError("Function not found")) and not function_missing(ResponseError("x"))
