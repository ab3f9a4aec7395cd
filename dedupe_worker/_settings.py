"""Configuration from the environment (``DEDUPE_*``), for the CLI and ``from_settings``."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["DedupeSettings"]


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
    namespace: str = "dedupe"
    #: Seconds a claim is held without renewal before another worker may take over.
    lease: float = Field(30.0, gt=0)
    #: Seconds a stored outcome (and so the protection against duplicates) is kept.
    result_ttl: float = Field(86400.0, gt=0)
    #: Keys longer than this many UTF-8 bytes are stored as their sha256.
    max_key_length: int = Field(200, gt=0)
    #: Results larger than this are stored as "completed, body omitted".
    max_result_bytes: int = Field(1_000_000, ge=0)
    #: Results over this many bytes are stored compressed (when that makes them smaller).
    compress_above: int | None = Field(1024, ge=0)
    #: How: ``auto`` (zstd where installed, else zlib), ``zstd`` or ``zlib``.
    compression: str = "auto"
    #: Run the handler without deduplication when Redis is down (loudly logged). Off: fail closed.
    fail_open: bool = False
    #: Replicas that must acknowledge every claim and completion (``WAIT``); 0: none.
    wait_replicas: int = Field(0, ge=0)
    #: Seconds to wait for them before the write counts as not durable.
    wait_timeout: float = Field(0.1, gt=0)
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
