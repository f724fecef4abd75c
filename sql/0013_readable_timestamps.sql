-- 0013: every date and time the service reads back stays within what it
-- can represent.
--
-- The service reads timestamps as dates of the years 1 to 9999 (UTC), as
-- migration 8 already demands of `collected_at`. A value written with plain
-- SQL as 'infinity', or in the year 10000, was stored, and every read that
-- met it then failed: of the issue, the briefing, the run, or of the
-- transition log, whose readers (the listener included) would retry it
-- until someone set it right. These constraints refuse such values from
-- any writer. `retry_not_before` is left alone: 'infinity' there is the
-- mark of a fatal failure; so is `setting.updated_at`, which its trigger
-- always sets to now(). NOT VALID: rows already stored are not checked,
-- so the migration never fails on old data.

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
