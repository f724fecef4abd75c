-- 0019: a transition's log row, signature and notification cost less.
--
-- The transition trigger runs at commit, holding the lock that keeps the
-- log's order the commit order, so every instruction it spends is spent
-- while every other transitioning commit waits (docs/performance.md,
-- "Where a claim's time goes"). Measured with callgrind per claimed issue
-- (32-id claims, single-user backend), four things cost without need:
--
-- - `PERFORM f()` runs a whole query (executor start and end) where an
--   expression does: the lock and the notification are now expressions
--   (`IF f() IS NULL THEN NULL; END IF;`, PL/pgSQL's fast path);
-- - the key was read into a row of the table's type: now its two columns
--   into two variables;
-- - `issue_transition_at_in_range` (migration 13) was read back from the
--   catalogue and compiled for each log row, one statement each: about 5%
--   of a claim. Since migration 15 only the owner writes the log, and only
--   through this trigger, which writes `clock_timestamp()`: no role that
--   `grant` makes can store a time the service cannot read, and the
--   constraint goes;
-- - `json_build_object` looked up how to print each of its values on
--   every call: the payload, the very same text, is now concatenated.
--
-- What the trigger does, and the payload it signs (to the byte), are as
-- in 0018.

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
