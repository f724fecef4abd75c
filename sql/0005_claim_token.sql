-- 0005: a claim keeps the fencing token its statement set only if it is
-- newer than the issue's last; otherwise it draws the next one (never none,
-- never an earlier claim's).

CREATE OR REPLACE FUNCTION issue_before_update() RETURNS trigger LANGUAGE plpgsql AS $$
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
            -- A fresh token unless the statement drew a newer one itself:
            -- never none, and never one this issue had before.
            IF NEW.claim_id IS NULL OR OLD.claim_id IS NOT NULL AND NEW.claim_id <= OLD.claim_id THEN
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
