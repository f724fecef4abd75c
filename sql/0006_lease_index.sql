-- 0006: `issue_lease_until_idx` holds the rows with a lease
-- (`lease_until IS NOT NULL`) instead of those `IN_PROGRESS`, the same rows,
-- so that only a condition on `lease_until` can use it, not a lookup by id.
DROP INDEX issue_lease_until_idx;
CREATE INDEX issue_lease_until_idx ON issue (lease_until) WHERE lease_until IS NOT NULL;
