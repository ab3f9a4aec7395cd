"""Notices of completed or released keys, for waiters: the SQL store's ``BLPOP``.

On Redis, ``complete.lua`` and ``release.lua`` push one notice per counted waiter on the key's
notice list and the waiter blocks on it (``BLPOP``). The SQL store keeps the same shape in one
process-wide object per pool: :meth:`Notices.blpop` takes the same Redis key names (the notice
lists ``<stem>:notice`` and a waiter's private wake-up name) and answers as ``BLPOP`` does.
Where the notices come from differs:

* PostgreSQL: the transitions ``pg_notify('dedupe_notice', md5(stem) || ':' || waiters)`` on
  commit; one thread per pool ``LISTEN``\\ s on one connection and counts them. ``listen()`` starts
  it before a waiter is counted (``watch``), so no notice is missed between the two.
* MySQL/MariaDB have nothing like it: :class:`PolledNotices` looks at the watched rows every
  :data:`POLL_INTERVAL` seconds and answers for a key whose lease is gone (done, released, lapsed).

A notice unread for :data:`NOTICE_TTL` seconds is dropped, as the notice list expires on Redis. A
missed or extra notice changes no claim: the waiter claims again, at its holder's lease end at
the latest.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._protocol import NOTICE

__all__ = ["NOTICE_TTL", "POLL_INTERVAL", "Notices", "PolledNotices", "Wake"]

log = logging.getLogger(__name__)

NOTICE_TTL = 10.0
POLL_INTERVAL = 0.02


def notice_id(stem: str) -> str:
    """The payload a transition notifies for ``stem``: the md5 of its bytes, as ``md5(bytea)``."""
    return hashlib.md5(stem.encode("utf-8"), usedforsecurity=False).hexdigest()


class Notices:
    """Counted notices by key, and the private wake-ups of waiters (see the module doc)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: notice id -> [(arrived, count)]
        self._pending: dict[str, list[tuple[float, int]]] = {}
        self._woken: set[str] = set()

    def listen(self) -> None:
        """Make sure notices are received from now on (before a waiter is counted)."""

    def add(self, ident: str, count: int) -> None:
        with self._cond:
            self._pending.setdefault(ident, []).append((time.monotonic(), count))
            self._cond.notify_all()

    def wake(self, name: str) -> None:
        """Push the wake-up ``name``: a ``blpop`` waiting on it returns."""
        with self._cond:
            self._woken.add(name)
            self._cond.notify_all()

    def _take(self, wanted: dict[str, str], wakes: Sequence[str]) -> list[Any] | None:
        for name in wakes:
            if name in self._woken:
                self._woken.discard(name)
                return [name.encode(), b"1"]
        now = time.monotonic()
        for ident, name in wanted.items():
            entries = [(at, n) for at, n in self._pending.get(ident, ()) if now - at < NOTICE_TTL]
            if entries:
                at, n = entries[0]
                entries[0:1] = [(at, n - 1)] if n > 1 else []
                self._pending[ident] = entries
                return [name.encode(), b"1"]
            self._pending.pop(ident, None)
        return None

    def blpop(self, keys: Sequence[str], timeout: float = 0) -> list[Any] | None:
        """``BLPOP keys timeout``: ``[name, value]`` of the first notice (or wake-up) found, or
        ``None`` after ``timeout`` seconds."""
        wanted = {notice_id(k[: -len(NOTICE)]): k for k in keys if k.endswith(NOTICE)}
        wakes = [k for k in keys if not k.endswith(NOTICE)]
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = self._take(wanted, wakes)
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    return found
                self._cond.wait(left)

    def close(self) -> None:
        """Stop receiving notices."""


class PgNotices(Notices):
    """Notices received on a PostgreSQL ``LISTEN dedupe_notice`` connection, by one thread."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        super().__init__()
        self._connect = connect
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._closed = False

    def listen(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._closed = False
                self._ready.clear()
                self._thread = threading.Thread(target=self._run, name="dedupe-sql-notices", daemon=True)
                self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        while not self._closed:
            try:
                conn = self._connect()
            except Exception as exc:
                log.warning("cannot listen for notices, waiters rely on lease deadlines: %s", exc)
                self._ready.set()
                time.sleep(0.5)
                continue
            try:
                conn.execute("LISTEN dedupe_notice")
                self._ready.set()
                while not self._closed:
                    for notify in conn.notifies(timeout=0.5):
                        ident, _, count = notify.payload.partition(":")
                        self.add(ident, int(count or 1))
            except Exception as exc:
                log.warning("lost the notice connection, listening again: %s", exc)
            finally:
                conn.close()

    def close(self) -> None:
        self._closed = True


class PolledNotices(Notices):
    """Notices found by looking at the watched rows (MySQL/MariaDB): ``gone(stems)`` answers which
    of them no live lease holds any more."""

    def __init__(self, gone: Callable[[list[str]], list[str]]) -> None:
        super().__init__()
        self._gone = gone
        self._watched: dict[str, str] = {}

    def blpop(self, keys: Sequence[str], timeout: float = 0) -> list[Any] | None:
        stems = {k[: -len(NOTICE)]: k for k in keys if k.endswith(NOTICE)}
        deadline = time.monotonic() + timeout
        while True:
            found = super().blpop([k for k in keys if not k.endswith(NOTICE)], 0)
            if found is not None:
                return found
            if stems:
                gone = self._gone(list(stems))
                if gone:
                    return [stems[gone[0]].encode(), b"1"]
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with self._cond:
                self._cond.wait(min(left, POLL_INTERVAL))


class Wake:
    """What ``wake_pipeline`` gives on the SQL store: ``execute()`` pushes a waiter's wake-up
    (awaitable as well, for the asyncio waiter)."""

    def __init__(self, notices: Notices, name: str) -> None:
        self.notices = notices
        self.name = name

    def execute(self) -> Any:
        self.notices.wake(self.name)
        return _done()


class _done:
    def __await__(self) -> Any:
        return iter(())
