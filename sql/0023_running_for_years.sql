-- 0023: running for years (docs/sql.md, "Idempotent intake" and
-- "Retention"): a key a collector gives each story, unique, so sending the
-- same story twice adds it once; and the two retention settings `newsnack
-- prune` and `serve`'s hourly prune follow.

ALTER TABLE @extschema@.issue
    ADD COLUMN source_key text,
    ADD CONSTRAINT issue_source_key_key UNIQUE (source_key),
    ADD CONSTRAINT issue_source_key_length CHECK (char_length(source_key) BETWEEN 1 AND 1000);

INSERT INTO @extschema@.setting_spec (key, default_value, min_value, max_value, description, kind) VALUES
    ('log_retention_days', '30', 0, 36500,
     'retention: days transitions, pipeline runs and the LLM budget''s bookkeeping are kept (0: forever)',
     'integer'),
    ('issue_retention_days', '0', 0, 36500,
     'retention: days DONE issues (with their articles) and FAILED issues with no automatic retry are kept after their last update (0: forever)',
     'integer');

INSERT INTO @extschema@.setting (key, value)
SELECT key, default_value FROM @extschema@.setting_spec
 WHERE key IN ('log_retention_days', 'issue_retention_days')
ON CONFLICT (key) DO NOTHING;
