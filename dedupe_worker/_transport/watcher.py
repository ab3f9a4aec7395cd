"""One thread that waits on many held keys at once and calls back when each is decided.

A deliberate twin of :mod:`dedupe_worker._transport.async_waiter` (a thread here, a task per loop there).

A consumer that meets a key in progress elsewhere can hand the key to a :class:`KeyWatcher`
instead of sleeping on it: ``watch.lua`` counts a waiter on the key, and the thread blocks (one
``BLPOP`` over the notice lists of every watched key, plus a private wake-up list) until the
holder's ``complete.lua`` or ``release.lua`` pushes a notice, or the key's deadline (the holder's
remaining lease, or the caller's limit) passes. Either way the callback runs once, in the watcher
thread: it must be quick (e.g. mark a partition for resuming, queue a message for re-decision).

Nothing here changes a claim: the callback only says "decide this again now". A notice that is
missed (Redis down, the watcher closed) only means the deadline fires instead. On a Redis Cluster
one ``BLPOP`` cannot span slots, so the watcher there wakes at the deadlines only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .._errors import StoreUnavailable
from .._protocol import KeyLayout
from .store import RedisStore

__all__ = ["KeyWatcher", "Watched"]

W = TypeVar("W")

log = logging.getLogger(__name__)


@dataclass
class Watched(Generic[W]):
    """A watched key, for the sync watcher and the asyncio waiter alike: when to stop waiting on
    it (its holder's lease ends, or the earliest waiter's timeout), and who waits for it
    (callbacks here, futures on asyncio)."""

    deadline: float
    waiters: list[W] = field(default_factory=list)


class KeyWatcher:
    """Calls back when watched keys are decided, or at their deadline; one thread per watcher,
    started on first use (and again after ``fork()``)."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._wake = f"{store.layout.namespace}:{{watcher-{uuid.uuid4().hex}}}:wake"
        self._watched: dict[str, Watched[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._closed = False

    def watch(self, stem: str, callback: Callable[[], None], timeout: float) -> None:
        """Call ``callback`` once the key of ``stem`` is completed or released, or after
        ``timeout`` seconds, whichever is first; at once when no live lease holds it now."""
        with self._lock:
            known = self._watched.get(stem)
            if known is not None:
                known.waiters.append(callback)
                known.deadline = min(known.deadline, time.monotonic() + timeout)
                return
        try:
            holder_left = self.store.watch(stem)
        except StoreUnavailable as exc:
            log.warning("cannot watch %s, relying on its deadline: %s", stem, exc)
            holder_left = timeout
        if holder_left <= 0:
            callback()
            return
        with self._lock:
            self._watched.setdefault(stem, Watched(time.monotonic() + min(timeout, holder_left + 0.01))) \
                .waiters.append(callback)
            self._ensure_thread()
        self._interrupt()

    def close(self) -> None:
        """Stop the thread; watched keys get no callback."""
        self._closed = True
        self._interrupt()

    def _ensure_thread(self) -> None:
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._closed = False
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._loop, name="dedupe-key-watcher", daemon=True)
            self._thread.start()

    def _interrupt(self) -> None:
        """Wake the thread's blocking wait so it picks up new keys (or sees ``close``)."""
        if self.store.scripts.is_cluster or self._thread is None:
            return
        try:
            self.store.wake_pipeline(self._wake).execute()
        except Exception as exc:  # the deadline still fires
            log.debug("could not wake the key watcher: %s", exc)

    def _fire(self, stems: list[str]) -> None:
        with self._lock:
            due = [self._watched.pop(stem) for stem in stems if stem in self._watched]
        for watched in due:
            for callback in watched.waiters:
                try:
                    callback()
                except Exception:
                    log.exception("key watcher callback failed")

    def _loop(self) -> None:
        client = self.store.client
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                expired = [stem for stem, w in self._watched.items() if w.deadline <= now]
                stems = [stem for stem in self._watched if stem not in expired]
                nearest = min((w.deadline for w in self._watched.values()), default=now + 60)
            self._fire(expired)
            timeout = max(0.005, min(nearest - now, self.store.max_block))
            if self.store.scripts.is_cluster:
                time.sleep(min(timeout, 0.05))
                continue
            try:
                reply = client.blpop([self._wake, *(KeyLayout.notice(s) for s in stems)], timeout=timeout)
            except Exception as exc:
                log.warning("key watcher cannot reach Redis, relying on deadlines: %s", exc)
                time.sleep(min(timeout, 0.5))
                continue
            stem = self.store.noticed(reply, self._wake)
            if stem is not None:
                self._fire([stem])
