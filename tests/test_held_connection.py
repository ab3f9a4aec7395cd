"""The held connection of the per-message path (``_transport/held.py``, chosen in
``_transport/paths.py``), against a real Redis: replies never cross between threads, a killed
connection reconnects, a forked child takes its own, an error reply leaves the connection in
step, and only redis-py's public names are used."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from dedupe_worker import Deduplicator, Outcome, StoreUnavailable

from .services import RedisServer

pytestmark = pytest.mark.usefixtures("accelerated")  # what is tested here is the accelerator


@pytest.fixture
def held(redis_url: str, namespace: str) -> Iterator[Deduplicator]:
    client = redis.Redis.from_url(redis_url)
    d = Deduplicator(client, namespace=namespace, lease=5.0, result_ttl=60.0)
    assert d.store.scripts.held is not None
    yield d
    d.close()
    client.close()


def held_id(d: Deduplicator) -> int:
    """The server-side id of the connection the per-message path holds."""
    assert d.store.scripts.held is not None
    return int(d.store.scripts.held.execute("CLIENT", "ID"))


def test_calls_run_on_one_held_connection(held: Deduplicator) -> None:
    first = held_id(held)
    for i in range(20):
        assert held.run(f"k{i}", lambda i=i: i) == i
    assert held.begin_many(["a", "b"])[1].outcome is Outcome.ACQUIRED
    assert held_id(held) == first


def test_threads_never_see_each_others_replies(held: Deduplicator) -> None:
    """The lock keeps one caller on the held connection; the others use the pool. A reply read
    by the wrong thread would surface as a wrong value here."""
    errors: list[str] = []

    def work(t: int) -> None:
        for i in range(60):
            key = f"t{t}-{i}"
            try:
                if held.run(key, lambda key=key: key) != key:
                    errors.append(key)
                if [c.outcome for c in held.begin_many([key, f"{key}-new"])] != [Outcome.DUPLICATE,
                                                                                 Outcome.ACQUIRED]:
                    errors.append(f"{key} batch")
            except Exception as exc:  # a reply read by the wrong thread may not even parse
                errors.append(f"{key}: {exc!r}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []


@pytest.mark.parametrize("retries", [None, 0])
def test_a_connection_killed_while_idle_is_replaced_before_sending(redis_url: str, namespace: str, retries: int | None,
                                                                  redis_client: redis.Redis) -> None:
    """As the pool checks a connection before handing it out, even with no retries allowed."""
    options = {} if retries is None else {"retry": Retry(NoBackoff(), retries)}
    client = redis.Redis.from_url(redis_url, **options)
    d = Deduplicator(client, namespace=namespace)
    before = held_id(d)
    assert d.run("before", lambda: 1) == 1
    redis_client.client_kill_filter(_id=before)
    assert d.run("after", lambda: 2) == 2
    assert d.begin_many(["x", "y"])[0].outcome is Outcome.ACQUIRED
    after = held_id(d)
    assert after != before
    redis_client.client_kill_filter(_id=after)
    assert d.begin_many(["x", "z"])[1].outcome is Outcome.ACQUIRED  # the pipelined path too
    d.close()
    client.close()


def test_a_server_outage_fails_the_call_and_the_next_reconnects(private_redis: RedisServer) -> None:
    d = Deduplicator.from_url(private_redis.url, lease=5)
    assert d.run("before", lambda: 1) == 1
    private_redis.stop()
    with pytest.raises(StoreUnavailable):
        d.run("during", lambda: 2)
    private_redis.start()
    assert d.run("after", lambda: 3) == 3
    assert d.begin_many(["a", "b"])[1].outcome is Outcome.ACQUIRED
    d.close()


def test_a_forked_child_takes_its_own_connection(held: Deduplicator) -> None:
    parent = held_id(held)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not use (or close) the parent's socket
        code = 1
        try:
            ok = held.run("child", lambda: "c") == "c" and held_id(held) != parent
            code = 0 if ok else 2
        finally:
            os.write(write, b"x")
            os._exit(code)
    os.close(write)
    os.read(read, 1)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert held.run("parent", lambda: "p") == "p"
    assert held_id(held) == parent
    assert held.begin("child").outcome is Outcome.DUPLICATE


def test_an_error_reply_keeps_the_connection_in_step(held: Deduplicator, redis_client: redis.Redis) -> None:
    held.begin("warm-up")  # the scripts are loaded before Redis refuses writes
    before = held_id(held)
    # A record of another type no longer makes an error reply (claim.lua answers UNREADABLE for
    # it); Redis refusing a script that may write at maxmemory with noeviction still does (OOM).
    policy = redis_client.config_get("maxmemory-policy")["maxmemory-policy"]
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", 1)
    try:
        with pytest.raises(StoreUnavailable):
            held.begin("refused")
        with pytest.raises(StoreUnavailable):
            held.begin_many(["fine", "refused"])
    finally:
        redis_client.config_set("maxmemory", 0)
        redis_client.config_set("maxmemory-policy", policy)
    assert held.run("next", lambda: "n") == "n"
    assert [c.outcome for c in held.begin_many(["next", "other"])] == [Outcome.DUPLICATE, Outcome.ACQUIRED]
    assert held_id(held) == before


def test_clients_on_one_pool_share_one_held_connection(redis_url: str, namespace: str) -> None:
    """Clients made per request and never closed must not take a connection each: 300 of them
    on a pool of 100 all work, and the pool made one connection."""
    client = redis.Redis.from_url(redis_url, max_connections=100)
    clients = [Deduplicator(client, namespace=namespace) for _ in range(300)]
    assert {id(d.store.scripts.held) for d in clients} == {id(clients[0].store.scripts.held)}
    for i, d in enumerate(clients):
        assert d.begin(f"k{i}").outcome is Outcome.ACQUIRED
    assert len(client.connection_pool._in_use_connections) + len(client.connection_pool._available_connections) == 1
    client.close()


@pytest.mark.parametrize("pool", ["blocking", "small"])
def test_small_or_blocking_pools_are_left_alone(redis_url: str, namespace: str, pool: str) -> None:
    """Holding one of few connections could starve the renewer and watcher threads."""
    if pool == "blocking":
        client = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(redis_url, max_connections=2))
    else:
        client = redis.Redis.from_url(redis_url, max_connections=4)
    d = Deduplicator(client, namespace=namespace)
    assert d.store.scripts.held is None
    assert d.run("k", lambda: 1) == 1 and d.begin("k").outcome is Outcome.DUPLICATE
    d.close()
    client.close()


def test_a_missing_script_reloads_them_all(private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a NOSCRIPT every protocol script is loaded, so a pipeline (complete, release, then
    claim) never finds a later script loaded and an earlier one missing: a retried call would
    run after the later calls of its pipeline."""
    from dedupe_worker._transport.script_flow import SCRIPT_NAMES

    monkeypatch.setenv("DEDUPE_SCRIPTS", "eval")  # SCRIPT LOAD + EVALSHA (Functions: test_functions)
    client = redis.Redis.from_url(private_redis.url)
    d = Deduplicator(client, namespace="reload", lease=5)
    shas = [d.store.scripts.sha[name] for name in SCRIPT_NAMES]
    client.script_flush()
    first = d.begin("given-back")  # NOSCRIPT for claim.lua
    assert client.script_exists(*shas) == [True] * len(shas)
    _, released, (again,) = d.settle_and_claim((), [first], [d.request("given-back")])
    assert released == [True] and again.outcome is Outcome.ACQUIRED and again.token > first.token
    d.close()
    client.close()


def test_a_child_forked_while_a_call_was_running_is_not_locked_out(held: Deduplicator) -> None:
    """A thread of the parent in the middle of a call at the fork leaves the lock taken in the
    child's copy: the child must get a fresh lock (and connection), and close() must not hang."""
    runner = held.store.scripts.held
    assert runner is not None
    parent = held_id(held)
    assert runner._lock.acquire()  # what a parent thread mid-call looks like at the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = held.run("child-locked", lambda: "c") == "c" and held_id(held) != parent
            held.close()
            code = 0 if ok else 2
        finally:
            os.write(write, b"x")
            os._exit(code)
    runner._lock.release()
    os.close(write)
    os.read(read, 1)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert held_id(held) == parent


@pytest.mark.parametrize("module", ["dedupe_worker._transport.held", "dedupe_worker._transport.async_direct"])
def test_the_held_path_uses_only_public_redis_py_names(module: str) -> None:
    """A minor redis-py release may change anything with a leading underscore: the held path
    and the asyncio direct sender read none of it (the attributes they read off other objects are
    all public)."""
    import ast
    import importlib
    from pathlib import Path

    tree = ast.parse(Path(importlib.import_module(module).__file__ or "").read_text())
    private = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and node.attr.startswith("_") and not node.attr.startswith("__")
                      and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "held"))})
    private += [node.args[1].value for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")]
    assert private == []


def test_the_direct_packer_is_used_only_where_it_packs_as_the_connection(redis_url: str) -> None:
    """hiredis packs straight only when it gives the bytes the connection's own pack_command
    gives; a connection whose packer differs keeps its own."""
    import hiredis

    from dedupe_worker._transport.held import direct_packer

    class Lower:  # a custom command_packer (redis-py's public Connection option): lower-case names
        def pack(self, *args: Any) -> list[bytes]:
            head = args[0].lower().split() if isinstance(args[0], str) else [args[0]]
            return [hiredis.pack_command((*head, *args[1:]))]

    plain = redis.Redis.from_url(redis_url, single_connection_client=True)
    custom = redis.Redis.from_url(redis_url, single_connection_client=True, command_packer=Lower())
    try:
        direct = direct_packer(plain.connection)
        assert direct is not None
        command = ("EVALSHA", "ab" * 20, 1, "k", 5, b"v")
        assert [direct(command)] == [b"".join(plain.connection.pack_command(*command))]
        assert direct_packer(custom.connection) is None
        assert custom.ping()  # the custom packer is a working one
    finally:
        plain.close()
        custom.close()


def test_the_path_is_chosen_in_one_place(redis_url: str) -> None:
    from dedupe_worker._transport.paths import HeldPath, PoolPath, path_for

    big, small = redis.Redis.from_url(redis_url), redis.Redis.from_url(redis_url, max_connections=4)
    assert isinstance(path_for(big), HeldPath) and path_for(big).held is not None
    assert type(path_for(small)) is PoolPath and path_for(small).held is None
    for path in (path_for(big), path_for(small)):
        assert path.execute(("PING",)) is True or path.execute(("PING",)) in (b"PONG", "PONG")
        replies = path.execute_many([("PING",), ("NOSUCHCOMMAND",)])
        assert isinstance(replies[1], redis.ResponseError)
    big.close()
    small.close()


@pytest.mark.asyncio
async def test_with_the_accelerators_off_every_client_takes_redis_pys_path(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DEDUPE_PURE_PYTHON=1``: no held connection, no asyncio direct sender (read when a client is built)."""
    import redis.asyncio

    from dedupe_worker._transport.async_direct import DirectSender
    from dedupe_worker._transport.paths import PoolPath, path_for

    monkeypatch.setenv("DEDUPE_PURE_PYTHON", "1")
    client, aclient = redis.Redis.from_url(redis_url), redis.asyncio.Redis.from_url(redis_url)
    assert type(path_for(client)) is PoolPath and DirectSender.for_client(aclient) is None
    d = Deduplicator(client, namespace="accelerators-off", lease=5.0, result_ttl=5.0)
    assert d.run("k", lambda: 1) == 1 and d.run("k", lambda: 2) == 1
    d.close()
    monkeypatch.setenv("DEDUPE_PURE_PYTHON", "0")  # "0" is off, as unset
    assert DirectSender.for_client(aclient) is not None and path_for(client).held is not None
    client.close()
    await aclient.aclose()


@pytest.mark.parametrize("retries", [1, 0])
def test_a_failed_attempt_is_retried_as_the_connection_policy_says(redis_url: str, namespace: str,
                                                                   retries: int) -> None:
    """The retry policy is entered after a failed first attempt: it decides as if it had run
    that attempt itself (one retry allowed: the call succeeds; none: it fails, and the next
    call takes a connection again)."""
    client = redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), retries))
    d = Deduplicator(client, namespace=namespace)
    assert d.run("warm-up", lambda: 0) == 0
    held = d.store.scripts.held
    assert held is not None and held._holder is not None
    connection = held._holder.connection
    send = connection.send_packed_command
    failures = [redis.ConnectionError("a blip")]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return send(*args, **kwargs)

    connection.send_packed_command = flaky
    if retries:
        assert d.run("blip", lambda: 1) == 1
    else:
        with pytest.raises(StoreUnavailable):
            d.begin("blip")
        assert d.run("blip", lambda: 2) == 2
    assert failures == []
    d.close()
    client.close()
