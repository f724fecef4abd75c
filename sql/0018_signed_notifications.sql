-- 0018: each transition's notification is signed with a key only the
-- owner may read (`notification_key`, rotated with
-- `newsnack_rotate_notification_key()`), so that the listener may publish
-- a signed payload without reading the log back.

CREATE TABLE @extschema@.notification_key (
    only_row  boolean PRIMARY KEY DEFAULT true CONSTRAINT notification_key_one_row CHECK (only_row),
    key       bytea NOT NULL CONSTRAINT notification_key_length CHECK (length(key) = 32),
    -- HMAC's inner and outer blocks (the key, zero-padded to SHA-256's 64
    -- bytes, XOR 0x36 and XOR 0x5c), kept so that signing is two hashes.
    inner_pad bytea NOT NULL,
    outer_pad bytea NOT NULL
);
REVOKE ALL ON @extschema@.notification_key FROM PUBLIC;

CREATE FUNCTION @extschema@.newsnack_rotate_notification_key() RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    k bytea := decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex');
    ipad bytea := decode(repeat('36', 64), 'hex');
    opad bytea := decode(repeat('5c', 64), 'hex');
BEGIN
    FOR i IN 0..31 LOOP
        ipad := set_byte(ipad, i, get_byte(k, i) # 54);
        opad := set_byte(opad, i, get_byte(k, i) # 92);
    END LOOP;
    INSERT INTO @extschema@.notification_key (key, inner_pad, outer_pad) VALUES (k, ipad, opad)
    ON CONFLICT (only_row) DO UPDATE
       SET key = EXCLUDED.key, inner_pad = EXCLUDED.inner_pad, outer_pad = EXCLUDED.outer_pad;
END
$$;
REVOKE EXECUTE ON FUNCTION @extschema@.newsnack_rotate_notification_key() FROM PUBLIC;

SELECT @extschema@.newsnack_rotate_notification_key();

CREATE OR REPLACE FUNCTION @extschema@.issue_transition_record() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    logged @extschema@.issue_transition;
    open_for interval;
    payload text;
    signing @extschema@.notification_key;
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
    PERFORM pg_advisory_xact_lock(7236284560371893001);
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
    payload := json_build_object(
        'seq', logged.seq,
        'issue_id', logged.issue_id,
        'from', logged.from_status,
        'to', logged.to_status,
        'at', logged.at,
        'attempts', logged.attempts,
        'fatal', logged.fatal
    )::text;
    SELECT * INTO signing FROM @extschema@.notification_key;
    IF FOUND THEN
        -- The object's closing brace gives way to the MAC of the payload
        -- as it was: `.., "mac" : "<64 hex digits>"}` (src/transition.rs).
        payload := left(payload, -1) || ', "mac" : "'
            || encode(sha256(signing.outer_pad || sha256(signing.inner_pad || convert_to(payload, 'UTF8'))), 'hex')
            || '"}';
    END IF;
    PERFORM pg_notify('issue_transition', payload);
    RETURN NULL;
END
$$;
