-- 0021: less per writing statement on `issue` (docs/performance.md): the
-- checks of `issue` and `ai_article` in fewer nodes (same names, same
-- meaning; the date checks still NOT VALID), no WHEN clause on
-- `issue_transition_on_update` (the function returns when the status
-- stayed), and the signing key read before the log's lock.

ALTER TABLE @extschema@.issue
    DROP CONSTRAINT issue_processing_status_valid,
    ADD CONSTRAINT issue_processing_status_valid
        CHECK (processing_status = ANY ('{PENDING,IN_PROGRESS,DONE,FAILED}'::text[])),
    DROP CONSTRAINT issue_score_finite,
    ADD CONSTRAINT issue_score_finite
        CHECK (score <> ALL ('{NaN,Infinity,-Infinity}'::double precision[])),
    DROP CONSTRAINT issue_collected_at_in_range,
    ADD CONSTRAINT issue_collected_at_in_range
        CHECK (collected_at <@ '[0001-01-01 00:00:00+00,10000-01-01 00:00:00+00)'::tstzrange)
        NOT VALID,
    DROP CONSTRAINT issue_updated_at_in_range,
    ADD CONSTRAINT issue_updated_at_in_range
        CHECK (updated_at <@ '[0001-01-01 00:00:00+00,10000-01-01 00:00:00+00)'::tstzrange)
        NOT VALID;

ALTER TABLE @extschema@.ai_article
    DROP CONSTRAINT ai_article_created_at_in_range,
    ADD CONSTRAINT ai_article_created_at_in_range
        CHECK (created_at <@ '[0001-01-01 00:00:00+00,10000-01-01 00:00:00+00)'::tstzrange)
        NOT VALID;

DROP TRIGGER issue_transition_on_update ON @extschema@.issue;
CREATE CONSTRAINT TRIGGER issue_transition_on_update AFTER UPDATE OF processing_status ON @extschema@.issue
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION @extschema@.issue_transition_record();

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
    SELECT k.key INTO signing_key FROM @extschema@.notification_key k;
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

-- The rule and the two helpers inlined into it name every operator,
-- function, type and table with its schema instead of running under
-- `SET search_path`; what they do is unchanged.

CREATE OR REPLACE FUNCTION @extschema@.issue_transition_is_legal(from_status text, to_status text)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (from_status OPERATOR(pg_catalog.=) 'PENDING' AND to_status OPERATOR(pg_catalog.=) 'IN_PROGRESS')
        OR (from_status OPERATOR(pg_catalog.=) 'FAILED' AND to_status OPERATOR(pg_catalog.=) 'IN_PROGRESS')
        OR (from_status OPERATOR(pg_catalog.=) 'IN_PROGRESS' AND to_status OPERATOR(pg_catalog.=) 'DONE')
        OR (from_status OPERATOR(pg_catalog.=) 'IN_PROGRESS' AND to_status OPERATOR(pg_catalog.=) 'FAILED')
        OR (from_status OPERATOR(pg_catalog.=) 'FAILED' AND to_status OPERATOR(pg_catalog.=) 'PENDING')
$$;

CREATE OR REPLACE FUNCTION @extschema@.newsnack_lease_seconds() RETURNS integer LANGUAGE sql STABLE AS $$
    SELECT COALESCE((SELECT s.value::pg_catalog.int4 FROM @extschema@.setting s
                      WHERE s.key OPERATOR(pg_catalog.=) 'lease_s'), 60)
$$;

CREATE OR REPLACE FUNCTION @extschema@.issue_before_update() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER AS $$
BEGIN
    -- `OLD.processing_status` is never NULL; a NULL new one is a change.
    IF NEW.processing_status OPERATOR(pg_catalog.=) OLD.processing_status THEN
        -- Not a transition. Only a live claim's lease and holder may move.
        IF NEW.processing_status OPERATOR(pg_catalog.<>) 'IN_PROGRESS' THEN
            NEW.lease_until := OLD.lease_until;
        ELSIF NEW.lease_until IS NULL OR NOT pg_catalog.isfinite(NEW.lease_until) THEN
            NEW.lease_until := OLD.lease_until;
        ELSIF OLD.lease_until IS NULL OR NEW.lease_until OPERATOR(pg_catalog.<>) OLD.lease_until THEN
            -- Within 24 hours of now (the longest `lease_s`).
            NEW.lease_until := least(greatest(NEW.lease_until,
                    pg_catalog.now() OPERATOR(pg_catalog.-) '24 hours'::pg_catalog.interval),
                pg_catalog.now() OPERATOR(pg_catalog.+) '24 hours'::pg_catalog.interval);
        END IF;
        NEW.claim_id := OLD.claim_id;
        NEW.attempts := OLD.attempts;
        RETURN NEW;
    END IF;
    IF NOT @extschema@.issue_transition_is_legal(OLD.processing_status, NEW.processing_status) THEN
        RAISE EXCEPTION 'illegal status transition for issue %: % -> %',
            OLD.id, OLD.processing_status, NEW.processing_status
            USING ERRCODE = 'check_violation',
                  HINT = 'legal: PENDING->IN_PROGRESS, FAILED->IN_PROGRESS, IN_PROGRESS->DONE, IN_PROGRESS->FAILED, FAILED->PENDING';
    END IF;
    NEW.updated_at := pg_catalog.now();
    IF NEW.processing_status OPERATOR(pg_catalog.=) 'IN_PROGRESS' THEN
        -- Every claim, by anyone, is a new attempt with a new fencing token.
        NEW.attempts := OLD.attempts OPERATOR(pg_catalog.+) 1;
        NEW.retry_not_before := NULL;
        -- A fresh token unless the statement drew a newer one itself:
        -- never none, and never one this issue had before.
        IF NEW.claim_id IS NULL
           OR OLD.claim_id IS NOT NULL AND NEW.claim_id OPERATOR(pg_catalog.<=) OLD.claim_id THEN
            NEW.claim_id := pg_catalog.nextval('@extschema@.issue_claim_id_seq');
        END IF;
        -- Counted from the transaction's start here; the commit-time
        -- trigger moves it on if the commit comes late.
        IF NEW.lease_until IS NULL OR NOT pg_catalog.isfinite(NEW.lease_until)
           OR COALESCE(NEW.lease_until OPERATOR(pg_catalog.=) OLD.lease_until, false) THEN
            NEW.lease_until := pg_catalog.now()
                OPERATOR(pg_catalog.+) pg_catalog.make_interval(secs => @extschema@.newsnack_lease_seconds());
        ELSE
            -- Within 24 hours of now (the longest `lease_s`).
            NEW.lease_until := least(greatest(NEW.lease_until,
                    pg_catalog.now() OPERATOR(pg_catalog.-) '24 hours'::pg_catalog.interval),
                pg_catalog.now() OPERATOR(pg_catalog.+) '24 hours'::pg_catalog.interval);
        END IF;
    ELSIF NEW.processing_status OPERATOR(pg_catalog.=) 'PENDING' THEN
        -- Operator reset: a fresh start with a full retry budget.
        NEW.attempts := 0;
        NEW.last_error := NULL;
        NEW.retry_not_before := NULL;
        NEW.lease_until := NULL;
        NEW.claimed_by := NULL;
        NEW.claim_id := OLD.claim_id;
    ELSIF NEW.processing_status OPERATOR(pg_catalog.=) 'DONE' THEN
        NEW.attempts := OLD.attempts;
        NEW.last_error := NULL;
        NEW.lease_until := NULL;
        NEW.claim_id := OLD.claim_id;
    ELSE -- FAILED
        -- A claim given back before its generation began (an instance
        -- shutting down with work still queued) returns its attempt when
        -- the releasing transaction says so, naming itself.
        IF pg_catalog.current_setting('newsnack.attempt_unspent', true)
           OPERATOR(pg_catalog.=) pg_catalog.txid_current()::pg_catalog.text THEN
            NEW.attempts := greatest(OLD.attempts OPERATOR(pg_catalog.-) 1, 0);
        ELSE
            NEW.attempts := OLD.attempts;
        END IF;
        NEW.lease_until := NULL;
        NEW.claim_id := OLD.claim_id;
    END IF;
    RETURN NEW;
END
$$;
