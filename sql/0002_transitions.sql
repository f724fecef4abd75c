-- 0002: the legal status transitions (`issue_transition_is_legal`) and the
-- triggers of `issue`: BEFORE triggers refuse an illegal change and keep the
-- bookkeeping columns right; a deferred AFTER trigger appends each change
-- to `issue_transition` at commit, under an advisory lock so that `seq`
-- follows commit order, and sends NOTIFY `issue_transition`.

CREATE FUNCTION issue_transition_is_legal(from_status text, to_status text)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (from_status, to_status) IN (
        ('PENDING', 'IN_PROGRESS'),
        ('FAILED', 'IN_PROGRESS'),
        ('IN_PROGRESS', 'DONE'),
        ('IN_PROGRESS', 'FAILED'),
        ('FAILED', 'PENDING')
    )
$$;

-- Lease length for claims made without one (raw SQL), from `setting`.
CREATE FUNCTION newsnack_lease_seconds() RETURNS integer LANGUAGE sql STABLE AS $$
    SELECT COALESCE((SELECT value::integer FROM setting WHERE key = 'lease_s'), 60)
$$;

CREATE FUNCTION issue_before_insert() RETURNS trigger LANGUAGE plpgsql AS $$
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

CREATE FUNCTION issue_before_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.processing_status IS NOT DISTINCT FROM OLD.processing_status THEN
        -- Not a transition. Only a live claim's lease and holder may move.
        IF NEW.processing_status <> 'IN_PROGRESS' THEN
            NEW.lease_until := OLD.lease_until;
        END IF;
        NEW.claim_id := OLD.claim_id;
        NEW.attempts := OLD.attempts;
        RETURN NEW;
    END IF;
    IF NOT issue_transition_is_legal(OLD.processing_status, NEW.processing_status) THEN
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
            IF NEW.claim_id IS NOT DISTINCT FROM OLD.claim_id THEN
                NEW.claim_id := nextval('issue_claim_id_seq');
            END IF;
            IF NEW.lease_until IS NULL OR NEW.lease_until IS NOT DISTINCT FROM OLD.lease_until THEN
                NEW.lease_until := now() + make_interval(secs => newsnack_lease_seconds());
            END IF;
        WHEN 'PENDING' THEN
            -- Operator reset: a fresh start with a full retry budget.
            NEW.attempts := 0;
            NEW.last_error := NULL;
            NEW.retry_not_before := NULL;
            NEW.lease_until := NULL;
            NEW.claimed_by := NULL;
        WHEN 'DONE' THEN
            NEW.attempts := OLD.attempts;
            NEW.last_error := NULL;
            NEW.lease_until := NULL;
        ELSE -- FAILED
            NEW.attempts := OLD.attempts;
            NEW.lease_until := NULL;
    END CASE;
    RETURN NEW;
END
$$;

CREATE FUNCTION issue_transition_record() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    logged issue_transition;
BEGIN
    -- Serialise `seq` allocation with commit order (see the header).
    PERFORM pg_advisory_xact_lock(7236284560371893001);
    INSERT INTO issue_transition (issue_id, from_status, to_status, at, attempts, claim_id, claimed_by, reason, fatal)
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

CREATE TRIGGER issue_before_insert BEFORE INSERT ON issue
    FOR EACH ROW EXECUTE FUNCTION issue_before_insert();
CREATE TRIGGER issue_before_update BEFORE UPDATE ON issue
    FOR EACH ROW EXECUTE FUNCTION issue_before_update();

CREATE CONSTRAINT TRIGGER issue_transition_on_insert AFTER INSERT ON issue
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION issue_transition_record();
CREATE CONSTRAINT TRIGGER issue_transition_on_update AFTER UPDATE OF processing_status ON issue
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.processing_status IS DISTINCT FROM NEW.processing_status)
    EXECUTE FUNCTION issue_transition_record();
