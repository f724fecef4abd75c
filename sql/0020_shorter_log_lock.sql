-- 0020: the transition trigger does less while it holds the log's lock:
-- the MAC is SHA-384 of the key followed by the payload (96 hex digits; it
-- was an HMAC-SHA256), only `seq` and `at` come back from the insert, and
-- the trigger names everything with its schema instead of
-- `SET search_path`. `notification_key` drops HMAC's padded keys.

CREATE OR REPLACE FUNCTION @extschema@.newsnack_rotate_notification_key() RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO @extschema@.notification_key (key)
    VALUES (decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'))
    ON CONFLICT (only_row) DO UPDATE SET key = EXCLUDED.key;
END
$$;

ALTER TABLE @extschema@.notification_key DROP COLUMN inner_pad, DROP COLUMN outer_pad;

CREATE OR REPLACE FUNCTION @extschema@.issue_transition_record() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER AS $$
DECLARE
    open_for pg_catalog.interval;
    from_status pg_catalog.text;
    fatal pg_catalog.bool;
    logged_seq pg_catalog.int8;
    logged_at pg_catalog.timestamptz;
    fields pg_catalog.text;
    signing_key pg_catalog.bytea;
BEGIN
    -- A claim's lease counts from its commit, which is now: if the
    -- transaction was open for more than a second, move the lease on by
    -- that long (the row is this transaction's own, so nothing waits). Only
    -- while the issue is still in this claim: a later statement of the
    -- same transaction may have finished or released it. Before the log's
    -- lock, which every committing transition waits for.
    IF NEW.processing_status OPERATOR(pg_catalog.=) 'IN_PROGRESS' THEN
        open_for := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) pg_catalog.now();
        IF open_for OPERATOR(pg_catalog.>) '1 second'::pg_catalog.interval THEN
            UPDATE @extschema@.issue SET lease_until = lease_until OPERATOR(pg_catalog.+) open_for
             WHERE id OPERATOR(pg_catalog.=) NEW.id
               AND claim_id OPERATOR(pg_catalog.=) NEW.claim_id
               AND processing_status OPERATOR(pg_catalog.=) 'IN_PROGRESS';
        END IF;
    END IF;
    IF TG_OP OPERATOR(pg_catalog.=) 'UPDATE' THEN
        from_status := OLD.processing_status;
    END IF;
    fatal := NEW.processing_status OPERATOR(pg_catalog.=) 'FAILED'
        AND COALESCE(NEW.retry_not_before OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz, false);
    -- Serialise `seq` allocation with commit order (see 0002).
    IF pg_catalog.pg_advisory_xact_lock(7236284560371893001) IS NULL THEN NULL; END IF;
    INSERT INTO @extschema@.issue_transition (issue_id, from_status, to_status, at, attempts, claim_id, claimed_by, reason, fatal)
    VALUES (
        NEW.id,
        from_status,
        NEW.processing_status,
        pg_catalog.clock_timestamp(),
        NEW.attempts,
        NEW.claim_id,
        NEW.claimed_by,
        CASE WHEN NEW.processing_status OPERATOR(pg_catalog.=) 'FAILED' THEN NEW.last_error END,
        fatal
    )
    RETURNING seq, at INTO logged_seq, logged_at;
    -- The payload as 0019 wrote it, its closing brace left for the end.
    -- The statuses need no escaping: they are the four names `issue`'s
    -- check allows.
    fields := '{"seq" : ' OPERATOR(pg_catalog.||) logged_seq
        OPERATOR(pg_catalog.||) ', "issue_id" : ' OPERATOR(pg_catalog.||) NEW.id
        OPERATOR(pg_catalog.||) ', "from" : '
        OPERATOR(pg_catalog.||) COALESCE('"' OPERATOR(pg_catalog.||) from_status OPERATOR(pg_catalog.||) '"', 'null')
        OPERATOR(pg_catalog.||) ', "to" : "' OPERATOR(pg_catalog.||) NEW.processing_status
        OPERATOR(pg_catalog.||) '", "at" : ' OPERATOR(pg_catalog.||) pg_catalog.to_json(logged_at)::pg_catalog.text
        OPERATOR(pg_catalog.||) ', "attempts" : ' OPERATOR(pg_catalog.||) NEW.attempts
        OPERATOR(pg_catalog.||) ', "fatal" : ' OPERATOR(pg_catalog.||) fatal;
    SELECT k.key INTO signing_key FROM @extschema@.notification_key k;
    IF signing_key IS NULL THEN
        IF pg_catalog.pg_notify('issue_transition', fields OPERATOR(pg_catalog.||) '}') IS NULL THEN NULL; END IF;
    ELSE
        -- `.., "mac" : "<96 hex digits>"}`: the MAC of the payload as it
        -- would end without it, `.., "fatal" : ..}` (src/transition.rs).
        IF pg_catalog.pg_notify('issue_transition', fields OPERATOR(pg_catalog.||) ', "mac" : "'
            OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.sha384(signing_key
                OPERATOR(pg_catalog.||) pg_catalog.convert_to(fields OPERATOR(pg_catalog.||) '}', 'UTF8')), 'hex')
            OPERATOR(pg_catalog.||) '"}') IS NULL THEN NULL; END IF;
    END IF;
    RETURN NULL;
END
$$;
