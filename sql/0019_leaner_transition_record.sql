-- 0019: the transition trigger costs less (docs/performance.md): its lock
-- and notification are expressions, the key is read into two variables and
-- the payload is concatenated (the same text); the log's `at` check goes,
-- since only this trigger writes the log.

ALTER TABLE @extschema@.issue_transition DROP CONSTRAINT IF EXISTS issue_transition_at_in_range;

CREATE OR REPLACE FUNCTION @extschema@.issue_transition_record() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    logged @extschema@.issue_transition;
    open_for interval;
    payload text;
    key_inner bytea;
    key_outer bytea;
BEGIN
    -- A claim's lease counts from its commit, which is now: if the
    -- transaction was open for more than a second, move the lease on by
    -- that long (the row is this transaction's own, so nothing waits). Only
    -- while the issue is still in this claim: a later statement of the
    -- same transaction may have finished or released it. Before the log's
    -- lock, which every committing transition waits for.
    IF NEW.processing_status = 'IN_PROGRESS' THEN
        open_for := clock_timestamp() - now();
        IF open_for > interval '1 second' THEN
            UPDATE @extschema@.issue SET lease_until = lease_until + open_for
             WHERE id = NEW.id AND claim_id = NEW.claim_id AND processing_status = 'IN_PROGRESS';
        END IF;
    END IF;
    -- Serialise `seq` allocation with commit order (see 0002).
    IF pg_advisory_xact_lock(7236284560371893001) IS NULL THEN NULL; END IF;
    INSERT INTO @extschema@.issue_transition (issue_id, from_status, to_status, at, attempts, claim_id, claimed_by, reason, fatal)
    VALUES (
        NEW.id,
        CASE WHEN TG_OP = 'UPDATE' THEN OLD.processing_status END,
        NEW.processing_status,
        clock_timestamp(),
        NEW.attempts,
        NEW.claim_id,
        NEW.claimed_by,
        CASE WHEN NEW.processing_status = 'FAILED' THEN NEW.last_error END,
        NEW.processing_status = 'FAILED' AND COALESCE(NEW.retry_not_before = 'infinity', false)
    )
    RETURNING * INTO logged;
    -- The text json_build_object made in 0018, written out: it looked up
    -- how to print each of its seven values on every call. The statuses
    -- need no escaping: they are the four names `issue`'s check allows.
    payload := '{"seq" : ' || logged.seq
        || ', "issue_id" : ' || logged.issue_id
        || ', "from" : ' || COALESCE('"' || logged.from_status || '"', 'null')
        || ', "to" : "' || logged.to_status
        || '", "at" : ' || to_json(logged.at)::text
        || ', "attempts" : ' || logged.attempts
        || ', "fatal" : ' || logged.fatal || '}';
    SELECT k.inner_pad, k.outer_pad INTO key_inner, key_outer FROM @extschema@.notification_key k;
    IF FOUND THEN
        -- The object's closing brace gives way to the MAC of the payload
        -- as it was: `.., "mac" : "<64 hex digits>"}` (src/transition.rs).
        payload := left(payload, -1) || ', "mac" : "'
            || encode(sha256(key_outer || sha256(key_inner || convert_to(payload, 'UTF8'))), 'hex')
            || '"}';
    END IF;
    IF pg_notify('issue_transition', payload) IS NULL THEN NULL; END IF;
    RETURN NULL;
END
$$;
