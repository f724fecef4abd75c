-- 0013: the other dates the service reads back (`issue.updated_at`,
-- `ai_article.created_at`, the log's `at`, `briefing.created_at`, the
-- times of `pipeline_run`) must be within the years 1 to 9999 (UTC), from
-- any writer. NOT VALID: rows already stored are not checked.

ALTER TABLE issue ADD CONSTRAINT issue_updated_at_in_range
    CHECK (updated_at >= '0001-01-01 00:00:00+00' AND updated_at < '10000-01-01 00:00:00+00')
    NOT VALID;

ALTER TABLE ai_article ADD CONSTRAINT ai_article_created_at_in_range
    CHECK (created_at >= '0001-01-01 00:00:00+00' AND created_at < '10000-01-01 00:00:00+00')
    NOT VALID;

ALTER TABLE issue_transition ADD CONSTRAINT issue_transition_at_in_range
    CHECK (at >= '0001-01-01 00:00:00+00' AND at < '10000-01-01 00:00:00+00')
    NOT VALID;

ALTER TABLE briefing ADD CONSTRAINT briefing_created_at_in_range
    CHECK (created_at >= '0001-01-01 00:00:00+00' AND created_at < '10000-01-01 00:00:00+00')
    NOT VALID;

ALTER TABLE pipeline_run ADD CONSTRAINT pipeline_run_times_in_range
    CHECK (started_at >= '0001-01-01 00:00:00+00' AND started_at < '10000-01-01 00:00:00+00'
       AND (tick IS NULL OR (tick >= '0001-01-01 00:00:00+00' AND tick < '10000-01-01 00:00:00+00'))
       AND (finished_at IS NULL
            OR (finished_at >= '0001-01-01 00:00:00+00' AND finished_at < '10000-01-01 00:00:00+00')))
    NOT VALID;
