-- 0037: one claim statement for requests in different trace contexts: the
-- service claims for every request that arrived together at once, and
-- when each request is traced its own context must reach the transitions
-- of the issues it claimed. `newsnack_claim_traced` gets a form taking one
-- context per id, which it hands to the transition trigger as
-- `newsnack.issue_traceparents` (`,<id>=<traceparent>,..`, local to the
-- transaction); completions made together set the same. The form taking
-- one context stays for instances of the previous release during a
-- rolling upgrade.

CREATE FUNCTION @extschema@.newsnack_claim_traced(
    ids bigint[], holder text, lease_s double precision, retry_below integer, traceparents text[]
) RETURNS TABLE (id bigint, claim_id bigint, attempts integer, title text, body text,
                 lease_until timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('newsnack.issue_traceparents',
        COALESCE(',' || string_agg(c.id || '=' || c.traceparent, ','), ''), true)
       FROM unnest(ids, traceparents) AS c(id, traceparent)
      WHERE c.traceparent IS NOT NULL;
    RETURN QUERY SELECT * FROM @extschema@.newsnack_claim(ids, holder, lease_s, retry_below);
END
$$;

REVOKE EXECUTE ON FUNCTION
    @extschema@.newsnack_claim_traced(bigint[], text, double precision, integer, text[])
FROM PUBLIC;

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
    context pg_catalog.text;
    issue_contexts pg_catalog.text;
    named_at pg_catalog.int4;
BEGIN
    IF TG_OP OPERATOR(pg_catalog.=) 'UPDATE' THEN
        -- Not a transition (`processing_status` is never NULL).
        IF NEW.processing_status OPERATOR(pg_catalog.=) OLD.processing_status THEN
            RETURN NULL;
        END IF;
        from_status := OLD.processing_status;
    END IF;
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
    fatal := NEW.processing_status OPERATOR(pg_catalog.=) 'FAILED'
        AND COALESCE(NEW.retry_not_before OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz, false);
    -- The writing transaction's trace context, or the issue's own where
    -- one statement wrote for several contexts (`newsnack.issue_traceparents`,
    -- `,<id>=<traceparent>,..`: a claim or completions made together).
    context := pg_catalog.current_setting('newsnack.traceparent', true);
    issue_contexts := pg_catalog.current_setting('newsnack.issue_traceparents', true);
    named_at := pg_catalog.strpos(issue_contexts, ',' OPERATOR(pg_catalog.||) NEW.id OPERATOR(pg_catalog.||) '=');
    IF named_at OPERATOR(pg_catalog.>) 0 THEN
        context := pg_catalog.substr(issue_contexts,
            named_at OPERATOR(pg_catalog.+) pg_catalog.length(NEW.id::pg_catalog.text) OPERATOR(pg_catalog.+) 2, 55);
    END IF;
    SELECT k.key INTO signing_key FROM @extschema@.notification_key k;
    -- Serialise `seq` allocation with commit order (see 0002).
    IF pg_catalog.pg_advisory_xact_lock(7236284560371893001) IS NULL THEN NULL; END IF;
    INSERT INTO @extschema@.issue_transition (issue_id, from_status, to_status, at, attempts, claim_id, claimed_by, reason, fatal, traceparent)
    VALUES (
        NEW.id,
        from_status,
        NEW.processing_status,
        pg_catalog.clock_timestamp(),
        NEW.attempts,
        NEW.claim_id,
        NEW.claimed_by,
        CASE WHEN NEW.processing_status OPERATOR(pg_catalog.=) 'FAILED' THEN NEW.last_error END,
        fatal,
        -- An issue's first transition falls back on the issue's own. No
        -- context, no call: most transitions have none.
        COALESCE(CASE WHEN context OPERATOR(pg_catalog.<>) '' THEN @extschema@.newsnack_traceparent(context) END,
                 CASE WHEN TG_OP OPERATOR(pg_catalog.=) 'INSERT' THEN NEW.traceparent END)
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
