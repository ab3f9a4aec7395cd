-- dedupe-worker: the outcomes atomic() commits in the handler's own transaction (MySQL, MariaDB).
-- One row per idempotency key. Put this file in your migrations as it is, or run
-- `dedupe-worker sql init`; rename the table with SqlOutcomes(..., table="...").
-- The key column compares bytes (utf8mb4_bin): keys differing only in case are different keys.
CREATE TABLE IF NOT EXISTS dedupe_outcome (
    dedupe_key VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,
    token      BIGINT   NOT NULL,
    status     CHAR(1)  NOT NULL,
    result     LONGBLOB NULL,
    expires_at BIGINT   NOT NULL,
    INDEX dedupe_outcome_expires_at (expires_at)
) ENGINE=InnoDB;
