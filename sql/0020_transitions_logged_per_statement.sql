-- 0020: a statement's transitions are logged together, at commit.
--
-- Until now a deferred row trigger logged, signed and announced each
-- transition at commit, one run of PL/pgSQL and one INSERT per issue, all
-- but the first while holding the lock that keeps the log's order the
-- commit order (see 0002). For a claim of 32 issues that was about 170,000
-- instructions per issue spent while every other transitioning commit
-- waited (docs/performance.md, "Transitions logged per statement").
--
-- Now a statement trigger gathers the statement's transitions from its
-- transition tables, outside the lock, into one row of
-- `issue_transition_batch`; that row's deferred trigger takes the lock at
-- commit, deletes the batch and logs it with one statement, reads the key
-- once, then signs and announces each row as 0019 did (the same payload,
-- to the byte). Batches are flushed in the order their statements
-- ran; within a statement, in the order of the issues' ids.
--
-- The statement trigger pairs each issue's old and new row by `id`, so an
-- issue's `id` may no longer change: it is also how articles, briefings
-- and the log name the issue.

CREATE TYPE @extschema@.issue_transition_draft AS (
    issue_id    bigint,
    from_status text,
    to_status   text,
    attempts    integer,
    claim_id    bigint,
    claimed_by  text,
    reason      text,
    fatal       boolean
);

-- Rows live only inside the transaction that wrote them: the flush deletes
-- each one before its commit.
CREATE TABLE @extschema@.issue_transition_batch (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    transitions @extschema@.issue_transition_draft[] NOT NULL
);
REVOKE ALL ON @extschema@.issue_transition_batch FROM PUBLIC;

CREATE FUNCTION @extschema@.issue_transition_stage() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO @extschema@.issue_transition_batch (transitions)
        SELECT array_agg(ROW(n.id, NULL, n.processing_status, n.attempts, n.claim_id, n.claimed_by, NULL, false)::@extschema@.issue_transition_draft
                         ORDER BY n.id)
          FROM new_rows n
        HAVING count(*) > 0;
    ELSE
        -- A claim that takes nothing updates no row, and most claims of
        -- a busy start take nothing: spare them the gathering, which costs
        -- more than such a claim itself (docs/performance.md).
        IF NOT EXISTS (SELECT FROM new_rows) THEN
            RETURN NULL;
        END IF;
        INSERT INTO @extschema@.issue_transition_batch (transitions)
        SELECT array_agg(ROW(n.id, o.processing_status, n.processing_status, n.attempts, n.claim_id, n.claimed_by,
                             CASE WHEN n.processing_status = 'FAILED' THEN n.last_error END,
                             n.processing_status = 'FAILED' AND COALESCE(n.retry_not_before = 'infinity', false)
                            )::@extschema@.issue_transition_draft
                         ORDER BY n.id)
          FROM new_rows n JOIN old_rows o ON o.id = n.id
         WHERE o.processing_status IS DISTINCT FROM n.processing_status
        HAVING count(*) > 0;
    END IF;
    RETURN NULL;
END
$$;
REVOKE EXECUTE ON FUNCTION @extschema@.issue_transition_stage() FROM PUBLIC;

CREATE FUNCTION @extschema@.issue_transition_flush() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    open_for interval;
    logged record;
    payload text;
    key_inner bytea;
    key_outer bytea;
BEGIN
    -- A claim's lease counts from its commit, which is now: if the
    -- transaction was open for more than a second, move the lease on by
    -- that long, only while the issue is still in this claim (a later
    -- statement of the transaction may have finished or released it).
    -- Before the log's lock, which every committing transition waits for.
    open_for := clock_timestamp() - now();
    IF open_for > interval '1 second' THEN
        UPDATE @extschema@.issue i SET lease_until = i.lease_until + open_for
          FROM unnest(NEW.transitions) t
         WHERE t.to_status = 'IN_PROGRESS' AND i.id = t.issue_id AND i.claim_id = t.claim_id
           AND i.processing_status = 'IN_PROGRESS';
    END IF;
    -- Serialise `seq` allocation with commit order (see 0002).
    IF pg_advisory_xact_lock(7236284560371893001) IS NULL THEN NULL; END IF;
    SELECT k.inner_pad, k.outer_pad INTO key_inner, key_outer FROM @extschema@.notification_key k;
    FOR logged IN
        WITH flushed AS (DELETE FROM @extschema@.issue_transition_batch WHERE id = NEW.id)
        INSERT INTO @extschema@.issue_transition (issue_id, from_status, to_status, at, attempts, claim_id, claimed_by, reason, fatal)
        SELECT t.issue_id, t.from_status, t.to_status, clock_timestamp(), t.attempts, t.claim_id, t.claimed_by, t.reason, t.fatal
          FROM unnest(NEW.transitions) WITH ORDINALITY AS t
         ORDER BY t.ordinality
        RETURNING seq, issue_id, from_status, to_status, at, attempts, fatal
    LOOP
        -- The payload of 0019, to the byte; the statuses need no escaping.
        payload := '{"seq" : ' || logged.seq
            || ', "issue_id" : ' || logged.issue_id
            || ', "from" : ' || COALESCE('"' || logged.from_status || '"', 'null')
            || ', "to" : "' || logged.to_status
            || '", "at" : ' || to_json(logged.at)::text
            || ', "attempts" : ' || logged.attempts
            || ', "fatal" : ' || logged.fatal || '}';
        IF key_inner IS NOT NULL THEN
            -- The object's closing brace gives way to the MAC of the
            -- payload as it was: `.., "mac" : "<64 hex digits>"}`.
            payload := left(payload, -1) || ', "mac" : "'
                || encode(sha256(key_outer || sha256(key_inner || convert_to(payload, 'UTF8'))), 'hex')
                || '"}';
        END IF;
        IF pg_notify('issue_transition', payload) IS NULL THEN NULL; END IF;
    END LOOP;
    RETURN NULL;
END
$$;
REVOKE EXECUTE ON FUNCTION @extschema@.issue_transition_flush() FROM PUBLIC;

CREATE FUNCTION @extschema@.issue_keep_id() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'an issue''s id cannot change (issue %)', OLD.id
        USING ERRCODE = 'check_violation',
              HINT = 'the log, articles and briefings name issues by id';
END
$$;
REVOKE EXECUTE ON FUNCTION @extschema@.issue_keep_id() FROM PUBLIC;

DROP TRIGGER issue_transition_on_insert ON @extschema@.issue;
DROP TRIGGER issue_transition_on_update ON @extschema@.issue;
DROP FUNCTION @extschema@.issue_transition_record();

CREATE TRIGGER issue_keep_id BEFORE UPDATE OF id ON @extschema@.issue
    FOR EACH ROW WHEN (OLD.id IS DISTINCT FROM NEW.id)
    EXECUTE FUNCTION @extschema@.issue_keep_id();
CREATE TRIGGER issue_transition_on_insert AFTER INSERT ON @extschema@.issue
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.issue_transition_stage();
CREATE TRIGGER issue_transition_on_update AFTER UPDATE ON @extschema@.issue
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.issue_transition_stage();
CREATE CONSTRAINT TRIGGER issue_transition_flush AFTER INSERT ON @extschema@.issue_transition_batch
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION @extschema@.issue_transition_flush();
