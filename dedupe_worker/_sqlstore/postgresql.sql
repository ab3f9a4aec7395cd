-- dedupe-worker: the claim store on PostgreSQL (schema version 1).
-- Put this file in your migrations as it is, or run `dedupe-worker sql init <url>`.
--
-- One row per message key (its stem, <namespace>:{<key>}, compared byte for byte as bytea), one
-- PL/pgSQL function per transition of the protocol: each is the SQL twin of a lua/*.lua script,
-- performs the same state change in one statement (one round trip, one transaction) and returns
-- what the script returns, as rows. The functions are named with the schema version
-- (dedupe_v1_*), so the functions of two releases can live side by side through a rolling
-- upgrade; the table and the token sequence are shared by every version.
--
-- Fencing tokens come from one sequence: strictly increasing for every key across expiry,
-- release, retention and forget (a row deleted and claimed again gets a larger token).
-- Leases are timed by the database's clock (clock_timestamp()). A row whose expires_at has
-- passed counts as absent (as an expired Redis key); `dedupe-worker sql purge` deletes such rows
-- in bounded batches, and the claim path reads rows by primary key only, so their number does
-- not slow it down.
CREATE SEQUENCE IF NOT EXISTS dedupe_tokens;

CREATE TABLE IF NOT EXISTS dedupe_claims (
    stem       bytea       PRIMARY KEY,
    -- the owning token of a live or lapsed lease; 0 when free (released) or done
    owner      bigint      NOT NULL DEFAULT 0,
    -- the last token handed out for this row
    next_token bigint      NOT NULL,
    deadline   timestamptz,
    -- the claim's payload fingerprint and original key (NULL: none)
    fp         text,
    orig       text,
    -- waiters counted by dedupe_v1_watch, notified by completion or release
    waiters    integer     NOT NULL DEFAULT 0,
    -- the stored outcome: status 'c', 'o' or 'f' (NULL: none), its token and value. The check keeps
    -- out a row these functions could not read (inspect.lua's UNREADABLE has no SQL counterpart)
    status     "char"      CHECK (status IN ('c', 'o', 'f')),
    token      bigint,
    value      bytea,
    -- when the row counts as gone: the lease's retention, or the outcome's ttl
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS dedupe_claims_expires_at ON dedupe_claims (expires_at);

-- send.lua's mark: a producer published work for the key (a hint for later sends, never a lock)
CREATE TABLE IF NOT EXISTS dedupe_sent (
    stem       bytea       PRIMARY KEY,
    task_id    text        NOT NULL,
    until      timestamptz NOT NULL,
    fp         text,
    -- the claim row's next_token when the mark was written (NULL: no live row), send.lua's 'n'
    n          bigint,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS dedupe_sent_expires_at ON dedupe_sent (expires_at);

CREATE TABLE IF NOT EXISTS dedupe_schema (
    version    integer     PRIMARY KEY,
    installed  timestamptz NOT NULL DEFAULT now()
);

-- Each transition of many stems is a function over arrays (one statement for a batch) that takes
-- the stems in sorted order, so two batches sharing keys never deadlock, and runs the transition
-- of one stem, the *_key function, for each: the decision is written once, and a call for one
-- stem (run(), complete()) calls the *_key function directly.

-- claim.lua for one stem (free -> claimed): (1, token, '1' when reclaimed else NULL, NULL)
-- ACQUIRED, (2, token, status, value) DUPLICATE, (3, owner, remaining_ms, NULL) IN_PROGRESS,
-- (4, 0, NULL, NULL) CONFLICT.
CREATE OR REPLACE FUNCTION dedupe_v1_claim_key(p_stem bytea, p_fp text, p_orig text, p_lease_ms bigint,
                                               p_retention_ms bigint,
                                               OUT code integer, OUT token bigint, OUT a text, OUT b bytea)
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    lease interval := p_lease_ms * interval '1 millisecond';
    keep interval := greatest(p_lease_ms, p_retention_ms) * interval '1 millisecond';
    v_fp text := nullif(p_fp, '');
    r dedupe_claims%ROWTYPE;
    tok bigint;
BEGIN
    code := 4; token := 0;
    -- a stored outcome is final until it expires or is forgotten: read without a lock
    SELECT * INTO r FROM dedupe_claims c WHERE c.stem = p_stem;
    IF FOUND AND r.status IS NOT NULL AND r.expires_at > now_ THEN
        IF v_fp IS NULL OR r.fp IS NULL OR r.fp = v_fp THEN
            code := 2; token := r.token; a := r.status::text; b := r.value;
        END IF;
        RETURN;
    END IF;
    tok := nextval('dedupe_tokens');
    LOOP
        IF NOT FOUND THEN
            INSERT INTO dedupe_claims AS c (stem, owner, next_token, deadline, fp, orig, expires_at)
            VALUES (p_stem, tok, tok, now_ + lease, v_fp, nullif(p_orig, ''), now_ + keep)
            ON CONFLICT (stem) DO NOTHING;
            IF FOUND THEN
                code := 1; token := tok;
                RETURN;
            END IF;
        END IF;
        SELECT * INTO r FROM dedupe_claims c WHERE c.stem = p_stem FOR UPDATE;
        EXIT WHEN FOUND;  -- else purged in between: insert again
    END LOOP;
    IF r.expires_at <= now_ THEN  -- gone, as an expired key: a first claim
        UPDATE dedupe_claims c SET owner = tok, next_token = tok, deadline = now_ + lease, fp = v_fp,
               orig = nullif(p_orig, ''), waiters = 0, status = NULL, token = NULL, value = NULL,
               expires_at = now_ + keep
         WHERE c.stem = p_stem;
        code := 1; token := tok;
    ELSIF v_fp IS NOT NULL AND r.fp IS NOT NULL AND r.fp <> v_fp
          AND (r.status IS NOT NULL OR (r.owner > 0 AND r.deadline > now_)) THEN
        NULL;  -- CONFLICT
    ELSIF r.status IS NOT NULL THEN
        code := 2; token := r.token; a := r.status::text; b := r.value;
    ELSIF r.owner > 0 AND r.deadline > now_ THEN
        code := 3; token := r.owner;
        a := greatest(1, ceil(extract(epoch FROM r.deadline - now_) * 1000))::bigint::text;
    ELSE  -- released, or its lease ran out: taken over under a larger token
        UPDATE dedupe_claims c SET owner = tok, next_token = tok, deadline = now_ + lease, fp = v_fp,
               orig = nullif(p_orig, ''), expires_at = now_ + keep
         WHERE c.stem = p_stem;
        code := 1; token := tok; a := '1';
    END IF;
END $$;

-- claim.lua over many stems: rows in the order of p_stems. A stem twice in one batch is acquired
-- once, its later copies answer IN_PROGRESS under our own token.
CREATE OR REPLACE FUNCTION dedupe_v1_claim(p_stems bytea[], p_fps text[], p_origs text[],
                                           p_lease_ms bigint, p_retention_ms bigint)
RETURNS TABLE (code integer, token bigint, a text, b bytea)
LANGUAGE plpgsql AS $$
DECLARE
    n integer := coalesce(cardinality(p_stems), 0);
    codes integer[] := array_fill(0, ARRAY[n]);
    tokens bigint[] := array_fill(0::bigint, ARRAY[n]);
    as_ text[] := array_fill(NULL::text, ARRAY[n]);
    bs bytea[] := array_fill(NULL::bytea, ARRAY[n]);
    i integer;
    res record;
BEGIN
    FOR i IN SELECT u.o FROM unnest(p_stems) WITH ORDINALITY AS u(s, o) ORDER BY u.s, u.o LOOP
        res := dedupe_v1_claim_key(p_stems[i], p_fps[i], p_origs[i], p_lease_ms, p_retention_ms);
        codes[i] := res.code; tokens[i] := res.token; as_[i] := res.a; bs[i] := res.b;
    END LOOP;
    RETURN QUERY SELECT u.c, u.t, u.a, u.b FROM unnest(codes, tokens, as_, bs) WITH ORDINALITY AS u(c, t, a, b, o)
                 ORDER BY u.o;
END $$;

-- complete.lua for one stem (claimed -> done): 1 stored (or already stored under the same token:
-- a retried completion), 0 the token no longer owns the claim (nothing written). Waiters are
-- notified on channel dedupe_notice, payload md5(stem) ':' their count, delivered on commit.
CREATE OR REPLACE FUNCTION dedupe_v1_complete_key(p_stem bytea, p_token bigint, p_status text, p_value bytea,
                                                  p_ttl_ms bigint)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    r dedupe_claims%ROWTYPE;
BEGIN
    SELECT * INTO r FROM dedupe_claims c WHERE c.stem = p_stem FOR UPDATE;
    IF NOT FOUND OR r.expires_at <= now_ THEN
        RETURN 0;
    ELSIF r.status IS NULL AND r.owner = p_token THEN
        UPDATE dedupe_claims c SET status = p_status::"char", token = p_token, value = p_value,
               owner = 0, deadline = NULL, waiters = 0, expires_at = now_ + p_ttl_ms * interval '1 millisecond'
         WHERE c.stem = p_stem;
        IF r.waiters > 0 THEN
            PERFORM pg_notify('dedupe_notice', md5(p_stem) || ':' || r.waiters);
        END IF;
        RETURN 1;
    ELSIF r.status IS NOT NULL AND r.token = p_token THEN
        RETURN 1;
    END IF;
    RETURN 0;
END $$;

CREATE OR REPLACE FUNCTION dedupe_v1_complete(p_stems bytea[], p_tokens bigint[], p_statuses text[],
                                              p_values bytea[], p_ttl_ms bigint)
RETURNS integer[]
LANGUAGE plpgsql AS $$
DECLARE
    out_ integer[] := array_fill(0, ARRAY[coalesce(cardinality(p_stems), 0)]);
    i integer;
BEGIN
    FOR i IN SELECT u.o FROM unnest(p_stems) WITH ORDINALITY AS u(s, o) ORDER BY u.s, u.o LOOP
        out_[i] := dedupe_v1_complete_key(p_stems[i], p_tokens[i], p_statuses[i], p_values[i], p_ttl_ms);
    END LOOP;
    RETURN out_;
END $$;

-- release.lua for one stem (claimed -> free): 1 released, 0 not ours. The row (and its token
-- history) is kept for the retention; waiters are notified.
CREATE OR REPLACE FUNCTION dedupe_v1_release_key(p_stem bytea, p_token bigint, p_retention_ms bigint)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    r dedupe_claims%ROWTYPE;
BEGIN
    SELECT * INTO r FROM dedupe_claims c WHERE c.stem = p_stem FOR UPDATE;
    IF NOT FOUND OR r.expires_at <= now_ OR r.status IS NOT NULL OR r.owner <> p_token THEN
        RETURN 0;
    END IF;
    UPDATE dedupe_claims c SET owner = 0, waiters = 0, expires_at = now_ + p_retention_ms * interval '1 millisecond'
     WHERE c.stem = p_stem;
    IF r.waiters > 0 THEN
        PERFORM pg_notify('dedupe_notice', md5(p_stem) || ':' || r.waiters);
    END IF;
    RETURN 1;
END $$;

CREATE OR REPLACE FUNCTION dedupe_v1_release(p_stems bytea[], p_tokens bigint[], p_retention_ms bigint)
RETURNS integer[]
LANGUAGE plpgsql AS $$
DECLARE
    out_ integer[] := array_fill(0, ARRAY[coalesce(cardinality(p_stems), 0)]);
    i integer;
BEGIN
    FOR i IN SELECT u.o FROM unnest(p_stems) WITH ORDINALITY AS u(s, o) ORDER BY u.s, u.o LOOP
        out_[i] := dedupe_v1_release_key(p_stems[i], p_tokens[i], p_retention_ms);
    END LOOP;
    RETURN out_;
END $$;

-- renew.lua for one stem (claimed -> claimed, later deadline). A lease that ran out but was not
-- taken by anyone is still ours and is extended. 1 extended, 0 not ours.
CREATE OR REPLACE FUNCTION dedupe_v1_renew_key(p_stem bytea, p_token bigint, p_lease_ms bigint,
                                               p_retention_ms bigint)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
BEGIN
    UPDATE dedupe_claims c SET deadline = now_ + p_lease_ms * interval '1 millisecond',
           expires_at = now_ + greatest(p_lease_ms, p_retention_ms) * interval '1 millisecond'
     WHERE c.stem = p_stem AND c.owner = p_token AND c.status IS NULL AND c.expires_at > now_;
    RETURN CASE WHEN FOUND THEN 1 ELSE 0 END;
END $$;

CREATE OR REPLACE FUNCTION dedupe_v1_renew(p_stems bytea[], p_tokens bigint[], p_lease_ms bigint,
                                           p_retention_ms bigint)
RETURNS integer[]
LANGUAGE plpgsql AS $$
DECLARE
    out_ integer[] := array_fill(0, ARRAY[coalesce(cardinality(p_stems), 0)]);
    i integer;
BEGIN
    FOR i IN SELECT u.o FROM unnest(p_stems) WITH ORDINALITY AS u(s, o) ORDER BY u.s, u.o LOOP
        out_[i] := dedupe_v1_renew_key(p_stems[i], p_tokens[i], p_lease_ms, p_retention_ms);
    END LOOP;
    RETURN out_;
END $$;

-- inspect.lua: the state of one stem, unchanged: (2, token, status, value, fp) done,
-- (3, owner, remaining_ms, NULL, NULL) a live lease, (0, last token, NULL, NULL, NULL) free.
CREATE OR REPLACE FUNCTION dedupe_v1_inspect(p_stem bytea)
RETURNS TABLE (code integer, token bigint, a text, b bytea, fp text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    r dedupe_claims%ROWTYPE;
BEGIN
    SELECT * INTO r FROM dedupe_claims c WHERE c.stem = p_stem;
    IF NOT FOUND OR r.expires_at <= now_ THEN
        RETURN QUERY SELECT 0, 0::bigint, NULL::text, NULL::bytea, NULL::text;
    ELSIF r.status IS NOT NULL THEN
        RETURN QUERY SELECT 2, r.token, r.status::text, r.value, coalesce(r.fp, '');
    ELSIF r.owner > 0 AND r.deadline > now_ THEN
        RETURN QUERY SELECT 3, r.owner, greatest(1, ceil(extract(epoch FROM r.deadline - now_) * 1000))::bigint::text,
                            NULL::bytea, NULL::text;
    ELSE
        RETURN QUERY SELECT 0, r.next_token, NULL::text, NULL::bytea, NULL::text;
    END IF;
END $$;

-- watch.lua: count one waiter on a stem held by a live lease; the lease's remaining
-- milliseconds, or 0 (done, free, or lapsed: claim again now).
CREATE OR REPLACE FUNCTION dedupe_v1_watch(p_stem bytea)
RETURNS bigint
LANGUAGE sql AS $$
    UPDATE dedupe_claims c SET waiters = c.waiters + 1
     WHERE c.stem = p_stem AND c.status IS NULL AND c.owner > 0 AND c.deadline > clock_timestamp()
       AND c.expires_at > clock_timestamp()
    RETURNING greatest(1, ceil(extract(epoch FROM c.deadline - clock_timestamp()) * 1000))::bigint
$$;

-- forget.lua: remove a stem's row (any -> never seen): (1, token) removed, (0, 0) nothing there,
-- (-1, owner) a live lease and not forced, (-2, token) another token than p_token.
CREATE OR REPLACE FUNCTION dedupe_v1_forget(p_stem bytea, p_token bigint, p_force boolean)
RETURNS TABLE (code integer, token bigint)
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    r dedupe_claims%ROWTYPE;
    live boolean;
    tok bigint;
BEGIN
    SELECT * INTO r FROM dedupe_claims c WHERE c.stem = p_stem FOR UPDATE;
    IF NOT FOUND OR r.expires_at <= now_ THEN
        RETURN QUERY SELECT 0, 0::bigint;
        RETURN;
    END IF;
    live := r.status IS NULL AND r.owner > 0 AND r.deadline > now_;
    tok := CASE WHEN r.status IS NOT NULL THEN r.token WHEN live THEN r.owner ELSE r.next_token END;
    IF p_token IS NOT NULL AND p_token <> tok THEN
        RETURN QUERY SELECT -2, tok;
    ELSIF live AND NOT p_force AND p_token IS NULL THEN
        RETURN QUERY SELECT -1, r.owner;
    ELSE
        DELETE FROM dedupe_claims c WHERE c.stem = p_stem;
        RETURN QUERY SELECT 1, tok;
    END IF;
END $$;

-- send.lua: may a producer publish work for a stem (free -> sent; every other answer changes
-- nothing)? (1, 0, ttl_ms, NULL, id) PUBLISH: the mark now records id; (2, token, status, value,
-- id) DONE; (3, owner, remaining_ms, NULL, id) RUNNING: a live lease and a mark; (4, 0, NULL,
-- NULL, NULL) CONFLICT; (5, 0, remaining_ms, NULL, id) QUEUED: a live mark, no claim since it was
-- written. The mark row is locked (made first if missing), so of two sends at once one publishes.
-- The mark records the claim row's next_token (n): once a claim has been taken since, the task it
-- names was started, so with no live lease on the key (released, or its worker died) the mark no
-- longer answers QUEUED and the send publishes, as send.lua does.
CREATE OR REPLACE FUNCTION dedupe_v1_send(p_stem bytea, p_id text, p_ttl_ms bigint, p_keep_ms bigint, p_fp text,
                                          OUT code integer, OUT token bigint, OUT a text, OUT b bytea,
                                          OUT task_id text)
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    v_fp text := nullif(p_fp, '');
    r dedupe_claims%ROWTYPE;
    m dedupe_sent%ROWTYPE;
    live_mark boolean;
    counter bigint;
BEGIN
    code := 4; token := 0;
    INSERT INTO dedupe_sent AS s (stem, task_id, until, expires_at) VALUES (p_stem, '', now_, now_)
    ON CONFLICT (stem) DO NOTHING;
    SELECT * INTO m FROM dedupe_sent s WHERE s.stem = p_stem FOR UPDATE;
    live_mark := m.expires_at > now_ AND m.task_id <> '';
    SELECT * INTO r FROM dedupe_claims c WHERE c.stem = p_stem AND c.expires_at > now_;
    IF FOUND THEN
        counter := r.next_token;
    END IF;
    IF FOUND AND r.status IS NOT NULL THEN
        IF v_fp IS NULL OR r.fp IS NULL OR r.fp = v_fp THEN
            code := 2; token := r.token; a := r.status::text; b := r.value;
            task_id := CASE WHEN live_mark THEN m.task_id ELSE '' END;
        END IF;
        RETURN;
    END IF;
    IF FOUND AND r.owner > 0 AND r.deadline > now_ THEN
        IF v_fp IS NOT NULL AND r.fp IS NOT NULL AND r.fp <> v_fp THEN
            RETURN;
        END IF;
        IF live_mark THEN
            code := 3; token := r.owner; task_id := m.task_id;
            a := greatest(1, ceil(extract(epoch FROM r.deadline - now_) * 1000))::bigint::text;
            RETURN;
        END IF;
    ELSIF live_mark AND m.until > now_ AND m.n IS NOT DISTINCT FROM counter THEN
        IF v_fp IS NULL OR m.fp IS NULL OR m.fp = v_fp THEN
            code := 5; task_id := m.task_id;
            a := greatest(1, ceil(extract(epoch FROM m.until - now_) * 1000))::bigint::text;
        END IF;
        RETURN;
    END IF;
    UPDATE dedupe_sent s SET task_id = p_id, until = now_ + p_ttl_ms * interval '1 millisecond', fp = v_fp,
           n = counter, expires_at = now_ + (p_ttl_ms + p_keep_ms) * interval '1 millisecond'
     WHERE s.stem = p_stem;
    code := 1; a := p_ttl_ms::text; task_id := p_id;
END $$;

-- unsend.lua: take back the mark of a send whose publish raised (sent -> free), fenced by the
-- task id: 1 removed, 0 it names another task (a later send's mark, left as it is) or is gone.
CREATE OR REPLACE FUNCTION dedupe_v1_unsend(p_stem bytea, p_id text)
RETURNS integer
LANGUAGE sql AS $$
    WITH gone AS (DELETE FROM dedupe_sent s WHERE s.stem = p_stem AND s.task_id = p_id AND s.task_id <> ''
                  AND s.expires_at > clock_timestamp() RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;

INSERT INTO dedupe_schema (version) VALUES (1) ON CONFLICT (version) DO NOTHING;
