"""One background thread that keeps every live claim's lease from running out.

A deliberate twin of :mod:`dedupe_worker._transport.async_renewer` (a thread here, a task per event loop
there): what a round does and when a refusal is a loss is shared (:mod:`~dedupe_worker._protocol.leases`).

The renewer wakes every ``interval`` seconds (a third of the lease by default) and extends all
tracked leases in one batched ``renew.lua`` round trip, so a thousand in-flight messages cost one
thread and one round trip per interval, not a thread each. A claim that renewal finds no longer
ours is marked lost; completing it then raises :class:`~dedupe_worker.LeaseLost` (the completion
script would refuse it anyway). If Redis is unreachable the renewer logs and keeps trying; the
lease may then expire and another worker may take over, which the fencing token makes safe.

The thread is started on first use and again after ``fork()`` (Celery prefork children). A
forked child tracks none of its parent's leases: the table is emptied in the child at the fork,
so the child renews only the claims it takes itself, and a parent that dies has its leases run
out on time whatever its children do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._protocol import Lease, LeaseBook, Renewed, forget_after_fork

__all__ = ["LeaseRenewer"]

log = logging.getLogger(__name__)


class LeaseRenewer:
    """Renews the leases of tracked claims, identified by ``(stem, token)``."""

    def __init__(
        self,
        renew_round: Callable[[list[Lease], Callable[[Lease], bool]], Renewed | None],
        interval: float,
        on_lost: Callable[[str, int], None] | None = None,
    ) -> None:
        #: Runs one round (the client's ``renewal_flow``, driven): ``(began, lost)`` or ``None``.
        self.renew_round = renew_round
        self.interval = interval
        self.on_lost = on_lost
        self._book = LeaseBook()
        self._live = self._book.live  # (stem, token) -> how many holders
        self._lost = self._book.lost
        # The book's per-message steps, bound once (called under the lock).
        self._untrack, self._settle = self._book.untrack, self._book.settle
        #: ``time.monotonic()`` at the start of the last renewal round Redis answered.
        self.renewed_at = float("-inf")
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        forget_after_fork(self)

    def track(self, stem: str, token: int) -> None:
        """Keep this claim's lease alive until :meth:`untrack` (starts the thread if none runs)."""
        lease, live = (stem, token), self._live
        with self._lock:  # one message's claim: the per-message path, so no loop over one lease
            live[lease] = live.get(lease, 0) + 1
            if self._thread is None or self._closed:  # (a forked child's was reset at the fork)
                self._start()

    def untrack(self, stem: str, token: int) -> None:
        """Stop renewing the lease of ``(stem, token)`` (once per :meth:`track`)."""
        with self._lock:
            self._untrack((stem, token))

    def track_many(self, leases: Iterable[tuple[str, int]]) -> None:
        """:meth:`track` for several ``(stem, token)`` at once (one lock, one thread check)."""
        live = self._live
        with self._lock:
            for lease in leases:
                live[lease] = live.get(lease, 0) + 1
            if self._thread is None or self._closed:
                self._start()

    def track_group(self, claims: Sequence[Any]) -> int:
        """Keep the leases of ``claims`` (a batch's, with ``stem`` and ``token``) alive as one
        group until :meth:`untrack_group`; returns the group's id (see :class:`.leases.LeaseBook`)."""
        with self._lock:
            group = self._book.track_group(claims)
            if self._thread is None or self._closed:
                self._start()
        return group

    def settle_group(self, group: int) -> None:
        """:meth:`settle` for every claim of ``group``."""
        with self._lock:
            self._book.settle_group(group)

    def untrack_group(self, group: int) -> None:
        """Stop renewing the claims of ``group``."""
        with self._lock:
            self._book.untrack_group(group)

    def untrack_many(self, leases: Iterable[tuple[str, int]]) -> None:
        """Stop renewing ``(stem, token)`` leases (each once per :meth:`track`)."""
        with self._lock:
            for lease in leases:
                self._untrack(lease)

    def settle(self, leases: Iterable[Lease]) -> None:
        """The completion or release of ``leases`` is being sent: until they are untracked, a
        refused renewal of one of them is not a loss (see :mod:`~dedupe_worker._protocol.leases`)."""
        with self._lock:
            self._settle(leases)

    def is_lost(self, stem: str, token: int) -> bool:
        if not self._lost:  # the common case, read without the lock: an add racing this read
            return False    # could as well have come right after a locked read
        with self._lock:
            return (stem, token) in self._lost

    def last_renewal(self) -> float:
        """``time.monotonic()`` when the last successful renewal round began (``-inf``: none yet)."""
        return self.renewed_at

    def renew_now(self) -> None:
        """Renew every tracked lease once, in one round trip."""
        with self._lock:
            items = self._book.due()
        renewed = self.renew_round(items, self._refused)
        if renewed is None:
            return
        self.renewed_at, lost = renewed
        for stem, token in lost:
            if self.on_lost is not None:
                self.on_lost(stem, token)

    def _refused(self, lease: Lease) -> bool:
        with self._lock:
            return self._book.refused(lease)

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's leases are not ours to renew (its thread did not
        survive the fork, and a lock a parent thread held then would stay taken)."""
        self._lock = threading.Lock()
        self._book.clear()
        self._thread = None
        self._wake = threading.Event()
        self.renewed_at = float("-inf")

    def _start(self) -> None:
        self._closed = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(self._wake,), name="dedupe-lease-renewer",
                                        daemon=True)
        self._thread.start()

    def _loop(self, wake: threading.Event) -> None:
        try:
            while not wake.wait(self.interval) and not self._closed:
                try:
                    self.renew_now()
                except Exception:  # never let the renewer die silently
                    log.exception("lease renewer failed; continuing")
        finally:
            # However it ends, the next track() starts a new thread (it checks this, the close
            # flag and the process id, not is_alive(): that costs a lock of its own per call).
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

