-- 0017: the LLM budget shared by every instance (`llm_holder`, `llm_call`,
-- `llm_budget`, `issue_priority`, and `newsnack_llm_exchange`, their only
-- writer; docs/architecture.md, "The shared LLM budget"); token usage on
-- `ai_article`, recorded by `newsnack_complete`; settings of new kinds for
-- the budget, the prompts, the readers' time zone and the briefing's title.

-- Settings of new kinds. For the text kinds, `min_value` and `max_value`
-- bound the length in characters.

ALTER TABLE @extschema@.setting_spec DROP CONSTRAINT setting_spec_kind_valid;
ALTER TABLE @extschema@.setting_spec ADD CONSTRAINT setting_spec_kind_valid
    CHECK (kind IN ('integer', 'schedule', 'prompt', 'prompt_template', 'time_zone', 'title_template'));

INSERT INTO @extschema@.setting_spec (key, default_value, min_value, max_value, description, kind) VALUES
    ('llm_max_in_flight', '8', 1, 10000,
     'LLM budget: calls in flight across all instances together', 'integer'),
    ('llm_requests_per_minute', '0', 0, 1000000,
     'LLM budget: calls started per minute across all instances (0: unlimited)', 'integer'),
    ('llm_system_prompt',
     'You are a news writer for newsnack, a daily news briefing. Write in a neutral, factual news tone. Use only the facts in the material you are given: never invent names, numbers, quotes or dates. Answer in plain text, without Markdown.',
     1, 16000, 'LLM: the system prompt', 'prompt'),
    ('llm_user_prompt',
     E'Write a headline and a short news article (3 to 5 short paragraphs) about the story below.\nAnswer with the headline alone on the first line, then a blank line, then the article, with a blank line between paragraphs. Do not add labels such as "Headline:".\n\nTitle: {title}\n\nDetails:\n{body}',
     1, 16000, 'LLM: the user prompt, a template with {title} and {body}', 'prompt_template'),
    ('timezone', 'UTC', 0, 0,
     'the readers'' time zone (an IANA name): the briefing''s date and cron schedules', 'time_zone'),
    ('briefing_title', 'newsnack — {date}', 1, 500,
     'the briefing''s title: a template with {date} or {date:FORMAT} (%Y %m %-m %d %-d %B %b %A %a %%)',
     'title_template');

UPDATE @extschema@.setting_spec
   SET description = 'scheduler: "off", "every 30s" / "every 15m" / "every 6h", or a cron expression (5 or 6 fields, in the timezone setting''s time zone)'
 WHERE key = 'schedule';

-- What is wrong with a briefing title template, or NULL: it must hold
-- `{date}` or `{date:FORMAT}`, and a FORMAT may use only the fields the
-- service formats (see `src/briefing.rs`).
CREATE FUNCTION @extschema@.newsnack_title_template_problem(template text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    format text;
    unknown text;
BEGIN
    IF template !~ '\{date(:[^{}]*)?\}' THEN
        RETURN 'it must contain {date} (or {date:FORMAT}), where the briefing''s date goes';
    END IF;
    FOR format IN SELECT m[1] FROM regexp_matches(template, '\{date:([^{}]*)\}', 'g') AS m LOOP
        SELECT string_agg(DISTINCT s[1], ', ') INTO unknown
          FROM regexp_matches(regexp_replace(format, '%(-?[md]|[YBbAa%])', '', 'g'), '(%-?.?)', 'g') AS s;
        IF unknown IS NOT NULL THEN
            RETURN format('{date:%s} uses %s, which is not one of %%Y %%m %%-m %%d %%-d %%B %%b %%A %%a %%%%',
                          format, unknown);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.setting_validate() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    spec @extschema@.setting_spec;
    parsed numeric;
    problem text;
    missing text;
    canonical text;
BEGIN
    SELECT * INTO spec FROM @extschema@.setting_spec WHERE key = NEW.key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown setting "%" (known: %)', NEW.key,
            (SELECT string_agg(key, ', ' ORDER BY key) FROM @extschema@.setting_spec)
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.value := btrim(NEW.value);
    NEW.updated_at := now();
    IF spec.kind = 'schedule' THEN
        NEW.value := regexp_replace(NEW.value, '\s+', ' ', 'g');
        problem := @extschema@.newsnack_schedule_problem(NEW.value);
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION 'invalid schedule "%" for setting "%": % (expected "off", "every <n>s|m|h" or a cron expression of 5 or 6 fields, in the timezone setting''s time zone)',
                NEW.value, NEW.key, problem USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF spec.kind = 'time_zone' THEN
        -- Names as the IANA database spells them (case aside); not the
        -- `posix/` and `right/` copies, nor the system's own aliases.
        SELECT name INTO canonical FROM pg_timezone_names
         WHERE lower(name) = lower(NEW.value)
           AND name !~ '^(posix|right)/' AND name NOT IN ('localtime', 'posixrules', 'Factory')
         ORDER BY name = NEW.value DESC, name LIMIT 1;
        IF canonical IS NULL THEN
            RAISE EXCEPTION 'unknown time zone "%" for setting "%" (expected an IANA time zone name such as "Asia/Seoul", "Europe/Berlin" or "UTC")',
                NEW.value, NEW.key USING ERRCODE = 'check_violation';
        END IF;
        NEW.value := canonical;
        RETURN NEW;
    END IF;
    IF spec.kind IN ('prompt', 'prompt_template', 'title_template') THEN
        IF char_length(NEW.value) < spec.min_value THEN
            RAISE EXCEPTION 'setting "%" must not be empty', NEW.key USING ERRCODE = 'check_violation';
        END IF;
        IF char_length(NEW.value) > spec.max_value THEN
            RAISE EXCEPTION 'setting "%" may be at most % characters long, got %',
                NEW.key, spec.max_value, char_length(NEW.value) USING ERRCODE = 'check_violation';
        END IF;
        IF spec.kind = 'prompt_template' THEN
            SELECT string_agg(placeholder, ' and ') INTO missing
              FROM unnest(ARRAY['{title}', '{body}']) AS placeholder
             WHERE strpos(NEW.value, placeholder) = 0;
            IF missing IS NOT NULL THEN
                RAISE EXCEPTION 'setting "%" must contain {title} and {body} (where the issue''s title and body go); missing: %',
                    NEW.key, missing USING ERRCODE = 'check_violation';
            END IF;
        END IF;
        IF spec.kind = 'title_template' THEN
            problem := @extschema@.newsnack_title_template_problem(NEW.value);
            IF problem IS NOT NULL THEN
                RAISE EXCEPTION 'invalid title template "%" for setting "%": %', NEW.value, NEW.key, problem
                    USING ERRCODE = 'check_violation';
            END IF;
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.value !~ '^-?[0-9]{1,18}$' THEN
        RAISE EXCEPTION 'setting "%" must be a whole number, got "%"', NEW.key, NEW.value
            USING ERRCODE = 'check_violation';
    END IF;
    parsed := NEW.value::numeric;
    IF parsed < spec.min_value OR parsed > spec.max_value THEN
        RAISE EXCEPTION 'setting "%" must be between % and %, got %', NEW.key, spec.min_value, spec.max_value, NEW.value
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.value := parsed::bigint::text;
    RETURN NEW;
END
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.setting_validate() FROM PUBLIC;

INSERT INTO @extschema@.setting (key, value)
SELECT key, default_value FROM @extschema@.setting_spec
 WHERE key IN ('llm_max_in_flight', 'llm_requests_per_minute', 'llm_system_prompt',
               'llm_user_prompt', 'timezone', 'briefing_title')
ON CONFLICT (key) DO NOTHING;

-- Token usage, as the API reported it (NULL when it did not).

ALTER TABLE @extschema@.ai_article
    ADD COLUMN prompt_tokens integer CONSTRAINT ai_article_prompt_tokens_valid CHECK (prompt_tokens >= 0),
    ADD COLUMN completion_tokens integer CONSTRAINT ai_article_completion_tokens_valid CHECK (completion_tokens >= 0);
-- The dashboard sums today's tokens; articles are appended in time order,
-- so a BRIN index is small and quick to build.
CREATE INDEX ai_article_created_at_brin ON @extschema@.ai_article USING brin (created_at);

-- The budget.

CREATE TABLE @extschema@.issue_priority (
    issue_id     bigint PRIMARY KEY,
    priority     text NOT NULL CONSTRAINT issue_priority_valid CHECK (priority IN ('briefing', 'feed')),
    requested_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE @extschema@.llm_holder (
    holder      text PRIMARY KEY,
    instance    text NOT NULL,
    joined_at   timestamptz NOT NULL DEFAULT now(),
    lease_until timestamptz NOT NULL
);

CREATE TABLE @extschema@.llm_call (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    holder      text NOT NULL REFERENCES @extschema@.llm_holder (holder) ON DELETE CASCADE,
    issue_id    bigint NOT NULL,
    claim_id    bigint NOT NULL,
    priority    text NOT NULL CONSTRAINT llm_call_priority_valid CHECK (priority IN ('briefing', 'feed')),
    queued_at   timestamptz NOT NULL DEFAULT now(),
    granted_at  timestamptz,
    finished_at timestamptz
);
-- A holder's waiting calls in the order they are granted.
CREATE INDEX llm_call_waiting ON @extschema@.llm_call (holder, (priority = 'feed'), claim_id)
    WHERE granted_at IS NULL;
CREATE INDEX llm_call_briefing_waiting ON @extschema@.llm_call (id)
    WHERE granted_at IS NULL AND priority = 'briefing';
CREATE INDEX llm_call_in_flight ON @extschema@.llm_call (holder)
    WHERE granted_at IS NOT NULL AND finished_at IS NULL;
CREATE INDEX llm_call_granted_at ON @extschema@.llm_call (granted_at) WHERE granted_at IS NOT NULL;

CREATE TABLE @extschema@.llm_budget (
    single       boolean PRIMARY KEY DEFAULT true CONSTRAINT llm_budget_single CHECK (single),
    -- The last pause: no call is granted before `paused_until`.
    paused_until timestamptz,
    pause_reason text,
    paused_by    text,
    paused_at    timestamptz
);
INSERT INTO @extschema@.llm_budget DEFAULT VALUES;

-- One exchange of a holder with the budget (see the top of this file).
-- `p_issue_ids`, `p_claim_ids`, `p_priorities`: calls to queue (a NULL
-- priority: the one the issue was last asked for at, else briefing).
-- `p_finished`: the holder's calls that ended (or will never run).
-- `p_pause_s`, `p_pause_reason`: a pause to start (NULL: none).
-- `p_leaving`: the holder goes away, with all its calls.
-- Answers the ids of the calls queued (in input order), every call of the
-- holder granted and not finished, how many calls it holds in all, the
-- pause if one is on, and when the caller should ask again if some of its
-- calls wait for something time will bring (a pause ending, the minute's
-- window moving on, another holder's lease running out).
CREATE FUNCTION @extschema@.newsnack_llm_exchange(
    p_holder text, p_instance text, p_lease_s float8,
    p_issue_ids bigint[], p_claim_ids bigint[], p_priorities text[],
    p_finished bigint[], p_pause_s float8, p_pause_reason text, p_leaving boolean,
    OUT queued bigint[], OUT granted bigint[], OUT holding bigint,
    OUT paused_for_s float8, OUT pause_reason text, OUT paused_by text, OUT ask_again_in_s float8)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    budget @extschema@.llm_budget;
    t timestamptz;
    max_in_flight integer;
    per_holder integer;
    per_minute integer;
    in_flight integer;
    room integer;
    started integer := 0;
    oldest_start timestamptz;
    chosen bigint[] := '{}';
BEGIN
    -- A class asked for explicitly is remembered for the issue's retries.
    INSERT INTO @extschema@.issue_priority AS p (issue_id, priority)
    SELECT DISTINCT ON (u.issue_id) u.issue_id, u.priority
      FROM unnest(p_issue_ids, p_priorities) AS u(issue_id, priority)
     WHERE u.priority IS NOT NULL
    ON CONFLICT (issue_id) DO UPDATE SET priority = EXCLUDED.priority, requested_at = now()
     WHERE p.priority IS DISTINCT FROM EXCLUDED.priority;

    -- The budget's state is worth no WAL flush: every dispatcher waits for
    -- this lock, and a crash loses what the leases give back anyway (a
    -- call granted twice is finished by its holder at once, a call lost
    -- is queued again by its holder). Until the transaction ends only.
    PERFORM set_config('synchronous_commit', 'off', true);
    -- One dispatcher at a time. Every statement below runs on a snapshot
    -- taken after the lock, so it sees what the previous holder committed.
    SELECT * INTO budget FROM @extschema@.llm_budget FOR UPDATE;
    t := clock_timestamp();

    IF p_leaving THEN
        DELETE FROM @extschema@.llm_holder WHERE holder = p_holder;
    ELSE
        INSERT INTO @extschema@.llm_holder AS h (holder, instance, lease_until)
        VALUES (p_holder, p_instance, t + make_interval(secs => p_lease_s))
        ON CONFLICT (holder) DO UPDATE SET lease_until = EXCLUDED.lease_until;
    END IF;
    -- Holders that stopped renewing are gone, and their calls with them.
    DELETE FROM @extschema@.llm_holder WHERE lease_until < t;

    max_in_flight := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_max_in_flight'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_max_in_flight'), '8')::integer;
    per_holder := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'generation_concurrency'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'generation_concurrency'), '8')::integer;
    per_minute := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_requests_per_minute'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_requests_per_minute'), '0')::integer;

    IF NOT p_leaving AND cardinality(p_finished) > 0 THEN
        IF per_minute > 0 THEN
            -- Started calls stay a minute, to count in the window.
            UPDATE @extschema@.llm_call SET finished_at = t
             WHERE id = ANY(p_finished) AND holder = p_holder AND granted_at IS NOT NULL
               AND finished_at IS NULL;
            DELETE FROM @extschema@.llm_call
             WHERE id = ANY(p_finished) AND holder = p_holder AND granted_at IS NULL;
        ELSE
            DELETE FROM @extschema@.llm_call WHERE id = ANY(p_finished) AND holder = p_holder;
        END IF;
    END IF;
    DELETE FROM @extschema@.llm_call
     WHERE finished_at IS NOT NULL AND (per_minute = 0 OR granted_at < t - interval '1 minute');

    IF p_pause_s IS NOT NULL
       AND (budget.paused_until IS NULL OR budget.paused_until < t + make_interval(secs => p_pause_s)) THEN
        UPDATE @extschema@.llm_budget
           SET paused_until = t + make_interval(secs => p_pause_s), pause_reason = p_pause_reason,
               paused_by = p_instance, paused_at = t
        RETURNING * INTO budget;
        PERFORM pg_notify('llm_budget', '*');
    END IF;

    IF NOT p_leaving THEN
        WITH added AS (
            INSERT INTO @extschema@.llm_call (holder, issue_id, claim_id, priority)
            SELECT p_holder, u.issue_id, u.claim_id, COALESCE(u.priority, p.priority, 'briefing')
              FROM unnest(p_issue_ids, p_claim_ids, p_priorities) WITH ORDINALITY AS u(issue_id, claim_id, priority, ord)
              LEFT JOIN @extschema@.issue_priority p ON p.issue_id = u.issue_id
             ORDER BY u.ord
            RETURNING id
        )
        -- Identities are drawn in insertion order, which is input order.
        SELECT COALESCE(array_agg(id ORDER BY id), '{}') INTO queued FROM added;
    END IF;

    IF budget.paused_until > t THEN
        paused_for_s := extract(epoch FROM budget.paused_until - t);
        pause_reason := budget.pause_reason;
        paused_by := budget.paused_by;
    ELSE
        SELECT count(*) INTO in_flight FROM @extschema@.llm_call
         WHERE granted_at IS NOT NULL AND finished_at IS NULL;
        room := max_in_flight - in_flight;
        IF per_minute > 0 THEN
            SELECT count(*), min(granted_at) INTO started, oldest_start FROM @extschema@.llm_call
             WHERE granted_at >= t - interval '1 minute';
            room := least(room, per_minute - started);
        END IF;
        IF room > 0 THEN
            -- Each holder's best waiting calls, as many as it may still
            -- start; of those, the best across holders.
            chosen := ARRAY(
                SELECT w.id
                  FROM (SELECT h.holder,
                               per_holder - (SELECT count(*) FROM @extschema@.llm_call c
                                              WHERE c.holder = h.holder AND c.granted_at IS NOT NULL
                                                AND c.finished_at IS NULL) AS free
                          FROM @extschema@.llm_holder h) r
                 CROSS JOIN LATERAL (
                       SELECT c.id, c.priority, c.claim_id FROM @extschema@.llm_call c
                        WHERE c.holder = r.holder AND c.granted_at IS NULL
                        ORDER BY (c.priority = 'feed'), c.claim_id
                        LIMIT greatest(r.free, 0)) w
                 ORDER BY (w.priority = 'feed'), w.claim_id
                 LIMIT room);
            -- While a briefing call waits anywhere, no feed call starts.
            IF EXISTS (SELECT 1 FROM @extschema@.llm_call
                        WHERE granted_at IS NULL AND priority = 'briefing' AND id <> ALL (chosen)) THEN
                chosen := ARRAY(SELECT id FROM @extschema@.llm_call
                                 WHERE id = ANY(chosen) AND priority = 'briefing');
            END IF;
            IF cardinality(chosen) > 0 THEN
                UPDATE @extschema@.llm_call SET granted_at = t WHERE id = ANY(chosen);
                PERFORM pg_notify('llm_budget', c.holder)
                   FROM (SELECT DISTINCT holder FROM @extschema@.llm_call
                          WHERE id = ANY(chosen) AND holder <> p_holder) c;
                started := started + cardinality(chosen);
            END IF;
        END IF;
    END IF;

    IF p_leaving THEN
        RETURN;
    END IF;
    granted := ARRAY(SELECT id FROM @extschema@.llm_call
                      WHERE holder = p_holder AND granted_at IS NOT NULL AND finished_at IS NULL
                      ORDER BY id);
    SELECT count(*) INTO holding FROM @extschema@.llm_call
     WHERE holder = p_holder AND finished_at IS NULL;
    IF EXISTS (SELECT 1 FROM @extschema@.llm_call WHERE holder = p_holder AND granted_at IS NULL) THEN
        ask_again_in_s := least(
            paused_for_s,
            CASE WHEN per_minute > 0 AND started >= per_minute
                 THEN extract(epoch FROM oldest_start + interval '1 minute' - t) END,
            (SELECT extract(epoch FROM min(h.lease_until) - t) FROM @extschema@.llm_holder h
              WHERE h.holder <> p_holder
                AND EXISTS (SELECT 1 FROM @extschema@.llm_call c
                             WHERE c.holder = h.holder AND c.granted_at IS NOT NULL
                               AND c.finished_at IS NULL)));
    END IF;
END
$$;

-- The completion records the tokens the API reported (migration 16 made it
-- a function; its statement as src/db/issue.rs documents it).

DROP FUNCTION @extschema@.newsnack_complete(bigint[], bigint[], text[], text[], text);

CREATE FUNCTION @extschema@.newsnack_complete(
    ids bigint[], claim_ids bigint[], headlines text[], bodies text[], writer text,
    prompt_tokens integer[], completion_tokens integer[]
) RETURNS TABLE (id bigint, claim_id bigint, written boolean)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH input AS (
         SELECT * FROM unnest(ids, claim_ids, headlines, bodies, prompt_tokens, completion_tokens)
                  AS t(id, claim_id, headline, body, prompt_tokens, completion_tokens)
     ), current AS (
         SELECT i.id, i.claim_id FROM @extschema@.issue i JOIN input USING (id, claim_id)
          WHERE i.id = ANY(ids) AND i.processing_status = 'IN_PROGRESS'
     ), free AS MATERIALIZED (
         SELECT i.id FROM @extschema@.issue i JOIN current USING (id, claim_id)
          WHERE i.id = ANY(ids) AND i.processing_status = 'IN_PROGRESS'
          ORDER BY i.id FOR UPDATE OF i SKIP LOCKED
     ), done AS (
         UPDATE @extschema@.issue i SET processing_status = 'DONE'
           FROM current
          WHERE i.id = ANY(ids) AND i.id IN (SELECT f.id FROM free f)
            AND i.id = current.id AND i.claim_id = current.claim_id
      RETURNING i.id, i.claim_id
     ), written AS (
         INSERT INTO @extschema@.ai_article (issue_id, headline, body, writer, claim_id,
                                             prompt_tokens, completion_tokens)
         SELECT d.id, input.headline, input.body, writer, d.claim_id,
                input.prompt_tokens, input.completion_tokens
           FROM done d JOIN input ON input.id = d.id AND input.claim_id = d.claim_id
      RETURNING issue_id, claim_id
     )
     SELECT c.id, c.claim_id, w.issue_id IS NOT NULL
       FROM current c
       LEFT JOIN written w ON w.issue_id = c.id AND w.claim_id = c.claim_id;
END
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.newsnack_complete(bigint[], bigint[], text[], text[], text,
                                                         integer[], integer[])
    FROM PUBLIC;
