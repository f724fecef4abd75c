-- 0011: plain SQL can no longer put a claim beyond the reaper's reach or
-- forge a fencing token.
--
-- Until now, an UPDATE that kept an issue `IN_PROGRESS` could set its
-- `lease_until` to NULL (the reaper, which looks for `lease_until < now()`,
-- never saw it again, and the dashboard hid it), and a claim could bring
-- any lease of its own: 'infinity', which the service cannot read, or a
-- year far ahead. Now a lease is bounded to 24 hours either side of now
-- (the longest `lease_s`); a NULL or non-finite one keeps the lease the
-- issue had, or for a claim gets the default.
--
-- And `claim_id` could be changed on any other transition (`SET
-- processing_status = 'FAILED', claim_id = NULL`), after which a claim
-- could take an earlier token again and a late worker holding that token
-- could write over it. Now a token changes only with a claim.
-- Everything else is as in 0010.

CREATE OR REPLACE FUNCTION issue_before_update() RETURNS trigger LANGUAGE plpgsql AS $$
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
            IF NEW.lease_until IS NULL OR NOT isfinite(NEW.lease_until)
               OR NEW.lease_until IS NOT DISTINCT FROM OLD.lease_until THEN
                NEW.lease_until := now() + make_interval(secs => newsnack_lease_seconds());
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

-- Claims already out of the reaper's reach get the default lease from now.
UPDATE issue SET lease_until = now() + make_interval(secs => newsnack_lease_seconds())
 WHERE processing_status = 'IN_PROGRESS'
   AND (lease_until IS NULL OR NOT isfinite(lease_until)
        OR lease_until > now() + interval '24 hours');
