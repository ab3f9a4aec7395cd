"""The SQL store's schema: its DDL, installed and checked by version.

``dedupe-worker sql init <url>`` runs the DDL (``--print`` shows it for one's own migrations).
The DDL is idempotent (``IF NOT EXISTS``, ``CREATE OR REPLACE``) and records its version in
``dedupe_schema``; a release that changes the transitions adds functions under a new version's
names beside the old ones, so workers of both releases run through a rolling upgrade.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from .urls import MYSQL, POSTGRESQL

__all__ = ["SCHEMA_VERSION", "ddl", "install", "installed_version", "purge"]

#: The version of the schema and transitions this release runs.
SCHEMA_VERSION = 1


def ddl(dialect: str) -> str:
    """The DDL text for ``dialect`` (``"postgresql"`` or ``"mysql"``)."""
    name = {POSTGRESQL: "postgresql.sql", MYSQL: "mysql.sql"}[dialect]
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def statements(dialect: str) -> list[str]:
    """The DDL as statements one at a time (MySQL's driver runs one per call)."""
    if dialect == POSTGRESQL:
        return [ddl(dialect)]
    return [part.strip() for part in ddl(dialect).split(";\n") if part.strip() and not _comment_only(part)]


def _comment_only(part: str) -> bool:
    return all(not line.strip() or line.strip().startswith("--") for line in part.splitlines())


def install(pool: Any) -> None:
    """Run the DDL on ``pool``'s database (idempotent)."""
    with pool.connection() as conn:
        if pool.dialect == POSTGRESQL:
            # one session at a time: concurrent CREATE OR REPLACE FUNCTION can fail with a tuple error
            conn.execute("SELECT pg_advisory_lock(hashtext('dedupe_schema'))")
            try:
                conn.execute(ddl(POSTGRESQL))
            finally:
                conn.execute("SELECT pg_advisory_unlock(hashtext('dedupe_schema'))")
        else:
            with conn.cursor() as cursor:
                for statement in statements(MYSQL):
                    cursor.execute(statement)


def installed_version(pool: Any) -> int | None:
    """The newest schema version installed, or ``None`` when there is no schema."""
    with pool.connection() as conn:
        if pool.dialect == POSTGRESQL:
            if conn.execute("SELECT to_regclass('dedupe_schema')").fetchone()[0] is None:
                return None
            row = conn.execute("SELECT max(version) FROM dedupe_schema").fetchone()
        else:
            with conn.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE() "
                               "AND table_name = 'dedupe_schema'")
                if not cursor.fetchone()[0]:
                    return None
                cursor.execute("SELECT max(version) FROM dedupe_schema")
                row = cursor.fetchone()
    return None if row is None or row[0] is None else int(row[0])


def purge(pool: Any, batch: int = 1000) -> int:
    """Delete expired rows in batches of at most ``batch`` (each its own short transaction, rows
    a claim holds skipped), until none is left; the number deleted. Cron-safe: running it twice
    at once, or beside workers, only splits the work. An expired row counts as absent already, so
    purging changes no answer; a key claimed again after its row went still gets a larger token."""
    deleted: int = 0
    with pool.connection() as conn:
        while True:
            if pool.dialect == POSTGRESQL:
                conn.execute("DELETE FROM dedupe_sent WHERE stem IN (SELECT stem FROM dedupe_sent "
                             "WHERE expires_at <= clock_timestamp() LIMIT %s FOR UPDATE SKIP LOCKED)", (batch,))
                count = conn.execute(
                    "DELETE FROM dedupe_claims WHERE stem IN (SELECT stem FROM dedupe_claims "
                    "WHERE expires_at <= clock_timestamp() ORDER BY expires_at LIMIT %s FOR UPDATE SKIP LOCKED)",
                    (batch,)).rowcount
            else:
                with conn.cursor() as cursor:
                    cursor.execute("DELETE FROM dedupe_sent WHERE expires_at <= NOW(6) LIMIT %s", (batch,))
                    count = cursor.execute("DELETE FROM dedupe_claims WHERE expires_at <= NOW(6) "
                                           "ORDER BY expires_at LIMIT %s", (batch,))
                    cursor.execute("SELECT max(id) FROM dedupe_tokens")
                    top = cursor.fetchone()[0]
                    if top is not None:  # the newest token row keeps the counter's high mark
                        cursor.execute("DELETE FROM dedupe_tokens WHERE id < %s ORDER BY id LIMIT %s", (top, batch))
            deleted += int(count)
            if count < batch:
                return deleted
