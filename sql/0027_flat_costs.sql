-- 0027: counts per status kept at commit, so reading them costs the same
-- at a thousand issues and at a million (docs/sql.md, "Counts per status").
-- Every change of a status appends its deltas to `issue_status_delta`; a
-- count is the sum of its status's rows. Appending takes no row lock, so
-- no transaction waits on another's count; the reaper folds the rows into
-- one per status now and then.

CREATE TABLE @extschema@.issue_status_delta (
    status text NOT NULL,
    n      bigint NOT NULL
);

-- Inserts and deletes append one row per status per statement (a bulk
-- INSERT ... SELECT costs one aggregate); a status change appends two.
CREATE FUNCTION @extschema@.issue_status_count_inserted() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO @extschema@.issue_status_delta (status, n)
        SELECT processing_status, count(*) FROM added GROUP BY processing_status;
    RETURN NULL;
END
$$;

CREATE FUNCTION @extschema@.issue_status_count_deleted() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO @extschema@.issue_status_delta (status, n)
        SELECT processing_status, -count(*) FROM removed GROUP BY processing_status;
    RETURN NULL;
END
$$;

CREATE FUNCTION @extschema@.issue_status_count_changed() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO @extschema@.issue_status_delta (status, n)
        VALUES (OLD.processing_status, -1), (NEW.processing_status, 1);
    RETURN NULL;
END
$$;

-- TRUNCATE (not DELETE) so that a fold committing meanwhile leaves nothing
-- behind: it waits for the fold and removes every row.
CREATE FUNCTION @extschema@.issue_status_count_truncated() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    TRUNCATE @extschema@.issue_status_delta;
    RETURN NULL;
END
$$;

-- Folds the deltas into one row per status once there are more than
-- `above`; answers how many rows it folded (0 when it left them). Exact
-- under concurrency: it adds up just the rows its DELETE removed, and a
-- concurrent fold skips those.
CREATE FUNCTION @extschema@.newsnack_fold_status_counts(above integer) RETURNS bigint LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    folded bigint;
BEGIN
    IF (SELECT count(*) FROM (SELECT 1 FROM @extschema@.issue_status_delta LIMIT above + 1) r) <= above THEN
        RETURN 0;
    END IF;
    WITH gone AS (DELETE FROM @extschema@.issue_status_delta RETURNING status, n),
         kept AS (INSERT INTO @extschema@.issue_status_delta (status, n)
                      SELECT status, sum(n) FROM gone GROUP BY status HAVING sum(n) <> 0)
    SELECT count(*) INTO folded FROM gone;
    RETURN folded;
END
$$;

-- The retry scheduler's start reads the FAILED issues: an index of just
-- those, so the DONE history is not scanned.
CREATE INDEX issue_failed_idx ON @extschema@.issue (id) WHERE processing_status = 'FAILED';

-- The counts of the issues already there, with writers held off while the
-- triggers arrive.
LOCK TABLE @extschema@.issue IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO @extschema@.issue_status_delta (status, n)
    SELECT processing_status, count(*) FROM @extschema@.issue GROUP BY processing_status;

CREATE TRIGGER issue_status_count_on_insert AFTER INSERT ON @extschema@.issue
    REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.issue_status_count_inserted();
CREATE TRIGGER issue_status_count_on_delete AFTER DELETE ON @extschema@.issue
    REFERENCING OLD TABLE AS removed
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.issue_status_count_deleted();
CREATE TRIGGER issue_status_count_on_update AFTER UPDATE ON @extschema@.issue
    FOR EACH ROW WHEN (OLD.processing_status IS DISTINCT FROM NEW.processing_status)
    EXECUTE FUNCTION @extschema@.issue_status_count_changed();
CREATE TRIGGER issue_status_count_on_truncate AFTER TRUNCATE ON @extschema@.issue
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.issue_status_count_truncated();

REVOKE EXECUTE ON FUNCTION
    @extschema@.issue_status_count_inserted(),
    @extschema@.issue_status_count_deleted(),
    @extschema@.issue_status_count_changed(),
    @extschema@.issue_status_count_truncated(),
    @extschema@.newsnack_fold_status_counts(integer)
FROM PUBLIC;
