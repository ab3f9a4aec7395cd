"""The SQL store's runner on MySQL / MariaDB (PyMySQL): each transition one transaction.

MySQL has no function that could return a batch's rows in one call, so a transition is a few
plain statements in one transaction, READ COMMITTED (no gap locks): the batch's rows made to
exist (``INSERT IGNORE`` of expired placeholders), locked (``SELECT ... FOR UPDATE``, in key
order: two batches sharing keys never deadlock), decided here from what was read, and written in
one multi-row upsert; then ``COMMIT``. The decision is the one each ``lua/*.lua`` script makes, and
the reply is the script's (:mod:`.calls`). The clock is the database's (``NOW(6)``, read in the
locking statement). A failure rolls the whole transition back and is
:class:`~dedupe_worker.StoreUnavailable`.

asyncio: PyMySQL is blocking and aiomysql is not a dependency, so :class:`AsyncMySqlRunner` runs
each round trip on a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Sequence
from typing import Any

import pymysql

from .._errors import StoreUnavailable
from .._protocol.scripts import Call
from .calls import SyncRunner, Transition, reply_of, transition_of
from .notices import PolledNotices
from .pool import SqlPool

__all__ = ["AsyncMySqlPool", "AsyncMySqlRunner", "MySqlPool", "MySqlRunner"]

_COLUMNS = ("stem", "owner", "next_token", "deadline", "fp", "orig", "waiters", "status", "token", "value",
            "expires_at")
_UPSERT = (f"INSERT INTO dedupe_claims ({', '.join(_COLUMNS)}) VALUES ({', '.join(['%s'] * len(_COLUMNS))}) "
           f"ON DUPLICATE KEY UPDATE {', '.join(f'{c} = VALUES({c})' for c in _COLUMNS[1:])}")
_EPOCH = datetime.datetime(1970, 1, 2)


def _ms(delta: datetime.timedelta) -> int:
    return max(1, -(-int(delta / datetime.timedelta(microseconds=1)) // 1000))


def _text(value: Any) -> str | None:
    return value.decode("utf-8") if isinstance(value, bytes) else value


class _Rows:
    """The locked rows of one transition, the database's clock, and the rows to write back."""

    def __init__(self, cursor: Any, stems: Sequence[bytes], lock: bool) -> None:
        unique = sorted(set(stems))
        self.now: datetime.datetime | None = None
        self.rows: dict[bytes, dict[str, Any]] = {}
        self._read(cursor, unique, lock)
        missing = [s for s in unique if s not in self.rows]
        if lock and missing:  # placeholders (expired: absent) for the new keys, locked in turn
            cursor.executemany("INSERT IGNORE INTO dedupe_claims (stem, expires_at) VALUES (%s, %s)",
                               [(s, _EPOCH) for s in missing])
            self._read(cursor, missing, lock)
        if self.now is None:
            cursor.execute("SELECT NOW(6)")
            self.now = cursor.fetchone()[0]
        self.changed: dict[bytes, dict[str, Any]] = {}

    def _read(self, cursor: Any, stems: list[bytes], lock: bool) -> None:
        marks = ", ".join(["%s"] * len(stems))
        cursor.execute(f"SELECT {', '.join(_COLUMNS)}, NOW(6) FROM dedupe_claims WHERE stem IN ({marks}) "
                       f"ORDER BY stem{' FOR UPDATE' if lock else ''}", stems)
        for *values, now in cursor.fetchall():
            self.now = now
            row = dict(zip(_COLUMNS, values, strict=True))
            row["fp"], row["orig"], row["status"] = _text(row["fp"]), _text(row["orig"]), _text(row["status"])
            self.rows[bytes(row["stem"])] = row

    def live(self, stem: bytes) -> dict[str, Any] | None:
        """The row of ``stem`` unless absent or expired (as an expired Redis key: gone)."""
        row = self.rows.get(stem)
        return row if row is not None and row["expires_at"] > self.now else None

    def write(self, stem: bytes, **fields: Any) -> None:
        row = self.rows.setdefault(stem, dict.fromkeys(_COLUMNS, None) | {"stem": stem, "owner": 0,
                                                                          "next_token": 0, "waiters": 0})
        row.update(fields)
        self.changed[stem] = row

    def after(self, ms: int) -> datetime.datetime:
        assert self.now is not None
        return self.now + datetime.timedelta(milliseconds=ms)

    def flush(self, cursor: Any) -> None:
        if self.changed:
            cursor.executemany(_UPSERT, [tuple(row[c] for c in _COLUMNS) for row in self.changed.values()])


def _tokens(cursor: Any, count: int) -> list[int]:
    """``count`` new tokens, taken now (after the rows are locked): AUTO_INCREMENT values."""
    if not count:
        return []
    cursor.execute("INSERT INTO dedupe_tokens () VALUES " + ", ".join(["()"] * count))
    first = int(cursor.lastrowid)
    return list(range(first, first + count))


def _claim(cursor: Any, t: Transition) -> list[tuple[Any, ...]]:
    fps, origs = t.per_stem
    lease_ms, retention_ms = t.shared
    rows = _Rows(cursor, t.stems, lock=True)
    order = sorted(range(len(t.stems)), key=lambda i: (t.stems[i], i))
    fresh = iter(_tokens(cursor, sum(1 for stem in set(t.stems) if _claimable(rows, stem))))
    out: list[tuple[Any, ...]] = [()] * len(t.stems)
    for i in order:
        stem, fp = t.stems[i], fps[i] or None
        row = rows.live(stem)
        conflict = row is not None and fp is not None and row["fp"] is not None and row["fp"] != fp
        if row is not None and row["status"] is not None:
            out[i] = (4, 0, None, None) if conflict else (2, row["token"], row["status"], row["value"])
        elif row is not None and row["owner"] and row["deadline"] > rows.now:
            out[i] = (4, 0, None, None) if conflict else (3, row["owner"], _ms(row["deadline"] - rows.now), None)
        else:
            token = max(next(fresh), (row["next_token"] + 1) if row is not None else 0)
            rows.write(stem, owner=token, next_token=token, deadline=rows.after(lease_ms), fp=fp,
                       orig=origs[i] or None, status=None, token=None, value=None,
                       waiters=row["waiters"] if row is not None else 0,
                       expires_at=rows.after(max(lease_ms, retention_ms)))
            out[i] = (1, token, "1" if row is not None else None, None)
    rows.flush(cursor)
    return out


def _claimable(rows: _Rows, stem: bytes) -> bool:
    """Whether a claim takes ``stem`` (a token is needed): absent, expired, released or lapsed."""
    row = rows.live(stem)
    if row is None:
        return True
    return row["status"] is None and not (row["owner"] and row["deadline"] > rows.now)


def _finish(cursor: Any, t: Transition) -> list[tuple[Any, ...]]:
    """complete, release, renew: each checked against the owning token."""
    rows = _Rows(cursor, t.stems, lock=True)
    done = [0] * len(t.stems)
    for i in sorted(range(len(t.stems)), key=lambda i: (t.stems[i], i)):
        stem, token = t.stems[i], t.per_stem[0][i]
        row = rows.live(stem)
        if row is None:
            continue
        owned = row["status"] is None and row["owner"] == token
        if t.name == "complete":
            status, value = t.per_stem[1][i], t.per_stem[2][i]
            if owned:
                rows.write(stem, status=status, token=token, value=value, owner=0, deadline=None, waiters=0,
                           expires_at=rows.after(t.shared[0]))
            done[i] = int(owned or (row["status"] is not None and row["token"] == token))
        elif owned and t.name == "release":
            rows.write(stem, owner=0, waiters=0, expires_at=rows.after(t.shared[0]))
            done[i] = 1
        elif owned:  # renew
            lease_ms, retention_ms = t.shared
            rows.write(stem, deadline=rows.after(lease_ms), expires_at=rows.after(max(lease_ms, retention_ms)))
            done[i] = 1
    rows.flush(cursor)
    return [(done,)]


def _read(cursor: Any, t: Transition) -> list[tuple[Any, ...]]:
    """inspect and watch (waiters are not counted: MySQL's waiters poll)."""
    rows = _Rows(cursor, t.stems, lock=False)
    row = rows.live(t.stems[0])
    assert rows.now is not None
    if row is not None and row["status"] is not None:
        return [(2, row["token"], row["status"], row["value"], row["fp"] or "")] if t.name == "inspect" else [(0,)]
    if row is not None and row["owner"] and row["deadline"] > rows.now:
        left = _ms(row["deadline"] - rows.now)
        return [(3, row["owner"], left, None, None)] if t.name == "inspect" else [(left,)]
    return [(0, row["next_token"] if row is not None else 0, None, None, None)] if t.name == "inspect" else [(0,)]


def _forget(cursor: Any, t: Transition) -> list[tuple[Any, ...]]:
    expected, force = t.shared
    rows = _Rows(cursor, t.stems, lock=True)
    row = rows.live(t.stems[0])
    if row is None:
        cursor.execute("DELETE FROM dedupe_claims WHERE stem = %s AND expires_at <= NOW(6)", (t.stems[0],))
        return [(0, 0)]
    live = row["status"] is None and row["owner"] and row["deadline"] > rows.now
    token = row["token"] if row["status"] is not None else row["owner"] if live else row["next_token"]
    if expected is not None and expected != token:
        return [(-2, token)]
    if live and not force and expected is None:
        return [(-1, row["owner"])]
    cursor.execute("DELETE FROM dedupe_claims WHERE stem = %s", (t.stems[0],))
    return [(1, token)]


def _send(cursor: Any, t: Transition) -> list[tuple[Any, ...]]:
    """send.lua: the mark row locked (made first if missing, so of two sends at once one
    publishes), the claim's row read, the mark written when the answer is PUBLISH."""
    task_id, ttl_ms, keep_ms, fp = t.shared
    stem, fp = t.stems[0], fp or None
    cursor.execute("INSERT IGNORE INTO dedupe_sent (stem, task_id, until, expires_at) VALUES (%s, '', %s, %s)",
                   (stem, _EPOCH, _EPOCH))
    cursor.execute("SELECT task_id, until, fp, expires_at, NOW(6) FROM dedupe_sent WHERE stem = %s FOR UPDATE",
                   (stem,))
    mark_id, until, mark_fp, mark_expires, now = cursor.fetchone()
    mark_id, mark_fp = _text(mark_id), _text(mark_fp)
    live_mark = mark_expires > now and mark_id != ""
    row = _Rows(cursor, [stem], lock=False).live(stem)
    conflict: list[tuple[Any, ...]] = [(4, 0, None, None, None)]
    if row is not None and row["status"] is not None:
        if fp is not None and row["fp"] is not None and row["fp"] != fp:
            return conflict
        return [(2, row["token"], row["status"], row["value"], mark_id if live_mark else "")]
    if row is not None and row["owner"] and row["deadline"] > now:
        if fp is not None and row["fp"] is not None and row["fp"] != fp:
            return conflict
        if live_mark:
            return [(3, row["owner"], _ms(row["deadline"] - now), None, mark_id)]
    elif live_mark and until > now:
        if fp is not None and mark_fp is not None and mark_fp != fp:
            return conflict
        return [(5, 0, _ms(until - now), None, mark_id)]
    cursor.execute("UPDATE dedupe_sent SET task_id = %s, until = %s, fp = %s, expires_at = %s WHERE stem = %s",
                   (task_id, now + datetime.timedelta(milliseconds=ttl_ms), fp,
                    now + datetime.timedelta(milliseconds=ttl_ms + keep_ms), stem))
    return [(1, 0, ttl_ms, None, task_id)]


_RUN = {"send": _send, "claim": _claim, "complete": _finish, "release": _finish, "renew": _finish, "inspect": _read,
        "watch": _read, "forget": _forget}


class MySqlPool(SqlPool):
    """PyMySQL connections for one URL (autocommit, READ COMMITTED), one per round trip."""

    dialect = "mysql"

    def __init__(self, arguments: dict[str, Any], *, max_size: int = 16) -> None:
        super().__init__(max_size)
        self.arguments = arguments
        self.notices = PolledNotices(self._gone)

    def _connect(self) -> Any:
        conn = pymysql.connect(**self.arguments)
        with conn.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        return conn

    def _reusable(self, conn: Any) -> bool:
        return bool(conn.open)

    def runner(self) -> Any:
        return MySqlRunner(self)

    def _gone(self, stems: list[str]) -> list[str]:
        """Which of ``stems`` no live lease holds (done, released, lapsed or absent)."""
        keys = [s.encode("utf-8") for s in stems]
        with self.connection() as conn, conn.cursor() as cursor:
            cursor.execute(f"SELECT stem FROM dedupe_claims WHERE stem IN ({', '.join(['%s'] * len(keys))}) "
                           "AND status IS NULL AND owner > 0 AND deadline > NOW(6) AND expires_at > NOW(6)", keys)
            held = {bytes(r[0]).decode("utf-8") for r in cursor.fetchall()}
        return [s for s in stems if s not in held]


class MySqlRunner(SyncRunner):
    """The script runner's interface over a :class:`MySqlPool`: each call one transaction."""

    def __init__(self, pool: MySqlPool) -> None:
        self.pool = pool

    def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        del wait
        transitions = [transition_of(*call) for call in calls]
        try:
            with self.pool.connection() as conn:
                return [reply_of(t, _transaction(conn, t)) for t in transitions]
        except pymysql.Error as exc:
            raise StoreUnavailable(f"MySQL failed running {transitions[0].name}: {exc}") from exc


#: Deadlock found, lock wait timeout: InnoDB rolled the transaction back; it is run again.
_RETRIED = frozenset({1213, 1205})


def _transaction(conn: Any, t: Transition, attempts: int = 5) -> list[tuple[Any, ...]]:
    """Transition ``t`` in one transaction, run again (whole) when InnoDB chose it as a deadlock's
    victim: two claims of one new key both wait on the other's placeholder insert."""
    for attempt in range(attempts):
        conn.begin()
        try:
            with conn.cursor() as cursor:
                rows = _RUN[t.name](cursor, t)
            conn.commit()
            return rows
        except pymysql.err.OperationalError as exc:
            conn.rollback()
            if exc.args[0] not in _RETRIED or attempt == attempts - 1:
                raise
        except BaseException:
            conn.rollback()
            raise
    raise AssertionError("unreachable")


class AsyncMySqlPool(MySqlPool):
    """:class:`MySqlPool` for asyncio: the same connections, used on worker threads."""

    def runner(self) -> Any:
        return AsyncMySqlRunner(self)

    async def blpop(self, keys: Sequence[str], timeout: float = 0) -> list[Any] | None:  # type: ignore[override]
        return await asyncio.to_thread(self.notices.blpop, keys, timeout)

    async def aclose(self) -> None:
        self.close()


class AsyncMySqlRunner:
    """:class:`MySqlRunner`, each round trip on a worker thread."""

    is_cluster = False
    held = None

    def __init__(self, pool: MySqlPool) -> None:
        self.sync = MySqlRunner(pool)

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return (await self.call_all([(name, keys, args)]))[0]

    async def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        return await asyncio.to_thread(self.sync.call_all, calls, wait)

    async def release_held(self) -> None:
        """Nothing is held."""
