-- dedupe-worker: the outcomes atomic() commits in the handler's own transaction (PostgreSQL).
-- One row per idempotency key. Put this file in your migrations as it is, or run
-- `dedupe-worker sql init`; rename the table with SqlOutcomes(..., table="...").
-- A table created before rows carried a fingerprint (dedupe-worker 0.1.0) needs
-- ALTER TABLE dedupe_outcome ADD COLUMN IF NOT EXISTS fingerprint varchar(64) NOT NULL DEFAULT '';
-- (`dedupe-worker sql init` runs it), see docs/sql.md "Upgrading the table".
CREATE TABLE IF NOT EXISTS dedupe_outcome (
    -- the key's Redis stem, <namespace>:{<key or sha256:...>} (hashed when over 512 bytes)
    dedupe_key varchar(512) PRIMARY KEY,
    -- the fencing token of the run that committed the row
    token      bigint       NOT NULL,
    -- 'c' completed (a NULL result is None), 'o' completed with the result omitted (too large)
    status     char(1)      NOT NULL,
    -- the result as the claim client stores it (JSON by default, compressed when large)
    result     bytea,
    -- the payload fingerprint of the claim that wrote the row ('' when it had none)
    fingerprint varchar(64) NOT NULL DEFAULT '',
    -- epoch milliseconds from which the row is absent and purge() may delete it (written
    -- now + the writing claim's ttl, else its client's result_ttl)
    expires_at bigint       NOT NULL
);
CREATE INDEX IF NOT EXISTS dedupe_outcome_expires_at ON dedupe_outcome (expires_at);
