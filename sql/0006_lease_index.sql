-- 0006: the reaper's index no longer stands in for a lookup by id.
--
-- `issue_lease_until_idx` was partial on `processing_status = 'IN_PROGRESS'`,
-- so any statement with that condition could use it, and the completion
-- statement's generic plan did: every batch scanned the whole index (every
-- live claim, and every entry left dead by a claim since the last vacuum,
-- which a bitmap scan never marks) instead of looking up its own ids. The
-- index now holds the rows with a lease, the same rows (the triggers keep
-- `lease_until` NULL outside `IN_PROGRESS`), and only a condition on
-- `lease_until` (the reaper's, the dashboard's) can use it.
DROP INDEX issue_lease_until_idx;
CREATE INDEX issue_lease_until_idx ON issue (lease_until) WHERE lease_until IS NOT NULL;
