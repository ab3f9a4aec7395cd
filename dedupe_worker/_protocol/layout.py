"""Where a message's records live in Redis.

A message's keys share one Redis Cluster hash slot through the ``{...}`` hash tag::

    <namespace>:{<key>}:started   lease owner, lease deadline, token counter, fingerprint; gone
                                  once an outcome is stored
    <namespace>:{<key>}           the stored outcome in record format 2: one string (status,
                                  token, value) at the stem itself, the shortest name, so a
                                  completed key costs what a plain ``SET`` of it does
    <namespace>:{<key>}:result    the stored outcome in record format 1 (a hash: status, value,
                                  token), as every earlier release writes it
    <namespace>:{<key>}:notice    only while someone waits on the key: one entry per waiter
    <namespace>:{<key>}:sent      only when a producer checks before sending (``send.lua``): the
                                  task id it sent, until when that counts as queued, fingerprint

At most one of the two outcome records exists: a result is written once, by the owner of the
claim, in the format its worker writes (format 2 unless ``DEDUPE_RECORD_FORMAT=1``). Readers of
this release read both; releases before it read only ``:result``, so while one of them shares the
namespace its peers write format 1 (see the README's upgrade section). A name that
ends with ``}`` is a format-2 outcome (:meth:`KeyLayout.kind`): every other key has a suffix.

A key that is longer than ``max_key_length`` bytes, or holds bytes that would break this layout
(braces, whitespace, control characters, invalid UTF-8), is replaced by ``sha256:<hex>`` of its
UTF-8 bytes; the original is kept in the records' ``orig`` field for inspection. A key that itself
begins with ``sha256:`` is hashed the same way, so a literal key can never name the records of a
hashed one (``sha256:<hex of K>`` given as a key lands elsewhere than ``K``).
"""

from __future__ import annotations

import hashlib
import re

from .._errors import InvalidKey
from .._settings import ClientOptions

__all__ = ["NOTICE", "RESULT", "SENT", "STARTED", "KeyLayout"]

_UNSAFE = re.compile(r"[{}\s\x00-\x1f\x7f]")


def plain_ascii(text: str) -> bool:
    """For ASCII ``text`` only: whether it holds no character :data:`_UNSAFE` finds (all printable,
    no space, no brace): plain str methods, cheaper than the regex on every key of a batch
    (docs/performance.md, bench.kafka_cpu's keys)."""
    return text.isprintable() and " " not in text and "{" not in text and "}" not in text

#: The suffixes of a message's keys after its stem (the format-2 record is the stem itself).
STARTED, RESULT, NOTICE, SENT = ":started", ":result", ":notice", ":sent"
#: How a stored key that holds a hash begins; a literal key beginning so is hashed too.
HASHED_PREFIX = "sha256:"


class KeyLayout:
    """Maps idempotency keys to Redis key names under one namespace."""

    def __init__(self, namespace: str = ClientOptions.namespace,
                 max_key_length: int = ClientOptions.max_key_length) -> None:
        if not namespace or _UNSAFE.search(namespace):
            raise ValueError(f"namespace must be non-empty without braces or whitespace: {namespace!r}")
        self.namespace = namespace
        self.max_key_length = max_key_length

    def stored_key(self, key: str | bytes) -> tuple[str, str]:
        """Return ``(stored, original)``: the key as it appears in Redis, and the original when
        it had to be hashed (else ``""``). ``max_key_length`` counts the key's UTF-8 bytes.
        Raises :class:`InvalidKey` for an empty key."""
        if isinstance(key, bytes):
            raw = key
            try:
                text = key.decode("utf-8")
            except UnicodeDecodeError:
                return HASHED_PREFIX + hashlib.sha256(raw).hexdigest(), key.hex()
        elif isinstance(key, str):
            text = key
            try:
                raw = key.encode("utf-8")
            except UnicodeEncodeError as exc:  # lone surrogates
                raise InvalidKey(f"key is not encodable as UTF-8: {key!r}") from exc
        else:
            raise InvalidKey(f"key must be str or bytes, not {type(key).__name__}")
        if not raw:
            raise InvalidKey("idempotency key is empty")
        if len(raw) > self.max_key_length or _UNSAFE.search(text) or text.startswith(HASHED_PREFIX):
            return HASHED_PREFIX + hashlib.sha256(raw).hexdigest(), text
        return text, ""

    def stem(self, stored: str) -> str:
        return f"{self.namespace}:{{{stored}}}"

    @staticmethod
    def started(stem: str) -> str:
        return stem + STARTED

    @staticmethod
    def record(stem: str) -> str:
        """Where record format 2 keeps the outcome: a string at the stem itself."""
        return stem

    @staticmethod
    def result(stem: str) -> str:
        """Where record format 1 keeps the outcome: a hash."""
        return stem + RESULT

    @staticmethod
    def records(stem: str) -> tuple[str, str, str]:
        """``(started, record, result)``: every key a reader of a message's state looks at (the
        claim, and the outcome in format 2 and in format 1), in the order the scripts take them."""
        return stem + STARTED, stem, stem + RESULT

    @staticmethod
    def completion(stem: str) -> tuple[str, str, str, str]:
        """``(started, record, result, notice)``: what a completion touches, in the order
        ``complete.lua`` takes them (the records, then the list its waiters are woken on)."""
        return stem + STARTED, stem, stem + RESULT, stem + NOTICE

    @staticmethod
    def names(stem: str) -> tuple[str, str, str, str, str]:
        """``(started, record, result, notice, sent)``: every name a message's keys can have, in
        the order ``forget.lua`` takes them (it removes whatever lies under them)."""
        return stem + STARTED, stem, stem + RESULT, stem + NOTICE, stem + SENT

    @staticmethod
    def stem_of(name: str) -> str:
        """The stem of a key name this layout made (``<namespace>:{<key>}``, suffix or not)."""
        return name.rpartition("}")[0] + "}"

    @staticmethod
    def kind(name: str) -> str:
        """What the key ``name`` (found by a ``SCAN`` of the namespace) holds: ``"record"`` (a
        format-2 outcome), ``"result"`` (a format-1 outcome), ``"started"``, ``"notice"``,
        ``"sent"``, or ``""`` for a name this layout does not make."""
        if name.endswith("}"):
            return "record"
        suffix = name.rpartition("}:")[2]
        return suffix if suffix in ("started", "result", "notice", "sent") and "}:" in name else ""

    @staticmethod
    def notice(stem: str) -> str:
        """The list a waiter blocks on until the holder completes or releases (``watch.lua``)."""
        return stem + NOTICE

    @staticmethod
    def sent(stem: str) -> str:
        """The mark a producer leaves when it publishes work for the key (``send.lua``)."""
        return stem + SENT
