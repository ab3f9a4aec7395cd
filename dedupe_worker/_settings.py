"""Configuration from the environment (``DEDUPE_*``): the only module of the library that reads it.

:class:`DedupeSettings` holds the options of a client, for the CLI and ``from_settings``. The
three switches below choose how a process talks to Redis, the same for every client in it, so they
are read where that is decided (a store built, scripts loaded, a connection's first use), through
the functions here.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ACCELERATORS_OFF_ENV", "RECORD_FORMAT", "RECORD_FORMATS", "RECORD_FORMAT_ENV", "SCRIPTS_ENV",
           "DedupeSettings", "Defaults", "accelerators_off", "eval_forced", "record_format_from_env"]


class Defaults:
    """The default of each client option, written once: :class:`DedupeSettings` and every client's
    signature (sync, asyncio, the flows they share) take them from here."""

    #: Prefix of every Redis key we write.
    NAMESPACE = "dedupe"
    #: Seconds a claim is held without renewal.
    LEASE = 30.0
    #: Seconds a stored outcome is kept.
    RESULT_TTL = 86400.0
    #: Keys longer than this many UTF-8 bytes are stored as their sha256.
    MAX_KEY_LENGTH = 200
    #: Results larger than this are stored as "completed, body omitted".
    MAX_RESULT_BYTES = 1_000_000
    #: Results over this many bytes are stored compressed.
    COMPRESS_ABOVE = 1024
    #: ``auto``: zstd where installed, else zlib.
    COMPRESSION = "auto"
    #: Seconds to wait for ``wait_replicas`` replicas.
    WAIT_TIMEOUT = 0.1

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
    namespace: str = Defaults.NAMESPACE
    #: Seconds a claim is held without renewal before another worker may take over.
    lease: float = Field(Defaults.LEASE, gt=0)
    #: Seconds a stored outcome (and so the protection against duplicates) is kept.
    result_ttl: float = Field(Defaults.RESULT_TTL, gt=0)
    #: Keys longer than this many UTF-8 bytes are stored as their sha256.
    max_key_length: int = Field(Defaults.MAX_KEY_LENGTH, gt=0)
    #: Results larger than this are stored as "completed, body omitted".
    max_result_bytes: int = Field(Defaults.MAX_RESULT_BYTES, ge=0)
    #: Results over this many bytes are stored compressed (when that makes them smaller).
    compress_above: int | None = Field(Defaults.COMPRESS_ABOVE, ge=0)
    #: How: ``auto`` (zstd where installed, else zlib), ``zstd`` or ``zlib``.
    compression: str = Defaults.COMPRESSION
    #: Run the handler without deduplication when Redis is down (loudly logged). Off: fail closed.
    fail_open: bool = False
    #: Replicas that must acknowledge every claim and completion (``WAIT``); 0: none.
    wait_replicas: int = Field(0, ge=0)
    #: Seconds to wait for them before the write counts as not durable.
    wait_timeout: float = Field(Defaults.WAIT_TIMEOUT, gt=0)
    #: Accept a Redis whose ``maxmemory-policy`` evicts keys (evicted keys run again). Off: the
    #: first claim (and a consumer's start) refuses with ``EvictionPolicyError`` there.
    allow_eviction: bool = False
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

    def client_options(self) -> dict[str, Any]:
        """The options of a claim client (sync or asyncio) these settings set."""
        return dict(namespace=self.namespace, lease=self.lease, result_ttl=self.result_ttl,
                    max_key_length=self.max_key_length, max_result_bytes=self.max_result_bytes,
                    compress_above=self.compress_above, compression=self.compression,
                    fail_open=self.fail_open, wait_replicas=self.wait_replicas, wait_timeout=self.wait_timeout,
                    allow_eviction=self.allow_eviction)
