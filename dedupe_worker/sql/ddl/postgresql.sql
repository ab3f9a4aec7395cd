-- dedupe-worker: the outcomes atomic() commits in the handler's own transaction (PostgreSQL).
-- One row per idempotency key. Put this file in your migrations as it is, or run
-- `dedupe-worker sql init`; rename the table with SqlOutcomes(..., table="...").
CREATE TABLE IF NOT EXISTS dedupe_outcome (
    -- the key's Redis stem, <namespace>:{<key or sha256:...>} (hashed when over 512 bytes)
    dedupe_key varchar(512) PRIMARY KEY,
    -- the fencing token of the run that committed the row
    token      bigint       NOT NULL,
    -- 'c' completed (a NULL result is None), 'o' completed with the result omitted (too large)
    status     char(1)      NOT NULL,
    -- the result as the claim client stores it (JSON by default, compressed when large)
    result     bytea,
    -- epoch milliseconds after which purge() may delete the row (written now + result_ttl)
    expires_at bigint       NOT NULL
);
CREATE INDEX IF NOT EXISTS dedupe_outcome_expires_at ON dedupe_outcome (expires_at);
