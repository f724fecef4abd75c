-- 0028: a daily token budget (settings `llm_daily_token_budget` and
-- `llm_briefing_reserve_tokens`, rows since migration 24): the tokens each
-- day spent, in the readers' time zone, across every instance, counted by
-- the budget's exchange as holders report their finished calls, and the
-- exchange's grants held by them (docs/architecture.md, "The day's
-- tokens").

CREATE TABLE @extschema@.llm_token_day (
    day    date PRIMARY KEY,
    tokens bigint NOT NULL CONSTRAINT llm_token_day_tokens_valid CHECK (tokens >= 0)
);

DROP FUNCTION @extschema@.newsnack_llm_exchange(text, text, float8, bigint[], bigint[], text[], bigint[],
                                                float8, text, boolean);

-- One exchange of a holder with the budget, as in migration 17, and:
-- `p_tokens`: what the holder's finished calls spent, counted to today;
-- `tokens_today`: the day's count after it; `held`: `feed` once the day's
-- count reaches the budget less the briefing reserve (only briefing calls
-- are granted), `all` once it reaches the budget (none is), else NULL.
-- Calls held by the budget are asked about again at the next midnight.
CREATE FUNCTION @extschema@.newsnack_llm_exchange(
    p_holder text, p_instance text, p_lease_s float8,
    p_issue_ids bigint[], p_claim_ids bigint[], p_priorities text[],
    p_finished bigint[], p_tokens bigint, p_pause_s float8, p_pause_reason text, p_leaving boolean,
    OUT queued bigint[], OUT granted bigint[], OUT holding bigint,
    OUT paused_for_s float8, OUT pause_reason text, OUT paused_by text, OUT ask_again_in_s float8,
    OUT tokens_today bigint, OUT held text)
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
    zone text;
    today date;
    day_budget bigint;
    reserve bigint;
    next_day_in_s float8;
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
    day_budget := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_daily_token_budget'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_daily_token_budget'), '0')::bigint;
    reserve := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_briefing_reserve_tokens'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_briefing_reserve_tokens'), '0')::bigint;
    zone := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'timezone'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'timezone'), 'UTC');
    today := (t AT TIME ZONE zone)::date;
    next_day_in_s := extract(epoch FROM ((today + 1)::timestamp AT TIME ZONE zone) - t);

    -- The day's tokens: what the holder's finished calls spent counts to
    -- the day they are reported on. A year of days is kept.
    IF p_tokens > 0 THEN
        INSERT INTO @extschema@.llm_token_day AS d (day, tokens) VALUES (today, p_tokens)
        ON CONFLICT (day) DO UPDATE SET tokens = d.tokens + EXCLUDED.tokens;
        DELETE FROM @extschema@.llm_token_day WHERE day < today - 400;
    END IF;
    tokens_today := COALESCE((SELECT tokens FROM @extschema@.llm_token_day WHERE day = today), 0);
    held := CASE WHEN day_budget > 0 AND tokens_today >= day_budget THEN 'all'
                 WHEN day_budget > 0 AND tokens_today >= day_budget - reserve THEN 'feed' END;

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
    ELSIF held IS DISTINCT FROM 'all' THEN
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
                          AND (held IS NULL OR c.priority = 'briefing')
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
                               AND c.finished_at IS NULL)),
            -- Calls the day's budget holds wait for the next day.
            CASE WHEN held = 'all' OR (held = 'feed' AND EXISTS (
                          SELECT 1 FROM @extschema@.llm_call
                           WHERE holder = p_holder AND granted_at IS NULL AND priority = 'feed'))
                 THEN next_day_in_s END);
    END IF;
END
$$;
