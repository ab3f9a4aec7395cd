-- dedupe-worker: the outcomes atomic() commits in the handler's own transaction (MySQL, MariaDB).
-- One row per idempotency key. Put this file in your migrations as it is, or run
-- `dedupe-worker sql init`; rename the table with SqlOutcomes(..., table="...").
-- The key column compares bytes (utf8mb4_bin): keys differing only in case are different keys.
-- A table created by dedupe-worker 0.1.0 (no fingerprint column) needs (`dedupe-worker sql init` runs it)
-- ALTER TABLE dedupe_outcome ADD COLUMN fingerprint VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin
--     NOT NULL DEFAULT '';
-- see docs/sql.md "Upgrading the table".
CREATE TABLE IF NOT EXISTS dedupe_outcome (
    dedupe_key VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,
    token      BIGINT   NOT NULL,
    status     CHAR(1)  NOT NULL,
    result     LONGBLOB NULL,
    fingerprint VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL DEFAULT '',
    expires_at BIGINT   NOT NULL,
    INDEX dedupe_outcome_expires_at (expires_at)
) ENGINE=InnoDB;
