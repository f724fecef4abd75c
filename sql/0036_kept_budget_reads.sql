-- 0036: the figures the dashboard reads of the budget kept where they
-- change, so a read is a few index lookups (docs/sql.md, "Kept token
-- figures"). The articles' tokens are appended per quarter hour (UTC) by
-- triggers on `ai_article` and folded by the reaper, as the counts per
-- status are (migration 27); a briefing keeps its articles' tokens from
-- when it is written.

-- Quarter hours, so that the day in any time zone (every offset is whole
-- quarter hours) is a range of them.
CREATE TABLE @extschema@.ai_article_tokens (
    quarter           timestamptz NOT NULL,
    prompt_tokens     bigint NOT NULL,
    completion_tokens bigint NOT NULL
);
CREATE INDEX ai_article_tokens_quarter ON @extschema@.ai_article_tokens (quarter);

ALTER TABLE @extschema@.briefing
    ADD COLUMN prompt_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN completion_tokens bigint NOT NULL DEFAULT 0;

-- The quarter hour an article written at `at` counts to.
CREATE FUNCTION @extschema@.newsnack_quarter(at timestamptz) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN to_timestamp(floor(extract(epoch FROM at) / 900) * 900);
END
$$;

-- Inserts add, deletes take away, an update does both: one row per quarter
-- per statement, none for articles without tokens.
CREATE FUNCTION @extschema@.ai_article_tokens_added() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO @extschema@.ai_article_tokens (quarter, prompt_tokens, completion_tokens)
        SELECT @extschema@.newsnack_quarter(created_at), sum(COALESCE(prompt_tokens, 0)),
               sum(COALESCE(completion_tokens, 0))
          FROM added WHERE prompt_tokens > 0 OR completion_tokens > 0 GROUP BY 1;
    RETURN NULL;
END
$$;

CREATE FUNCTION @extschema@.ai_article_tokens_removed() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO @extschema@.ai_article_tokens (quarter, prompt_tokens, completion_tokens)
        SELECT @extschema@.newsnack_quarter(created_at), -sum(COALESCE(prompt_tokens, 0)),
               -sum(COALESCE(completion_tokens, 0))
          FROM removed WHERE prompt_tokens > 0 OR completion_tokens > 0 GROUP BY 1;
    RETURN NULL;
END
$$;

CREATE FUNCTION @extschema@.ai_article_tokens_changed() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO @extschema@.ai_article_tokens (quarter, prompt_tokens, completion_tokens)
        SELECT q, sum(p), sum(c)
          FROM (SELECT @extschema@.newsnack_quarter(created_at), COALESCE(prompt_tokens, 0),
                       COALESCE(completion_tokens, 0) FROM added
                UNION ALL
                SELECT @extschema@.newsnack_quarter(created_at), -COALESCE(prompt_tokens, 0),
                       -COALESCE(completion_tokens, 0) FROM removed) AS d(q, p, c)
         GROUP BY q HAVING sum(p) <> 0 OR sum(c) <> 0;
    RETURN NULL;
END
$$;

CREATE FUNCTION @extschema@.ai_article_tokens_truncated() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    TRUNCATE @extschema@.ai_article_tokens;
    RETURN NULL;
END
$$;

-- A briefing keeps the tokens of its articles as they are when it is
-- written (or its issues change).
CREATE FUNCTION @extschema@.briefing_count_tokens() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    SELECT COALESCE(sum(a.prompt_tokens), 0), COALESCE(sum(a.completion_tokens), 0)
      INTO NEW.prompt_tokens, NEW.completion_tokens
      FROM @extschema@.ai_article a WHERE a.issue_id = ANY(NEW.issue_ids);
    RETURN NEW;
END
$$;

-- Folds the rows into one per quarter once there are more than `above`,
-- leaving out quarters over two days old (a day read begins at most 25
-- hours ago); answers how many rows it folded (0 when it left them).
-- Exact under concurrency, as `newsnack_fold_status_counts` is.
CREATE FUNCTION @extschema@.newsnack_fold_article_tokens(above integer) RETURNS bigint LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    folded bigint;
BEGIN
    IF (SELECT count(*) FROM (SELECT 1 FROM @extschema@.ai_article_tokens LIMIT above + 1) r) <= above THEN
        RETURN 0;
    END IF;
    WITH gone AS (DELETE FROM @extschema@.ai_article_tokens RETURNING *),
         kept AS (INSERT INTO @extschema@.ai_article_tokens (quarter, prompt_tokens, completion_tokens)
                      SELECT quarter, sum(prompt_tokens), sum(completion_tokens) FROM gone
                       WHERE quarter >= now() - interval '2 days'
                       GROUP BY quarter HAVING sum(prompt_tokens) <> 0 OR sum(completion_tokens) <> 0)
    SELECT count(*) INTO folded FROM gone;
    RETURN folded;
END
$$;

-- What is there already, with writers held off while the triggers arrive.
LOCK TABLE @extschema@.ai_article, @extschema@.briefing IN SHARE ROW EXCLUSIVE MODE;
INSERT INTO @extschema@.ai_article_tokens (quarter, prompt_tokens, completion_tokens)
    SELECT @extschema@.newsnack_quarter(created_at), sum(COALESCE(prompt_tokens, 0)),
           sum(COALESCE(completion_tokens, 0))
      FROM @extschema@.ai_article
     WHERE created_at >= now() - interval '2 days' AND (prompt_tokens > 0 OR completion_tokens > 0)
     GROUP BY 1;
UPDATE @extschema@.briefing b SET prompt_tokens = t.prompt, completion_tokens = t.completion
  FROM (SELECT b.id, COALESCE(sum(a.prompt_tokens), 0) AS prompt,
               COALESCE(sum(a.completion_tokens), 0) AS completion
          FROM @extschema@.briefing b JOIN @extschema@.ai_article a ON a.issue_id = ANY(b.issue_ids)
         GROUP BY b.id) t
 WHERE b.id = t.id;

CREATE TRIGGER ai_article_tokens_on_insert AFTER INSERT ON @extschema@.ai_article
    REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.ai_article_tokens_added();
CREATE TRIGGER ai_article_tokens_on_delete AFTER DELETE ON @extschema@.ai_article
    REFERENCING OLD TABLE AS removed
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.ai_article_tokens_removed();
CREATE TRIGGER ai_article_tokens_on_update AFTER UPDATE ON @extschema@.ai_article
    REFERENCING OLD TABLE AS removed NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.ai_article_tokens_changed();
CREATE TRIGGER ai_article_tokens_on_truncate AFTER TRUNCATE ON @extschema@.ai_article
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.ai_article_tokens_truncated();
CREATE TRIGGER briefing_count_tokens BEFORE INSERT OR UPDATE OF issue_ids ON @extschema@.briefing
    FOR EACH ROW EXECUTE FUNCTION @extschema@.briefing_count_tokens();

REVOKE EXECUTE ON FUNCTION
    @extschema@.ai_article_tokens_added(),
    @extschema@.ai_article_tokens_removed(),
    @extschema@.ai_article_tokens_changed(),
    @extschema@.ai_article_tokens_truncated(),
    @extschema@.briefing_count_tokens(),
    @extschema@.newsnack_fold_article_tokens(integer)
FROM PUBLIC;
