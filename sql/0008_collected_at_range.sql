-- 0008: `collected_at` must be a date the service can read back (the years
-- 1 to 9999, UTC), from any writer. NOT VALID: rows already stored are not
-- checked.

ALTER TABLE issue ADD CONSTRAINT issue_collected_at_in_range
    CHECK (collected_at >= '0001-01-01 00:00:00+00' AND collected_at < '10000-01-01 00:00:00+00')
    NOT VALID;
