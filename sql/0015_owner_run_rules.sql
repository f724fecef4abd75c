-- 0015: the trigger functions run as their owner (SECURITY DEFINER,
-- EXECUTE taken from PUBLIC) with `search_path = pg_catalog, pg_temp`, and
-- name everything of this schema with it (`@extschema@`); the helpers stay
-- callable by anyone. A claim's lease counts from its commit: the
-- commit-time trigger moves it on when the transaction was open for more
-- than a second. Why: docs/sql.md, "Why the rules run as the owner". A
-- function replaced later must repeat SECURITY DEFINER and its settings:
-- CREATE OR REPLACE drops what it does not repeat.

-- Helpers: callable by anyone, as before. `issue_transition_is_legal`
-- names nothing of this schema and stays as in 0002 (inlined into the
-- trigger, under the trigger's search_path).

CREATE OR REPLACE FUNCTION @extschema@.newsnack_lease_seconds() RETURNS integer LANGUAGE sql STABLE AS $$
    SELECT COALESCE((SELECT value::integer FROM @extschema@.setting WHERE key = 'lease_s'), 60)
$$;

-- The body is as in 0007; it names nothing of this schema.
ALTER FUNCTION @extschema@.newsnack_schedule_problem(text) SET search_path = pg_catalog, pg_temp;

-- The issue triggers.

CREATE OR REPLACE FUNCTION @extschema@.issue_before_insert() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.processing_status IS DISTINCT FROM 'PENDING' THEN
        RAISE EXCEPTION 'a new issue must start PENDING, not %', NEW.processing_status
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.attempts := 0;
    NEW.claim_id := NULL;
    NEW.claimed_by := NULL;
    NEW.lease_until := NULL;
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.issue_before_update() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.processing_status IS NOT DISTINCT FROM OLD.processing_status THEN
        -- Not a transition. Only a live claim's lease and holder may move.
        IF NEW.processing_status <> 'IN_PROGRESS' THEN
            NEW.lease_until := OLD.lease_until;
        ELSIF NEW.lease_until IS NULL OR NOT isfinite(NEW.lease_until) THEN
            NEW.lease_until := OLD.lease_until;
        ELSIF NEW.lease_until IS DISTINCT FROM OLD.lease_until THEN
            -- Within 24 hours of now (the longest `lease_s`).
            NEW.lease_until := least(greatest(NEW.lease_until, now() - interval '24 hours'),
                                     now() + interval '24 hours');
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
    NEW.updated_at := now();
    CASE NEW.processing_status
        WHEN 'IN_PROGRESS' THEN
            -- Every claim, by anyone, is a new attempt with a new fencing token.
            NEW.attempts := OLD.attempts + 1;
            NEW.retry_not_before := NULL;
            -- A fresh token unless the statement drew a newer one itself:
            -- never none, and never one this issue had before.
            IF NEW.claim_id IS NULL OR OLD.claim_id IS NOT NULL AND NEW.claim_id <= OLD.claim_id THEN
                NEW.claim_id := nextval('@extschema@.issue_claim_id_seq');
            END IF;
            -- Counted from the transaction's start here; the commit-time
            -- trigger moves it on if the commit comes late.
            IF NEW.lease_until IS NULL OR NOT isfinite(NEW.lease_until)
               OR NEW.lease_until IS NOT DISTINCT FROM OLD.lease_until THEN
                NEW.lease_until := now() + make_interval(secs => @extschema@.newsnack_lease_seconds());
            ELSE
                -- Within 24 hours of now (the longest `lease_s`).
                NEW.lease_until := least(greatest(NEW.lease_until, now() - interval '24 hours'),
                                         now() + interval '24 hours');
            END IF;
        WHEN 'PENDING' THEN
            -- Operator reset: a fresh start with a full retry budget.
            NEW.attempts := 0;
            NEW.last_error := NULL;
            NEW.retry_not_before := NULL;
            NEW.lease_until := NULL;
            NEW.claimed_by := NULL;
            NEW.claim_id := OLD.claim_id;
        WHEN 'DONE' THEN
            NEW.attempts := OLD.attempts;
            NEW.last_error := NULL;
            NEW.lease_until := NULL;
            NEW.claim_id := OLD.claim_id;
        ELSE -- FAILED
            -- A claim given back before its generation began (an instance
            -- shutting down with work still queued) returns its attempt when
            -- the releasing transaction says so, naming itself.
            IF current_setting('newsnack.attempt_unspent', true) = txid_current()::text THEN
                NEW.attempts := greatest(OLD.attempts - 1, 0);
            ELSE
                NEW.attempts := OLD.attempts;
            END IF;
            NEW.lease_until := NULL;
            NEW.claim_id := OLD.claim_id;
    END CASE;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.issue_transition_record() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    logged @extschema@.issue_transition;
    open_for interval;
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
    PERFORM pg_notify('issue_transition', json_build_object(
        'seq', logged.seq,
        'issue_id', logged.issue_id,
        'from', logged.from_status,
        'to', logged.to_status,
        'at', logged.at,
        'attempts', logged.attempts,
        'fatal', logged.fatal
    )::text);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.issue_announce_removal() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM pg_notify('issue_removed', TG_OP);
    RETURN NULL;
END
$$;

-- `removed` is the statement's transition table, which no schema holds.
CREATE OR REPLACE FUNCTION @extschema@.issue_announce_deletion() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM removed) THEN
        PERFORM pg_notify('issue_removed', TG_OP);
    END IF;
    RETURN NULL;
END
$$;

-- The setting triggers.

CREATE OR REPLACE FUNCTION @extschema@.setting_validate() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    spec @extschema@.setting_spec;
    parsed numeric;
    problem text;
BEGIN
    SELECT * INTO spec FROM @extschema@.setting_spec WHERE key = NEW.key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown setting "%" (known: %)', NEW.key,
            (SELECT string_agg(key, ', ' ORDER BY key) FROM @extschema@.setting_spec)
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.value := btrim(NEW.value);
    NEW.updated_at := now();
    IF spec.kind = 'schedule' THEN
        NEW.value := regexp_replace(NEW.value, '\s+', ' ', 'g');
        problem := @extschema@.newsnack_schedule_problem(NEW.value);
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION 'invalid schedule "%" for setting "%": % (expected "off", "every <n>s|m|h" or a cron expression of 5 or 6 fields, UTC)',
                NEW.value, NEW.key, problem USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.value !~ '^-?[0-9]{1,18}$' THEN
        RAISE EXCEPTION 'setting "%" must be a whole number, got "%"', NEW.key, NEW.value
            USING ERRCODE = 'check_violation';
    END IF;
    parsed := NEW.value::numeric;
    IF parsed < spec.min_value OR parsed > spec.max_value THEN
        RAISE EXCEPTION 'setting "%" must be between % and %, got %', NEW.key, spec.min_value, spec.max_value, NEW.value
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.value := parsed::bigint::text;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.setting_announce() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM pg_notify('setting_changed', COALESCE(NEW.key, OLD.key));
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.setting_announce_truncation() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM pg_notify('setting_changed', '*');
    RETURN NULL;
END
$$;

REVOKE EXECUTE ON FUNCTION
    @extschema@.issue_before_insert(),
    @extschema@.issue_before_update(),
    @extschema@.issue_transition_record(),
    @extschema@.issue_announce_removal(),
    @extschema@.issue_announce_deletion(),
    @extschema@.setting_validate(),
    @extschema@.setting_announce(),
    @extschema@.setting_announce_truncation()
FROM PUBLIC;
