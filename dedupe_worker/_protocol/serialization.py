"""How results are stored: JSON by default, never pickle.

Whoever can write to Redis must not get code execution in our workers, so data read back is only
ever parsed as JSON. Values go through orjson; pydantic models are stored as their JSON dump and
come back as plain dicts (re-validate them if you need the model). Dataclasses, ``datetime``,
``UUID`` and numpy-free builtins are handled by orjson. NaN and infinity are refused like any other
value JSON cannot hold (orjson would write them as ``null``, and a duplicate would get ``None``).

Large results are stored compressed (:class:`Packer`): zstd where it is installed (the
``zstandard`` package, or Python 3.14's ``compression.zstd``), else zlib. The stored bytes say
which: a packed value starts with ``0xC1`` and a letter naming the codec. ``0xC1`` never starts
JSON, UTF-8 text or msgpack (where it is reserved), so a value written before compression existed
(plain JSON) reads as it always did. :func:`unpack` gives the serializer's bytes back, whatever
packed them; nothing here does I/O.

Decompression is bounded: a stored value is untrusted input (whoever can write to Redis can
store a few KB that inflate to gigabytes), so :func:`unpack` is given the most bytes a value may
decompress to (:func:`decoded_limit`, tied to ``max_result_bytes``) and stops there, streaming,
with :class:`TooLarge`; memory stays within about that bound whatever the value claims.
:func:`inflate` is the same bound for a zlib or gzip stream (an HTTP body stored compressed).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import zlib
from collections.abc import Callable
from typing import Any

import orjson

from .._errors import ResultNotSerializable
from .._settings import ClientOptions, Serializer

__all__ = ["CODECS", "DECODED_PER_STORED", "MIN_DECODED", "JsonSerializer", "Packer", "Serializer", "TooLarge",
           "decoded_limit", "inflate", "unpack"]


def _default(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)  # pydantic v2 models
    if callable(dump):
        return dump(mode="json")
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if isinstance(value, bytes):
        raise TypeError("bytes are not JSON; return str or base64 text")
    raise TypeError(f"type {type(value).__name__} is not JSON serialisable")


def _non_finite(value: Any) -> float | None:
    """The first NaN or infinity inside ``value`` (as orjson walks it), else ``None``."""
    if isinstance(value, float):
        return None if math.isfinite(value) else value
    if isinstance(value, dict):
        for key, item in value.items():
            found = _non_finite(key) if isinstance(key, float) else None
            if found is None:
                found = _non_finite(item)
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple, set, frozenset)):
        items: Any = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, field.name) for field in dataclasses.fields(value)]
    elif callable(getattr(value, "model_dump", None)) and not isinstance(value, type):
        items = [value.model_dump()]  # pydantic writes NaN as null in JSON mode: look before it does
    else:
        return None
    for item in items:
        found = _non_finite(item)
        if found is not None:
            return found
    return None


class JsonSerializer:
    """The default :class:`Serializer`: compact JSON via orjson. Raises
    :class:`ResultNotSerializable` for a value JSON cannot hold, NaN and infinity included."""

    def dumps(self, value: Any) -> bytes:
        try:
            data = orjson.dumps(value, default=_default, option=orjson.OPT_NON_STR_KEYS)
        except (TypeError, orjson.JSONEncodeError) as exc:
            raise ResultNotSerializable(f"result cannot be stored as JSON: {exc}") from exc
        # orjson writes NaN and infinity as null, so only output holding a null needs the look
        if b"null" in data:
            found = _non_finite(value)
            if found is not None:
                raise ResultNotSerializable(f"result cannot be stored as JSON: it holds {found!r}, "
                                            "and JSON has no NaN or infinity")
        return data

    def loads(self, data: bytes | str) -> Any:
        return orjson.loads(data)


#: The first byte of every value :class:`Packer` marks; the next byte names the codec.
MARK = b"\xc1"
_ZLIB, _ZSTD, _PLAIN = MARK + b"z", MARK + b"s", MARK + b"="


#: How many bytes a stored value may decompress to, per byte of ``max_result_bytes`` (a stored
#: value is at most ``max_result_bytes``; a result whose serialised form is larger than this many
#: times that is stored as omitted, so whatever we write reads back).
DECODED_PER_STORED = 16
#: The least bound, whatever ``max_result_bytes`` (a stored failure is not held to it).
MIN_DECODED = 1 << 20


def decoded_limit(max_result_bytes: int) -> int:
    """The most bytes a stored value is decompressed to for a client of ``max_result_bytes``."""
    return max(MIN_DECODED, DECODED_PER_STORED * max_result_bytes)


class TooLarge(ValueError):
    """A compressed value decompresses to more than the bound it was read with; decompression
    stopped there (the rest was never produced)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the value decompresses to more than {limit} bytes")
        self.limit = limit


#: Output bytes produced per step of a bounded decompression: what it holds beyond the bytes kept
#: (one output buffer of ``limit`` bytes would be grown in blocks, then joined: twice that).
_STEP = 1 << 20


def inflate(data: bytes, limit: int, wbits: int = zlib.MAX_WBITS) -> bytes:
    """``zlib.decompress(data, wbits)`` that stops past ``limit`` output bytes (:class:`TooLarge`),
    holding about ``limit`` bytes at most meanwhile. ``wbits``: ``zlib.MAX_WBITS`` for zlib,
    ``16 + zlib.MAX_WBITS`` for gzip, ``-zlib.MAX_WBITS`` for raw deflate. Raises ``zlib.error``
    for a stream that is corrupt or ends early."""
    inflater = zlib.decompressobj(wbits)
    chunks, size, pending = [], 0, data
    while not inflater.eof:
        chunk = inflater.decompress(pending, min(_STEP, limit + 1 - size))
        pending = inflater.unconsumed_tail
        if not chunk and not pending:
            break  # the input ended before the stream did
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise TooLarge(limit)
    if not inflater.eof:
        raise zlib.error("incomplete or truncated stream")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _zstd() -> tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]] | None:
    """zstd's compress and (bounded: :class:`TooLarge` past the limit) decompress functions, from
    the stdlib (3.14+) or ``zstandard``; else ``None``."""
    try:
        from compression import zstd  # type: ignore[import-not-found,unused-ignore]

        def decompress_std(data: bytes, limit: int) -> bytes:
            out: bytes = zstd.ZstdDecompressor().decompress(data, max_length=limit + 1)
            if len(out) > limit:
                raise TooLarge(limit)
            return out

        return zstd.compress, decompress_std  # type: ignore[no-any-return,unused-ignore]
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        return None
    # A (de)compressor object is not thread-safe, and building one per call triples the cost of
    # a decompression: one of each per thread.
    local = threading.local()

    def compress(data: bytes) -> bytes:
        compressor = getattr(local, "compressor", None)
        if compressor is None:
            compressor = local.compressor = zstandard.ZstdCompressor(level=3)
        return compressor.compress(data)  # type: ignore[no-any-return,unused-ignore]

    def decompress(data: bytes, limit: int) -> bytes:
        decompressor = getattr(local, "decompressor", None)
        if decompressor is None:
            decompressor = local.decompressor = zstandard.ZstdDecompressor()
        # A one-shot frame carries its content size, which decompress() allocates whole, whatever
        # it is (a few KB can claim gigabytes): one past the limit is refused before any work, one
        # within it is decompressed at once (zstd checks the output is that size). A frame that
        # declares none is streamed, in steps, to the limit.
        declared = zstandard.frame_content_size(data)
        if declared > limit:
            raise TooLarge(limit)
        if declared >= 0:
            return decompressor.decompress(data)  # type: ignore[no-any-return,unused-ignore]
        chunks, size = [], 0
        with decompressor.stream_reader(data) as reader:
            while size <= limit:
                chunk = reader.read(min(_STEP, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        if size > limit:
            raise TooLarge(limit)
        return b"".join(chunks)

    return compress, decompress


_ZSTD_FUNCTIONS = _zstd()

#: The codecs this process can write: ``"zstd"`` (when installed) and ``"zlib"``.
CODECS: tuple[str, ...] = ("zstd", "zlib") if _ZSTD_FUNCTIONS else ("zlib",)


class Packer:
    """Compresses stored values over ``above`` bytes (``None``: never) with ``codec``:
    ``"auto"`` (zstd when installed, else zlib), ``"zstd"`` or ``"zlib"``.

    A value is kept compressed only when that makes it smaller. Every worker sharing a namespace
    must be able to read what the others write: one without zstd answers a zstd-packed result
    as omitted (logged), so install ``dedupe-worker[zstd]`` on all of them or pin ``"zlib"``.
    """

    def __init__(self, above: int | None = ClientOptions.compress_above,
                 codec: str = ClientOptions.compression) -> None:
        if above is not None and above < 0:
            raise ValueError(f"compress_above must not be negative, not {above!r}")
        if codec == "auto":
            codec = CODECS[0]
        if codec == "zstd" and _ZSTD_FUNCTIONS is None:
            raise ValueError("compression 'zstd' needs the zstandard package: pip install 'dedupe-worker[zstd]'")
        if codec not in ("zstd", "zlib"):
            raise ValueError(f"compression must be 'auto', 'zstd' or 'zlib', not {codec!r}")
        self.above = above
        self.codec = codec
        if codec == "zstd":
            assert _ZSTD_FUNCTIONS is not None
            self._mark, self._compress = _ZSTD, _ZSTD_FUNCTIONS[0]
        else:
            self._mark, self._compress = _ZLIB, zlib.compress

    def pack(self, data: bytes) -> bytes:
        """``data`` as stored: compressed and marked when over ``above`` bytes and smaller so;
        else as it is (marked as plain in the one case it starts with :data:`MARK` itself)."""
        if self.above is not None and len(data) > self.above:
            packed = self._mark + self._compress(data)
            if len(packed) < len(data):
                return packed
        if data[:1] == MARK:  # only a custom serializer's output can: keep it unambiguous
            return _PLAIN + data
        return data


def unpack(data: bytes | str, limit: int = MIN_DECODED) -> bytes | str:
    """The serializer's bytes of a stored value: decompressed when :class:`Packer` marked it (at
    most ``limit`` bytes: :class:`TooLarge` past them, decompression stopped there), else ``data``
    itself (a value written before compression existed). Raises ``ValueError`` for a codec this
    process cannot read, and what the decompressor raises for a corrupt value."""
    if type(data) is not bytes or data[:1] != MARK:
        return data
    kind = data[:2]
    if kind == _ZLIB:
        return inflate(data[2:], limit)
    if kind == _ZSTD:
        if _ZSTD_FUNCTIONS is None:
            raise ValueError("the value is zstd-compressed; install zstandard: pip install 'dedupe-worker[zstd]'")
        return _ZSTD_FUNCTIONS[1](data[2:], limit)
    if kind == _PLAIN:
        return data[2:]
    raise ValueError(f"unknown compression mark {kind!r}")
