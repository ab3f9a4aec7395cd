-- dedupe-worker: the claim store on MySQL / MariaDB (schema version 1).
-- Put this file in your migrations as it is, or run `dedupe-worker sql init <url>`.
--
-- One row per message key. The stem is VARBINARY, so keys compare byte for byte: MySQL's default
-- collations fold case and ignore trailing spaces ('a' = 'A' = 'a '), which would make three keys
-- one. Each transition is one transaction (SELECT ... FOR UPDATE, then one write) run by the
-- client; leases are timed by the database's clock (NOW(6)). Fencing tokens come from the
-- AUTO_INCREMENT of dedupe_tokens, taken after the key's row is locked, and never below the row's
-- last token + 1: strictly increasing per key across expiry, release, retention and forget.
CREATE TABLE IF NOT EXISTS dedupe_claims (
    stem       VARBINARY(3072) NOT NULL PRIMARY KEY,
    owner      BIGINT          NOT NULL DEFAULT 0,
    next_token BIGINT          NOT NULL DEFAULT 0,
    deadline   DATETIME(6)     NULL,
    fp         VARBINARY(1024) NULL,
    orig       BLOB            NULL,
    waiters    INT             NOT NULL DEFAULT 0,
    status     BINARY(1)       NULL CHECK (status IN ('c', 'o', 'f')),
    token      BIGINT          NULL,
    value      LONGBLOB        NULL,
    expires_at DATETIME(6)     NOT NULL,
    KEY dedupe_claims_expires_at (expires_at)
) ENGINE=InnoDB;

CREATE TABLE IF NOT EXISTS dedupe_tokens (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY
) ENGINE=InnoDB;

CREATE TABLE IF NOT EXISTS dedupe_sent (
    stem       VARBINARY(3072) NOT NULL PRIMARY KEY,
    task_id    VARBINARY(1024) NOT NULL,
    until      DATETIME(6)     NOT NULL,
    fp         VARBINARY(1024) NULL,
    n          BIGINT          NULL,
    expires_at DATETIME(6)     NOT NULL,
    KEY dedupe_sent_expires_at (expires_at)
) ENGINE=InnoDB;

CREATE TABLE IF NOT EXISTS dedupe_schema (
    version   INT       NOT NULL PRIMARY KEY,
    installed TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP
) ENGINE=InnoDB;

INSERT IGNORE INTO dedupe_schema (version) VALUES (1);
