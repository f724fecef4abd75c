-- 0008: `collected_at` stays within what the service can read back.
--
-- The service reads timestamps as dates of the years 1 to 9999 (UTC). A
-- row written with plain SQL as `collected_at = 'infinity'`, or in the year
-- 10000, was stored, and then every read of that issue failed. The API
-- refuses such values already (src/input.rs); this refuses them from any
-- writer. NOT VALID: rows already stored are not checked, so the migration
-- never fails on old data.

ALTER TABLE issue ADD CONSTRAINT issue_collected_at_in_range
    CHECK (collected_at >= '0001-01-01 00:00:00+00' AND collected_at < '10000-01-01 00:00:00+00')
    NOT VALID;
