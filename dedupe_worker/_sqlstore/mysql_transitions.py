"""The transitions of the claim protocol on MySQL / MariaDB, one function each, run by
:mod:`.mysql` inside one transaction: each reads the rows it needs (locked), decides as the
``lua/*.lua`` script of the same name does, writes what changed, and returns the rows the
PostgreSQL function of the same name returns (read by :func:`.calls.reply_of`).

The clock is the database's: ``NOW(6)``, read in the locking statement, and every deadline is
computed from it. A row whose ``expires_at`` has passed counts as absent (an expired Redis key).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from .calls import Transition

__all__ = ["RUN"]

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
    publishes), the claim's row read, the mark written when the answer is PUBLISH. The mark
    records the claim row's ``next_token`` (send.lua's ``n``): once a claim was taken since, a
    mark with no live lease on the key no longer answers QUEUED."""
    task_id, ttl_ms, keep_ms, fp = t.shared
    stem, fp = t.stems[0], fp or None
    cursor.execute("INSERT IGNORE INTO dedupe_sent (stem, task_id, until, expires_at) VALUES (%s, '', %s, %s)",
                   (stem, _EPOCH, _EPOCH))
    cursor.execute("SELECT task_id, until, fp, n, expires_at, NOW(6) FROM dedupe_sent WHERE stem = %s FOR UPDATE",
                   (stem,))
    mark_id, until, mark_fp, mark_n, mark_expires, now = cursor.fetchone()
    mark_id, mark_fp = _text(mark_id), _text(mark_fp)
    live_mark = mark_expires > now and mark_id != ""
    row = _Rows(cursor, [stem], lock=False).live(stem)
    counter = row["next_token"] if row is not None else None
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
    elif live_mark and until > now and mark_n == counter:
        if fp is not None and mark_fp is not None and mark_fp != fp:
            return conflict
        return [(5, 0, _ms(until - now), None, mark_id)]
    cursor.execute("UPDATE dedupe_sent SET task_id = %s, until = %s, fp = %s, n = %s, expires_at = %s WHERE stem = %s",
                   (task_id, now + datetime.timedelta(milliseconds=ttl_ms), fp, counter,
                    now + datetime.timedelta(milliseconds=ttl_ms + keep_ms), stem))
    return [(1, 0, ttl_ms, None, task_id)]


def _unsend(cursor: Any, t: Transition) -> list[tuple[Any, ...]]:
    """unsend.lua: remove the mark only while it names this send's task id (fenced)."""
    removed = cursor.execute("DELETE FROM dedupe_sent WHERE stem = %s AND task_id = %s AND task_id <> '' "
                             "AND expires_at > NOW(6)", (t.stems[0], t.shared[0]))
    return [(int(removed),)]


RUN = {"send": _send, "claim": _claim, "complete": _finish, "release": _finish, "renew": _finish, "inspect": _read,
        "watch": _read, "forget": _forget, "unsend": _unsend}
