"""A client's options, and configuration from the environment (``DEDUPE_*``): the only module of
the library that reads it.

:class:`ClientOptions` are a client's options, each default written once, whatever builds them
(keywords, a URL's query, the settings); :class:`DedupeSettings` reads them from the environment,
for the CLI and ``from_settings``. The three switches below choose how a process talks to Redis,
the same for every client in it, so they are read where that is decided (a store built, scripts
loaded, a connection's first use), through the functions here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypedDict
from urllib.parse import unquote_plus

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ACCELERATORS_OFF_ENV", "RECORD_FORMAT", "RECORD_FORMATS", "RECORD_FORMAT_ENV", "SCRIPTS_ENV",
           "ClientKeywords", "ClientOptions", "DedupeSettings", "Serializer", "accelerators_off", "client_options",
           "eval_forced", "options_in_query", "record_format_from_env"]


class Serializer(Protocol):
    """Turns handler results into bytes for Redis and back (the ``serializer`` option)."""

    def dumps(self, value: Any) -> bytes: ...

    def loads(self, data: bytes | str) -> Any: ...


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    """The options of a claim client, each default written here once, checked once, and passed
    whole to the client, its codec and the flows (``options=`` of every client and deduplicator,
    sync and asyncio). Built from keywords (``ClaimClient(redis, lease=10)``), from a URL's query
    (``from_url("redis://host/0?lease=10")``) or from :class:`DedupeSettings`
    (:meth:`DedupeSettings.options`); :meth:`replace` gives a changed copy.

    Frozen: a client's options never change under it, and two clients built alike compare equal.
    """

    #: Prefix of every key written.
    namespace: str = "dedupe"
    #: Seconds a claim is held before others may take it; renewed while work runs.
    lease: float = 30.0
    #: Seconds an outcome is kept (a message's ``ttl=`` chooses its own).
    result_ttl: float = 86400.0
    #: Seconds a key's token counter (its started record) outlives a lease, so that a released
    #: key's next claim still gets a higher fencing token; ``None``: ``result_ttl``. Never shorter
    #: than the lease, nor than the ttl of a message released under the key.
    token_retention: float | None = None
    #: Keys longer than this many UTF-8 bytes are stored as their sha256.
    max_key_length: int = 200
    #: Results whose stored (compressed) form is larger are stored as "completed, body omitted".
    max_result_bytes: int = 1_000_000
    #: Exception types stored as a failed outcome instead of released.
    permanent_errors: tuple[type[BaseException], ...] = ()
    #: When the store is down, run the work anyway (logged as an error). Off: fail closed.
    fail_open: bool = False
    #: Seconds between lease renewals; ``None``: a third of ``lease``.
    renew_interval: float | None = None
    #: How results are stored; ``None``: JSON (never pickle).
    serializer: Serializer | None = None
    #: Replicas that must acknowledge every claim and completion (``WAIT``, in the same round
    #: trip); fewer within ``wait_timeout`` seconds raise ``StoreUnavailable``. 0: none.
    wait_replicas: int = 0
    #: Seconds to wait for them.
    wait_timeout: float = 0.1
    #: Accept a Redis whose ``maxmemory-policy`` evicts keys (evicted keys run again). Off: the
    #: first claim raises ``EvictionPolicyError`` there.
    allow_eviction: bool = False
    #: Results (and stored failures) over this many bytes are stored compressed, when that makes
    #: them smaller; ``None``: never.
    compress_above: int | None = 1024
    #: ``auto`` (zstd where installed, else zlib), ``zstd`` or ``zlib``. Every worker of a
    #: namespace must read what the others write: where some lack zstd, pin ``zlib``.
    compression: str = "auto"

    def __post_init__(self) -> None:
        for name, value, inclusive in _bounds(self):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or value < 0 or (value == 0 and not inclusive)):
                bound = "must not be negative" if inclusive else "must be positive"
                raise ValueError(f"{name} {bound}, not {value!r}")
        if self.compression not in ("auto", "zstd", "zlib"):
            raise ValueError(f"compression must be 'auto', 'zstd' or 'zlib', not {self.compression!r}")

    def replace(self, **changes: Any) -> ClientOptions:
        """A copy with ``changes`` (keywords as the constructor's), checked again."""
        return dataclasses.replace(self, **changes)


def _bounds(o: ClientOptions) -> tuple[tuple[str, float | None, bool], ...]:
    """The numeric options, each with whether 0 is allowed (else it must be positive)."""
    return (("lease", o.lease, False), ("result_ttl", o.result_ttl, False),
            ("token_retention", o.token_retention, False), ("renew_interval", o.renew_interval, True),
            ("max_key_length", o.max_key_length, False), ("max_result_bytes", o.max_result_bytes, True),
            ("wait_replicas", o.wait_replicas, True), ("wait_timeout", o.wait_timeout, False),
            ("compress_above", o.compress_above, True))


class ClientKeywords(TypedDict, total=False):
    """The keywords a client's constructor, ``from_url`` and ``from_settings`` take: the fields of
    :class:`ClientOptions` (see each there), and ``retention``, the name ``token_retention`` had
    until this release (accepted with a ``DeprecationWarning`` for one release)."""

    namespace: str
    lease: float
    result_ttl: float
    token_retention: float | None
    retention: float | None
    max_key_length: int
    max_result_bytes: int
    permanent_errors: tuple[type[BaseException], ...]
    fail_open: bool
    renew_interval: float | None
    serializer: Serializer | None
    wait_replicas: int
    wait_timeout: float
    allow_eviction: bool
    compress_above: int | None
    compression: str


#: The keyword ``token_retention`` had before; accepted, with a warning, for one release.
_RENAMED = {"retention": "token_retention"}
_FIELDS = frozenset(f.name for f in dataclasses.fields(ClientOptions))
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def client_options(options: ClientOptions | None, keywords: Mapping[str, Any]) -> ClientOptions:
    """The options of a client built with ``options=`` (or the defaults) and ``keywords``, the
    keywords winning. A keyword that is no option raises ``TypeError`` as a signature would; an
    old name is taken with a ``DeprecationWarning`` pointing at the caller's line."""
    changes = dict(keywords)
    for old, new in _RENAMED.items():
        if old in changes:
            if new in changes:
                raise TypeError(f"{old!r} is the old name of {new!r}: pass only {new!r}")
            warnings.warn(f"the {old!r} option is renamed {new!r}; {old!r} will be removed in the next release",
                          DeprecationWarning, stacklevel=_caller_level())
            changes[new] = changes.pop(old)
    unknown = sorted(changes.keys() - _FIELDS)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}: not a client option")
    if options is None:
        return ClientOptions(**changes)
    return options.replace(**changes) if changes else options


def _caller_level() -> int:
    """How many frames up the first one outside this package is (the user's line, whichever of
    the constructors, ``from_url`` or ``from_settings`` took the keyword)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def options_in_query(url: str) -> tuple[str, dict[str, Any]]:
    """``url`` without the client options in its query (``?lease=10&namespace=billing``), and
    those options as keywords, typed as :class:`ClientOptions` types them (``none`` or an empty
    value for an option that may be ``None``; ``1``/``true``/``yes``/``on`` or their opposites for
    a switch). The rest of the query (``cluster=1``, redis-py's own) is left as it was."""
    base, sep, query = url.partition("?")
    if not sep:
        return url, {}
    kept, found = [], {}
    for part in query.split("&"):
        name, _, raw = part.partition("=")
        name = unquote_plus(name)
        if name in _QUERY_TYPES:
            found[name] = _QUERY_TYPES[name](name, unquote_plus(raw))
        else:
            kept.append(part)
    return (base + "?" + "&".join(kept) if kept else base), found


def _number(kind: type[float] | type[int], optional: bool) -> Callable[[str, str], Any]:
    def parse(name: str, raw: str) -> float | int | None:
        if optional and raw.strip().lower() in ("", "none"):
            return None
        try:
            return kind(raw)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{name}={raw!r} in the URL is not {what}") from None
    return parse


def _switch(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={raw!r} in the URL is not a switch (true or false)")


#: How a URL's query value is read, by the option's annotation (``permanent_errors`` and
#: ``serializer`` are Python objects: no URL carries them).
_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "str": lambda name, raw: raw, "bool": _switch,
    "float": _number(float, False), "float | None": _number(float, True),
    "int": _number(int, False), "int | None": _number(int, True),
}
_QUERY_TYPES = {f.name: _PARSERS[str(f.type)] for f in dataclasses.fields(ClientOptions) if str(f.type) in _PARSERS}
_QUERY_TYPES.update({old: _QUERY_TYPES[new] for old, new in _RENAMED.items()})


#: The formats ``complete.lua`` can write a result in: 1 the hash at ``<stem>:result`` every
#: release reads, 2 the compact string at the stem itself (one ``SET ... PX``) that only the
#: release that introduced it and later ones read.
RECORD_FORMATS = (1, 2)
#: The format results are written in unless :data:`RECORD_FORMAT_ENV` says otherwise.
RECORD_FORMAT = 2
#: ``1`` or ``2``: the format results are written in (the switch of a mixed rollout).
RECORD_FORMAT_ENV = "DEDUPE_RECORD_FORMAT"
#: ``eval`` forces ``EVALSHA`` on every server (any other value, or none: functions where the
#: server has them).
SCRIPTS_ENV = "DEDUPE_SCRIPTS"
#: Set to anything but ``""`` or ``0``: the library takes its plain paths, never an accelerator.
ACCELERATORS_OFF_ENV = "DEDUPE_PURE_PYTHON"


def record_format_from_env() -> int:
    """The result format to write: :data:`RECORD_FORMAT_ENV` (``1`` or ``2``), else :data:`RECORD_FORMAT`.

    The switch of a two-phase upgrade: every release since format 2 came reads both formats. A
    worker of an earlier release does not see a format-2 result (it reads only ``<stem>:result``):
    it would take the key for a new one and run its message again. So while one still shares the
    namespace, set ``DEDUPE_RECORD_FORMAT=1`` on the upgraded workers; unset it once none is left.
    Raises ``ValueError`` for any other value (read when a store is built)."""
    raw = os.environ.get(RECORD_FORMAT_ENV, "").strip() or str(RECORD_FORMAT)
    if raw not in ("1", "2"):
        raise ValueError(f"{RECORD_FORMAT_ENV} must be 1 or 2, not {raw!r}")
    return int(raw)


def eval_forced() -> bool:
    """Whether :data:`SCRIPTS_ENV` forces ``EVALSHA`` (read when a runner loads its scripts)."""
    return os.environ.get(SCRIPTS_ENV, "").strip().lower() == "eval"


def accelerators_off() -> bool:
    """Whether :data:`ACCELERATORS_OFF_ENV` asks for the plain paths now (read where each
    accelerator is chosen: a connection's first use, a client's construction)."""
    return os.environ.get(ACCELERATORS_OFF_ENV, "").strip() not in ("", "0")


class DedupeSettings(BaseSettings):
    """Every field can be set as ``DEDUPE_<FIELD>``, e.g. ``DEDUPE_REDIS_URL``, ``DEDUPE_LEASE``."""

    model_config = SettingsConfigDict(env_prefix="DEDUPE_", extra="ignore")

    #: Where the claims live. ``redis://``, ``rediss://`` or ``unix://``; add ``?cluster=1`` (or use
    #: ``redis+cluster://``) for a Redis Cluster; ``redis+sentinel://h1:26379,h2:26379/<service>/<db>``
    #: for a primary found through Sentinel.
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Where the claims live, whatever the store: a Redis URL as ``redis_url``, or a database's
    #: (``postgresql://``, ``mysql://``, ``mariadb://``, SQLAlchemy forms with a driver) for the SQL
    #: store. Set, it wins over ``redis_url`` (``DEDUPE_REDIS_URL``, still read when it is unset).
    store_url: str | None = None
    #: Prefix of every Redis key we write.
    namespace: str = ClientOptions.namespace
    #: Seconds a claim is held without renewal before another worker may take over.
    lease: float = Field(ClientOptions.lease, gt=0)
    #: Seconds a stored outcome (and so the protection against duplicates) is kept.
    result_ttl: float = Field(ClientOptions.result_ttl, gt=0)
    #: Keys longer than this many UTF-8 bytes are stored as their sha256.
    max_key_length: int = Field(ClientOptions.max_key_length, gt=0)
    #: Results larger than this are stored as "completed, body omitted".
    max_result_bytes: int = Field(ClientOptions.max_result_bytes, ge=0)
    #: Results over this many bytes are stored compressed (when that makes them smaller).
    compress_above: int | None = Field(ClientOptions.compress_above, ge=0)
    #: How: ``auto`` (zstd where installed, else zlib), ``zstd`` or ``zlib``.
    compression: str = ClientOptions.compression
    #: Run the handler without deduplication when Redis is down (loudly logged). Off: fail closed.
    fail_open: bool = ClientOptions.fail_open
    #: Replicas that must acknowledge every claim and completion (``WAIT``); 0: none.
    wait_replicas: int = Field(ClientOptions.wait_replicas, ge=0)
    #: Seconds to wait for them before the write counts as not durable.
    wait_timeout: float = Field(ClientOptions.wait_timeout, gt=0)
    #: Accept a Redis whose ``maxmemory-policy`` evicts keys (evicted keys run again). Off: the
    #: first claim (and a consumer's start) refuses with ``EvictionPolicyError`` there.
    allow_eviction: bool = ClientOptions.allow_eviction
    #: Where ``dedupe_worker.sql.atomic()`` commits outcomes: a PostgreSQL DSN, or a SQLAlchemy URL
    #: with its driver (``mysql+pymysql://...``). Unset: no SQL outcomes.
    sql_dsn: str | None = None
    #: The table of those outcomes.
    sql_table: str = "dedupe_outcome"
    #: The broker the ``rabbitmq`` and ``replay rabbitmq`` commands connect to.
    rabbitmq_url: str = "amqp://guest:guest@127.0.0.1:5672//"
    #: ``bootstrap.servers`` of the ``kafka`` and ``replay kafka`` commands (no default).
    kafka_bootstrap: str | None = None

    @property
    def claims_url(self) -> str:
        """The URL of the claim store: ``store_url``, else ``redis_url``."""
        return self.store_url or self.redis_url

    def options(self) -> ClientOptions:
        """The :class:`ClientOptions` these settings set (the others at their defaults)."""
        return ClientOptions(**self.client_options())

    def client_options(self) -> dict[str, Any]:
        """The options of a claim client (sync or asyncio) these settings set, as keywords."""
        return dict(namespace=self.namespace, lease=self.lease, result_ttl=self.result_ttl,
                    max_key_length=self.max_key_length, max_result_bytes=self.max_result_bytes,
                    compress_above=self.compress_above, compression=self.compression,
                    fail_open=self.fail_open, wait_replicas=self.wait_replicas, wait_timeout=self.wait_timeout,
                    allow_eviction=self.allow_eviction)
