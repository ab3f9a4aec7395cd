"""The compiled packer ``dedupe_worker._resp.pack_command`` packs byte for byte as
``hiredis.pack_command``, refuses what it refuses with the same exception, and is the one
``direct_packer`` chooses unless ``DEDUPE_PURE_PYTHON`` is set.

With ``CI=true`` the compiled module must be importable (it is built by ``make install``); only
``DEDUPE_PURE_PYTHON``/``DEDUPE_NO_EXTENSIONS`` excuse its absence.
"""

from __future__ import annotations

import array
import enum
import math
import os
import random
import sys
import weakref
from pathlib import Path
from typing import Any

import hiredis
import pytest
import redis

from dedupe_worker._settings import ACCELERATORS_OFF_ENV as PURE_PYTHON_ENV
from dedupe_worker._transport import held
from dedupe_worker._transport.held import direct_packer

_resp: Any
try:
    from dedupe_worker import _resp
except ImportError:
    _resp = None

needs_resp = pytest.mark.skipif(_resp is None, reason="dedupe_worker._resp is not compiled here")


def _set(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0")


def test_the_compiled_packer_is_built_where_it_should_be() -> None:
    """In CI a missing extension (a broken build hook, no compiler) fails the run, not skips it;
    an editable install's build older than its source is a stale one."""
    if _set(PURE_PYTHON_ENV) or _set("DEDUPE_NO_EXTENSIONS"):
        pytest.skip("the pure-Python path was asked for")
    if _resp is None:
        in_ci = os.environ.get("CI") == "true"
        assert not in_ci, "dedupe_worker._resp did not build: see hatch_build.py's warning"
        pytest.skip("dedupe_worker._resp is not compiled here (no C compiler at install?)")
    built = Path(_resp.__file__)
    source = built.with_name("_resp.c")
    if source.exists() and built.parent == source.parent:  # an editable install: built beside the source
        assert built.stat().st_mtime >= source.stat().st_mtime, "stale build: run `make install` again"


def both(args: Any) -> tuple[Any, Any]:
    """What each packer makes of ``args``: its bytes, or its exception's type and message."""
    out = []
    for pack in (_resp.pack_command, hiredis.pack_command):
        try:
            out.append(pack(args))
        except Exception as exc:
            out.append((type(exc), str(exc)))
    return out[0], out[1]


def assert_same(args: Any) -> None:
    ours, theirs = both(args)
    assert ours == theirs, args


class Str(str):
    pass


class Bytes(bytes):
    pass


class Float(float):
    pass


class Reprs(float):
    def __repr__(self) -> str:
        return "not a number at all \u00e9"


class Color(enum.IntEnum):
    RED = 1


class Int(int):
    pass


def random_arg(rng: random.Random) -> Any:
    """One argument of any kind hiredis packs, weighted towards the awkward ones."""
    kind = rng.randrange(14)
    if kind == 0:
        return "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(0, 40)))
    if kind == 1:  # any code point but the surrogates: two-, three- and four-byte UTF-8
        return "".join(chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x800, 0xD800),
                                       rng.randrange(0xE000, 0x110000)])) for _ in range(rng.randrange(0, 12)))
    if kind == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    if kind == 3:
        return rng.choice(["", b"", 0, -0, 1, -1, 9, 10, -10, 99, 100, -100])
    if kind == 4:
        return rng.randrange(-(10 ** rng.randrange(1, 19)), 10 ** rng.randrange(1, 19))
    if kind == 5:  # around and beyond the 64-bit boundaries
        return rng.choice([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, -(2**64)]) + rng.randrange(-2, 3)
    if kind == 6:
        return rng.choice([1, -1]) * rng.randrange(10**20, 10**rng.randrange(21, 400))
    if kind == 7:
        return rng.choice([0.0, -0.0, 0.5, -1.5, 1e16, 1e-7, 1e100, 5e-324, 1.7976931348623157e308,
                           math.inf, -math.inf, math.nan, 0.1, 1 / 3, 123456789.0, -2.5e-10])
    if kind == 8:
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randrange(-30, 30)
    if kind == 9:
        return rng.choice([memoryview(b"abc"), memoryview(b""), memoryview(bytearray(b"\x00\xff")),
                           memoryview(array.array("i", [1, -2, 3])), memoryview(b"0123456789")[2:7]])
    if kind == 10:
        return rng.choice([Str("sub\u00e9"), Bytes(b"sub"), Float(2.5), Reprs(1.0)])
    if kind == 11:
        return "x" * rng.randrange(0, 3000)
    if kind == 12:
        return rng.choice(["ns:{k\u00e9}:started", "EVALSHA", "FCALL", "0" * 40, "\U0001f600\U00010348"])
    return rng.randrange(0, 100_000)


@needs_resp
def test_the_same_bytes_as_hiredis_over_random_commands() -> None:
    rng = random.Random(20261126)
    for _ in range(3000):
        args = tuple(random_arg(rng) for _ in range(rng.randrange(0, 12)))
        ours, theirs = both(args)
        assert isinstance(ours, bytes) and ours == theirs, args


@needs_resp
@pytest.mark.parametrize("count", [0, 1, 255, 256, 257, 5000])
def test_the_same_bytes_for_short_and_long_commands(count: int) -> None:
    """Up to 256 arguments are described on the stack, more on the heap: both the same."""
    rng = random.Random(count)
    assert_same(tuple(random_arg(rng) for _ in range(count)))
    assert_same(("FCALL", "dedupe_x", count, *(f"ns:{{k{i}}}" for i in range(count)), *range(count)))


@needs_resp
def test_every_integer_length_and_sign() -> None:
    for digits in range(1, 25):
        for value in (10 ** (digits - 1), 10**digits - 1, 10 ** (digits - 1) + 7):
            assert_same((value, -value))
    assert_same((0, -(2**63), 2**63 - 1, 2**63, -(2**63) - 1, 10**4000, -(10**4000)))


@needs_resp
def test_a_claim_of_32_keys_is_packed_as_hiredis_packs_it() -> None:
    keys = [f"dedupe:{{order-{i}\u00e9}}:{part}" for i in range(32) for part in ("started", "result", "")][:96]
    argv = [1764000000123, 30000, 86400000, *(f"order-{i}" for i in range(32)), b"\x00" * 8, 0.25, -1, ""]
    assert_same(("FCALL", "dedupe_claim_0123abcd", len(keys), *keys, *argv))
    assert_same(("EVALSHA", "f" * 40, len(keys), *keys, *argv))


@needs_resp
@pytest.mark.parametrize("item", [
    "\ud800", "a\udfffb", "\U0001f600\udc80",  # lone surrogates: UnicodeEncodeError
    None, True, False, Color.RED, Int(3), bytearray(b"x"), object(), [1], ("nested",), {"a": 1}, 1j,
    __import__("decimal").Decimal("1.5"), __import__("fractions").Fraction(1, 3),
])
def test_the_same_exception_for_an_argument_hiredis_refuses(item: Any) -> None:
    ours, theirs = both(("SET", "k", item))
    assert isinstance(ours, tuple) and ours == theirs
    ours, theirs = both(("SET", item, b"\xff" * 300, 10**30))  # refused before or after others
    assert isinstance(ours, tuple) and ours == theirs


@needs_resp
@pytest.mark.parametrize("args", [["SET", "k", "v"], "SET k v", b"SET", None, 5, iter(("SET",)), {"SET": 1}])
def test_the_same_exception_for_arguments_that_are_not_a_tuple(args: Any) -> None:
    """A list too: hiredis refuses it, so a caller that passed one would fail only on the
    fallback path."""
    ours, theirs = both(args)
    assert isinstance(ours, tuple) and ours[0] is TypeError and ours == theirs


@needs_resp
def test_a_tuple_subclass_is_packed() -> None:
    class Args(tuple[Any, ...]):
        pass

    assert_same(Args(("GET", "k")))


@needs_resp
def test_where_hiredis_reads_memory_it_does_not_own_the_compiled_packer_raises() -> None:
    """hiredis crashes on an int str() refuses and on a failing __repr__, and reads a released or
    strided memoryview's buffer as if it were whole: we raise instead (none of these is ever sent
    by the protocol, hence no comparison)."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()  # 3.10.7+; 0: no limit
    if limit:
        with pytest.raises(ValueError, match="digits"):
            _resp.pack_command(("SET", "k", 10 ** (limit + 1)))
    released = memoryview(b"abcdef")
    released.release()
    with pytest.raises(ValueError):
        _resp.pack_command(("SET", released))
    with pytest.raises(BufferError):
        _resp.pack_command(("SET", memoryview(b"abcdef")[::2]))

    class Failing(float):
        def __repr__(self) -> str:
            raise KeyError("no repr")

    with pytest.raises(KeyError):
        _resp.pack_command(("SET", "k", Failing(1.0)))


@needs_resp
def test_temporaries_are_released_on_success_and_on_failure() -> None:
    """A float's repr() is held until the bytes are built, then released (also when a later
    argument is refused)."""
    class Text(str):
        pass

    made: list[weakref.ref[Text]] = []

    class Tracked(float):
        def __repr__(self) -> str:
            text = Text("1.5")
            made.append(weakref.ref(text))
            return text

    assert _resp.pack_command(("SET", Tracked(1.5))) == b"*2\r\n$3\r\nSET\r\n$3\r\n1.5\r\n"
    with pytest.raises(TypeError):
        _resp.pack_command(("SET", Tracked(1.5), None))
    assert len(made) == 2 and all(ref() is None for ref in made)


@needs_resp
def test_a_packed_script_call_round_trips_through_redis(redis_client: redis.Redis) -> None:
    """EVALSHA (and FCALL on Redis 7+) packed by the compiled packer, sent raw: the script sees
    every key and argument as hiredis' bytes would give them."""
    script = "return {KEYS, ARGV}"
    sha = redis_client.script_load(script)
    keys = [f"t:{{resp-{i}\u00e9}}:started" for i in range(32)]
    argv = [0, -12, 2**63 - 1, -(2**63), 10**30, 0.5, -0.0, b"\x00\xff\r\n", "", "\U0001f600", *range(100)]
    sent = [a if isinstance(a, bytes) else a.encode() if isinstance(a, str) else repr(a).encode() for a in argv]
    expected = [[k.encode() for k in keys], sent]
    commands = [("EVALSHA", sha, len(keys), *keys, *argv)]
    if int(redis_client.info("server")["redis_version"].split(".")[0]) >= 7:
        library = "#!lua name=dedupe_resp_test\nredis.register_function('dedupe_resp_echo', " \
                  "function(keys, args) return {keys, args} end)"
        redis_client.function_load(library, replace=True)
        commands.append(("FCALL", "dedupe_resp_echo", len(keys), *keys, *argv))
    raw = redis.Redis(connection_pool=redis_client.connection_pool, single_connection_client=True)
    connection: Any = raw.connection  # one connection of the pool, on every redis-py we support
    try:
        for command in commands:
            packed = _resp.pack_command(command)
            assert packed == hiredis.pack_command(command)
            connection.send_packed_command([packed])
            assert connection.read_response() == expected
    finally:
        raw.close()
        if len(commands) > 1:
            redis_client.function_delete("dedupe_resp_test")


@needs_resp
def test_direct_packer_chooses_the_compiled_packer(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
    client = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        assert direct_packer(client.connection) is _resp.pack_command
    finally:
        client.close()


def test_direct_packer_chooses_hiredis_under_pure_python(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    client = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        assert direct_packer(client.connection) is hiredis.pack_command
        monkeypatch.setenv(PURE_PYTHON_ENV, "0")  # "0" is off, as unset
        assert direct_packer(client.connection) is (_resp.pack_command if _resp is not None else hiredis.pack_command)
    finally:
        client.close()


def test_a_compiled_packer_that_packs_otherwise_is_passed_over(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe decides: a packer whose bytes differ from the connection's (here a stand-in that
    lower-cases, or one that refuses the probe) is not chosen; hiredis is, and with neither, the
    connection's own."""
    monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)

    def lower(args: tuple[Any, ...]) -> bytes:
        return bytes(hiredis.pack_command(args)).lower()

    def refuses(args: tuple[Any, ...]) -> bytes:
        raise TypeError("no floats")

    client = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        for stand_in in (lower, refuses):
            monkeypatch.setattr(held, "compiled_pack", stand_in)
            assert direct_packer(client.connection) is hiredis.pack_command
        monkeypatch.setattr(held, "hiredis_pack", lower)
        assert direct_packer(client.connection) is None
    finally:
        client.close()


@needs_resp
def test_the_held_connection_packs_with_the_compiled_packer(redis_client: redis.Redis,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
    connection = held.HeldConnection(redis_client)
    try:
        assert connection.execute("ECHO", "\u00e9") == "\u00e9".encode()
        assert connection._pack is _resp.pack_command
        replies = connection.execute_many([("ECHO", 1), ("ECHO", b"x"), ("SET",)])
        assert replies[:2] == [b"1", b"x"] and isinstance(replies[2], redis.ResponseError)
    finally:
        connection.close()
