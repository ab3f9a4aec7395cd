"""The protocol's script calls read as SQL transitions, and SQL rows written back as script replies.

Written once without I/O for every SQL runner (PostgreSQL and MySQL, sync and asyncio). The flows
(:mod:`dedupe_worker._protocol.flows`) build each transition as a call of a ``lua/*.lua`` script:
``(name, KEYS, ARGV)`` over Redis key names. A SQL runner takes the same call, finds each
message's stem in its keys (every key name of a message is its stem plus a suffix), performs the
same transition on the stem's row, and answers with what the script would have answered, so the
codec, the flows, the engine and every integration read it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .._errors import StoreUnavailable
from .._protocol import SENT, STARTED, Call

__all__ = ["SyncRunner", "Transition", "reply_of", "transition_of"]


class Transition(NamedTuple):
    """One script call as the SQL store performs it: the script's ``name``, the stems it touches
    (as bytes: compared byte for byte), the per-stem arguments and the shared ones."""

    name: str
    stems: list[bytes]
    per_stem: tuple[list[Any], ...]
    shared: tuple[Any, ...]


def _stem(key: str, suffix: str = "") -> bytes:
    return (key[: -len(suffix)] if suffix else key).encode("utf-8")


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def transition_of(name: str, keys: Sequence[str], args: Sequence[Any]) -> Transition:
    """The transition of the ``name``.lua call with ``keys`` and ``args`` (see each script's
    header for their layout)."""
    if name == "claim":  # (started, stem, result) per message; lease, retention, (fp, orig) each
        n = len(keys) // 3
        return Transition(name, [_stem(k) for k in keys[1::3]],
                          ([_text(a) for a in args[2:2 + 2 * n:2]], [_text(a) for a in args[3:3 + 2 * n:2]]),
                          (int(args[0]), int(args[1])))
    if name == "complete":  # (started, stem, result, notice) per message; ttl, (token, status, value) each
        n = len(keys) // 4
        return Transition(name, [_stem(k) for k in keys[1::4]],
                          ([int(a) for a in args[1:1 + 3 * n:3]], [_text(a) for a in args[2:2 + 3 * n:3]],
                           [_bytes(a) for a in args[3:3 + 3 * n:3]]), (int(args[0]),))
    if name == "release":  # (started, notice) per message; retention, token each
        return Transition(name, [_stem(k, STARTED) for k in keys[0::2]], ([int(a) for a in args[1:]],),
                          (int(args[0]),))
    if name == "renew":  # started per message; lease, retention, token each
        return Transition(name, [_stem(k, STARTED) for k in keys], ([int(a) for a in args[2:]],),
                          (int(args[0]), int(args[1])))
    if name in ("inspect", "watch"):  # (started, stem, result)
        return Transition(name, [_stem(keys[1])], (), tuple(args))
    if name == "forget":  # (started, stem, result, notice); token or '', '1' to force
        token = _text(args[0]) if args else ""
        return Transition(name, [_stem(keys[1])], (),
                          (int(token) if token else None, len(args) > 1 and _text(args[1]) == "1"))
    if name == "send":  # (started, stem, result, sent); task id, ttl, keep, fingerprint
        return Transition(name, [_stem(keys[1])], (),
                          (_text(args[0]), int(args[1]), int(args[2]), _text(args[3]) if len(args) > 3 else ""))
    if name == "unsend":  # sent; task id
        return Transition(name, [_stem(keys[0], SENT)], (), (_text(args[0]),))
    raise StoreUnavailable(f"{name}.lua has no SQL counterpart: the SQL store does not run it")


def reply_of(transition: Transition, rows: Sequence[Sequence[Any]]) -> Any:
    """The script's reply, from the rows the SQL transition returned (see the functions in
    ``postgresql.sql``: the same rows come from the MySQL runner)."""
    name = transition.name
    if name == "claim":
        flat: list[Any] = []
        for code, token, a, b in rows:
            if code == 1:
                flat += (1, int(token), 1 if a else False, False)
            elif code == 2:
                flat += (2, int(token), _text(a), bytes(b) if b is not None else b"")
            elif code == 3:
                flat += (3, int(token), int(a), False)
            else:
                flat += (4, 0, False, False)
        return flat
    if name in ("complete", "release", "renew"):
        return [int(v) for v in rows[0][0]]
    if name == "inspect":
        code, token, a, b, fp = rows[0]
        if code == 2:
            reply = [2, int(token), _text(a), bytes(b) if b is not None else b""]
            return [*reply, fp or ""] if transition.shared[:1] == ("f",) else reply
        if code == 3:
            return [3, int(token), int(a), False]
        return [0, int(token), 0, False]
    if name == "watch":
        remaining = int(rows[0][0]) if rows and rows[0][0] is not None else 0
        return [1, remaining] if remaining > 0 else [0, 0]
    if name == "send":
        code, token, a, b, task_id = rows[0]
        first = _text(a) if code == 2 else int(a) if a is not None else False
        return [int(code), int(token), first, (bytes(b) if b is not None else b"") if code == 2 else False,
                _text(task_id) if task_id is not None else False]
    if name == "unsend":
        return int(rows[0][0])
    code, token = rows[0]  # forget
    return [int(code), int(token)]


class SyncRunner:
    """What every sync SQL runner shares of the Redis script runner's interface: ``call`` (one
    call of :meth:`call_all`), and the pipelined commands the replay planner sends
    (``command``, ``path.execute_many``, ``ran_nothing``): a command is the call itself."""

    is_cluster = False
    #: No held connection (a Redis transport of its own); each round trip takes a pooled one.
    held = None

    def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        raise NotImplementedError

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self.call_all([(name, keys, args)])[0]

    @staticmethod
    def command(name: str, keys: Sequence[str], args: Sequence[Any]) -> Call:
        return (name, keys, args)

    @staticmethod
    def ran_nothing(reply: Any) -> bool:
        """Never: the transitions are installed with the schema, not loaded per connection."""
        del reply
        return False

    @property
    def path(self) -> SyncRunner:
        return self

    def execute_many(self, commands: Sequence[Call]) -> list[Any]:
        return self.call_all(commands)
