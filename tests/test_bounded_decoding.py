"""Stored values are untrusted input: decompression stops at a bound tied to ``max_result_bytes``
(``decoded_limit``), past it the value is answered :data:`OMITTED` (logged once), and memory stays
bounded. The bomb of the review: a record of a few KB (zstd, zlib) that inflates to 256 MB, read by
a duplicate claim in a fresh process whose peak RSS is measured around the claim."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import zlib

import pytest
import redis

from dedupe_worker import OMITTED, Deduplicator, Outcome, Reason, decide_many
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker._protocol.serialization import (
    CODECS,
    MARK,
    MIN_DECODED,
    Packer,
    TooLarge,
    decoded_limit,
    inflate,
    unpack,
)

#: What the bomb inflates to: a JSON list of zeros, 256 MB.
BOMB_BYTES = 256 << 20
_CHUNK = b"0," * (1 << 19)  # 1 MiB


def _bomb_chunks() -> list[bytes]:
    """The bomb's plain bytes as chunks (never held whole): ``[0,0,...,0]``, BOMB_BYTES long."""
    return [b"["] + [_CHUNK] * (BOMB_BYTES // len(_CHUNK)) + [b"0]"]


def zstd_bomb() -> bytes:
    """A one-shot zstd frame that declares its 256 MB content size (what ``decompress()`` allocates)."""
    zstandard = pytest.importorskip("zstandard")
    compressor = zstandard.ZstdCompressor(level=19, write_content_size=True).compressobj(
        size=sum(map(len, _bomb_chunks())))
    return MARK + b"s" + b"".join(compressor.compress(chunk) for chunk in _bomb_chunks()) + compressor.flush()


def zstd_streamed_bomb() -> bytes:
    """A zstd frame that declares no size: only the streaming bound stops it."""
    zstandard = pytest.importorskip("zstandard")
    compressor = zstandard.ZstdCompressor(level=19).compressobj()
    return MARK + b"s" + b"".join(compressor.compress(chunk) for chunk in _bomb_chunks()) + compressor.flush()


def zlib_bomb() -> bytes:
    compressor = zlib.compressobj(9)
    return MARK + b"z" + b"".join(compressor.compress(chunk) for chunk in _bomb_chunks()) + compressor.flush()


#: Run in a fresh process: claim the bombs as duplicates (one key each, then both in a batch) and
#: print the peak RSS growth around those claims and what they answered.
_CLAIMS = textwrap.dedent("""
    import json, resource, sys, tracemalloc
    import redis
    from dedupe_worker import OMITTED, Deduplicator, decide_many
    url, namespace, keys = sys.argv[1], sys.argv[2], sys.argv[3:]
    dedupe = Deduplicator(redis.Redis.from_url(url), namespace=namespace, lease=5.0)
    dedupe.run("warm-up", lambda: None)  # scripts loaded, connection open: outside the measure
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    claims = [dedupe.begin(key) for key in keys]
    batch = decide_many(dedupe, [(key, None, lambda: "ran") for key in keys])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_kb": after - before, "peak_kb": peak // 1024,
                      "claims": [[c.outcome.name, c.result is OMITTED] for c in claims],
                      "batch": [[d.reason.value, d.value is OMITTED] for d in batch]}))
    dedupe.close()
""")


@pytest.mark.parametrize("record_format", [1, 2])
def test_a_256_mb_bomb_on_a_duplicate_claim_is_omitted_and_memory_stays_bounded(
        redis_client: redis.Redis, redis_url: str, namespace: str, record_format: int) -> None:
    bombs = {"zlib": zlib_bomb()}
    if "zstd" in CODECS:
        bombs["zstd"], bombs["zstd-streamed"] = zstd_bomb(), zstd_streamed_bomb()
    for codec, bomb in bombs.items():
        assert len(bomb) < 300_000, (codec, len(bomb))  # a few KB (zstd) to a few hundred (zlib)
        stem = f"{namespace}:{{{codec}}}"
        if record_format == 1:
            redis_client.hset(KeyLayout.result(stem), mapping={"s": "c", "v": bomb, "t": 7})
        else:
            redis_client.set(stem, b"c" + (7).to_bytes(8, "big") + bomb)
    run = subprocess.run([sys.executable, "-c", _CLAIMS, redis_url, namespace, *bombs],
                         capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["claims"] == [["DUPLICATE", True]] * len(bombs)
    assert seen["batch"] == [["duplicate", True]] * len(bombs)
    # peak RSS growth (and the Python heap's peak: allocations RSS's peak could hide) under 32 MB, not 256 MB
    assert seen["growth_kb"] < 32 * 1024 and seen["peak_kb"] < 32 * 1024, seen
    assert run.stderr.count("decompress past") == len(bombs)  # logged once per value, not per claim


@pytest.mark.parametrize("codec", CODECS)
def test_unpack_stops_at_the_limit_and_reads_what_fits(codec: str) -> None:
    packer = Packer(0, codec)
    value = b"[" + b"1," * 300_000 + b"1]"
    packed = packer.pack(value)
    assert unpack(packed, len(value)) == value
    with pytest.raises(TooLarge):
        unpack(packed, len(value) - 1)
    with pytest.raises(Exception):  # noqa: B017 - what the codec raises for a value cut short
        unpack(packed[:-8], len(value))


def test_inflate_reads_zlib_and_gzip_within_the_bound() -> None:
    body = b"x" * 100_000
    assert inflate(zlib.compress(body), len(body)) == body
    gzipped = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    data = gzipped.compress(body) + gzipped.flush()
    assert inflate(data, len(body), 16 + zlib.MAX_WBITS) == body
    with pytest.raises(TooLarge):
        inflate(data, len(body) - 1, 16 + zlib.MAX_WBITS)
    with pytest.raises(zlib.error):
        inflate(zlib.compress(body)[:-10], len(body))


def test_the_bound_is_tied_to_max_result_bytes() -> None:
    assert decoded_limit(1_000_000) == 16_000_000
    assert decoded_limit(0) == decoded_limit(1000) == MIN_DECODED
    assert Deduplicator(redis.Redis(), max_result_bytes=2_000_000).decode_limit == 32_000_000


def test_a_result_serialised_past_the_bound_is_stored_omitted_and_what_fits_reads_back(
        redis_client: redis.Redis, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    """A result that compresses under ``max_result_bytes`` but whose JSON is past the bound is stored
    omitted (a duplicate could not read it back); one within the bound reads back whole. A value
    past the bound found in Redis (written by something else) is OMITTED and logged once however
    often it is claimed."""
    dedupe = Deduplicator(redis_client, namespace=namespace, max_result_bytes=60_000, lease=5.0)
    assert dedupe.decode_limit == MIN_DECODED
    fits, too_big = "a" * (MIN_DECODED - 100), "a" * (MIN_DECODED + 1)
    results = decide_many(dedupe, [("fits", None, lambda: fits), ("too-big", None, lambda: too_big)])
    assert [d.reason for d in results] == [Reason.APPLIED, Reason.APPLIED]
    assert dedupe.begin("fits").result == fits
    assert dedupe.begin("too-big").result is OMITTED
    packed = Packer(0).pack(json.dumps("b" * (2 * MIN_DECODED)).encode())
    redis_client.hset(KeyLayout.result(f"{namespace}:{{found}}"), mapping={"s": "c", "v": packed, "t": 3})
    with caplog.at_level(logging.WARNING, logger="dedupe_worker._protocol.codec"):
        claims = [dedupe.begin("found") for _ in range(3)]
    assert [(c.outcome, c.result is OMITTED) for c in claims] == [(Outcome.DUPLICATE, True)] * 3
    assert len([r for r in caplog.records if "decompress past" in r.getMessage()]) == 1
    dedupe.close()
