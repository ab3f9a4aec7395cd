"""A request body read once, bounded, hashed as it arrives, and handed on to the app.

The fingerprint needs the whole body before the claim, and the app needs it again after. A
:class:`Body` is fed the chunks as the server gives them: it hashes each one (sha256, the same
digest :func:`~dedupe_worker._protocol.fingerprint.content_hash` gives of the whole), keeps the
first :data:`IN_MEMORY` bytes in memory and spools the rest to a temporary file, and refuses a
chunk that takes it past ``limit`` (the caller answers 413 and reads no further). So a request
costs at most ``IN_MEMORY`` bytes of memory whatever its size, and at most ``limit`` bytes of
disk, and none of it once :meth:`close` ran.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from typing import IO

__all__ = ["CHUNK", "IN_MEMORY", "Body", "declared_length"]

#: Bytes of a body kept in memory; beyond it, the body is spooled to a temporary file.
IN_MEMORY = 1024 * 1024
#: Bytes read (and handed to the app) at a time from a spooled body or a WSGI input.
CHUNK = 64 * 1024


def declared_length(value: str | None) -> int | None:
    """A ``Content-Length`` value as a number, ``None`` when absent or not one."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


class Body:
    """The request body as it was received, at most ``limit`` bytes."""

    __slots__ = ("_chunks", "_hash", "_spool", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._hash = hashlib.sha256()
        self._chunks: list[bytes] = []
        self._spool: IO[bytes] | None = None

    def feed(self, chunk: bytes) -> bool:
        """Take the next chunk; ``False`` (and nothing kept) when it takes the body past ``limit``."""
        if not chunk:
            return True
        self.size += len(chunk)
        if self.size > self.limit:
            return False
        self._hash.update(chunk)
        if self._spool is not None:
            self._spool.write(chunk)
        elif self.size > IN_MEMORY:
            # a real file from here on: SpooledTemporaryFile would hold the first IN_MEMORY bytes twice
            self._spool = tempfile.TemporaryFile()
            for kept in self._chunks:
                self._spool.write(kept)
            self._spool.write(chunk)
            self._chunks = []
        else:
            self._chunks.append(chunk)
        return True

    def digest(self) -> str:
        """The body's hash, as ``content_hash(body)`` writes it."""
        return self._hash.hexdigest()[:32]

    def whole(self) -> bytes | None:
        """The body as one ``bytes`` when it is held in memory, else ``None``."""
        if self._spool is not None:
            return None
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)

    def stream(self) -> IO[bytes]:
        """A file positioned at the start of the body (the spool itself, or a memory copy)."""
        if self._spool is None:
            import io

            return io.BytesIO(self.whole() or b"")
        self._spool.seek(0)
        return self._spool

    def chunks(self) -> Iterator[bytes]:
        """The body again, in chunks of at most :data:`CHUNK` bytes (one, when in memory)."""
        whole = self.whole()
        if whole is not None:
            yield whole
            return
        stream = self.stream()
        while True:
            chunk = stream.read(CHUNK)
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        """Drop what is kept (the temporary file is deleted)."""
        self._chunks = []
        if self._spool is not None:
            self._spool.close()
            self._spool = None
