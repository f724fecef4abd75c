-- 0029: a fallback LLM provider (docs/architecture.md, "Two providers"):
-- the state of each provider every instance agrees on (`llm_provider`,
-- with a circuit), the provider each granted call goes to, the fallback's
-- own limits, and the budget's exchange routing calls: to the primary
-- while it is up, to the fallback, for the classes `llm_fallback_for`
-- allows, while the primary is down or paused.

INSERT INTO @extschema@.setting_spec (key, default_value, min_value, max_value, description, kind) VALUES
    ('llm_fallback_max_in_flight', '4', 1, 10000,
     'LLM fallback provider: calls in flight on it across all instances together', 'integer'),
    ('llm_fallback_requests_per_minute', '0', 0, 1000000,
     'LLM fallback provider: calls started on it per minute across all instances (0: unlimited)', 'integer'),
    ('llm_circuit_failures', '3', 1, 1000,
     'LLM providers: failures in a row (5xx, timeouts, no connection) that mark a provider down for every instance',
     'integer'),
    ('llm_circuit_open_s', '30', 1, 3600,
     'LLM providers: seconds a provider marked down is left alone before one call probes it (doubled after each failed probe, up to 16 times)',
     'integer');

INSERT INTO @extschema@.setting (key, value)
SELECT key, default_value FROM @extschema@.setting_spec
 WHERE key IN ('llm_fallback_max_in_flight', 'llm_fallback_requests_per_minute',
               'llm_circuit_failures', 'llm_circuit_open_s')
ON CONFLICT (key) DO NOTHING;

CREATE TABLE @extschema@.llm_provider (
    provider      text PRIMARY KEY CONSTRAINT llm_provider_valid CHECK (provider IN ('primary', 'fallback')),
    -- Failed calls in a row; a success sets it back to 0.
    failures      integer NOT NULL DEFAULT 0 CONSTRAINT llm_provider_failures_valid CHECK (failures >= 0),
    -- Down until then; once past, with `failures` at the threshold, one
    -- call at a time probes it.
    down_until    timestamptz,
    last_error    text,
    last_error_at timestamptz,
    -- When its state last changed; NULL: never.
    changed_at    timestamptz
);
INSERT INTO @extschema@.llm_provider (provider) VALUES ('primary'), ('fallback');

-- The provider a call was granted on; set when it is queued for the
-- fallback only (after the primary failed it).
ALTER TABLE @extschema@.llm_call ADD COLUMN provider text
    CONSTRAINT llm_call_provider_valid CHECK (provider IN ('primary', 'fallback'));
-- Whether the holder's process has a fallback provider to call.
ALTER TABLE @extschema@.llm_holder ADD COLUMN has_fallback boolean NOT NULL DEFAULT false;

DROP FUNCTION @extschema@.newsnack_llm_exchange(text, text, float8, bigint[], bigint[], text[], bigint[],
                                                bigint, float8, text, boolean);

-- One exchange of a holder with the budget, as in migrations 17 and 28,
-- and with two providers: `p_has_fallback`: the holder can call the
-- fallback; `p_fallback_only`: per call to queue, whether it goes to the
-- fallback only (the primary failed it); `p_report_*`: how the holder's
-- ended calls went on each provider (`ok`, or a failure with its reason
-- and a pause the provider asked for). Answers, beside migration 28's,
-- the provider and class of each call granted.
CREATE FUNCTION @extschema@.newsnack_llm_exchange(
    p_holder text, p_instance text, p_lease_s float8, p_has_fallback boolean,
    p_issue_ids bigint[], p_claim_ids bigint[], p_priorities text[], p_fallback_only boolean[],
    p_finished bigint[], p_tokens bigint,
    p_report_providers text[], p_report_ok boolean[], p_report_pause_s float8[], p_report_reasons text[],
    p_pause_s float8, p_pause_reason text, p_leaving boolean,
    OUT queued bigint[], OUT granted bigint[], OUT granted_providers text[], OUT granted_priorities text[],
    OUT holding bigint, OUT paused_for_s float8, OUT pause_reason text, OUT paused_by text,
    OUT ask_again_in_s float8, OUT tokens_today bigint, OUT held text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    budget @extschema@.llm_budget;
    t timestamptz;
    max_in_flight integer;
    per_holder integer;
    per_minute integer;
    fallback_max integer;
    fallback_per_minute integer;
    circuit_failures integer;
    circuit_open_s integer;
    fallback_for text;
    primary_state @extschema@.llm_provider;
    fallback_state @extschema@.llm_provider;
    primary_down boolean;
    primary_room integer;
    fallback_room integer;
    in_flight_primary integer;
    in_flight_fallback integer;
    started_primary integer := 0;
    started_fallback integer := 0;
    oldest_primary timestamptz;
    oldest_fallback timestamptz;
    candidate record;
    report record;
    chosen bigint[] := '{}';
    chosen_providers text[] := '{}';
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
        INSERT INTO @extschema@.llm_holder AS h (holder, instance, lease_until, has_fallback)
        VALUES (p_holder, p_instance, t + make_interval(secs => p_lease_s), p_has_fallback)
        ON CONFLICT (holder) DO UPDATE SET lease_until = EXCLUDED.lease_until,
                                           has_fallback = EXCLUDED.has_fallback;
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
    fallback_max := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_fallback_max_in_flight'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_fallback_max_in_flight'), '4')::integer;
    fallback_per_minute := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_fallback_requests_per_minute'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_fallback_requests_per_minute'), '0')::integer;
    circuit_failures := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_circuit_failures'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_circuit_failures'), '3')::integer;
    circuit_open_s := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_circuit_open_s'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_circuit_open_s'), '30')::integer;
    fallback_for := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_fallback_for'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_fallback_for'), 'briefing');
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

    -- The providers' circuits: a success closes one; failures in a row
    -- open it at the threshold, for `llm_circuit_open_s`, doubled with
    -- every failure past it (a failed probe), 16 times at most; a pause a
    -- provider asked for keeps it down at least that long.
    FOR report IN SELECT * FROM unnest(p_report_providers, p_report_ok, p_report_pause_s, p_report_reasons)
                                AS r(provider, ok, pause_s, reason) LOOP
        IF report.ok THEN
            UPDATE @extschema@.llm_provider SET failures = 0, down_until = NULL, changed_at = t
             WHERE provider = report.provider AND (failures > 0 OR down_until IS NOT NULL);
        ELSE
            UPDATE @extschema@.llm_provider p
               SET failures = p.failures + 1, last_error = left(report.reason, 500), last_error_at = t,
                   changed_at = t,
                   down_until = CASE
                       WHEN report.pause_s IS NOT NULL
                           THEN greatest(p.down_until, t + make_interval(secs => report.pause_s))
                       WHEN p.failures + 1 >= circuit_failures
                           THEN greatest(p.down_until, t + make_interval(
                                    secs => circuit_open_s * 2 ^ least(p.failures + 1 - circuit_failures, 4)))
                       ELSE p.down_until END
             WHERE provider = report.provider;
        END IF;
    END LOOP;

    IF NOT p_leaving AND cardinality(p_finished) > 0 THEN
        IF per_minute > 0 OR fallback_per_minute > 0 THEN
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
     WHERE finished_at IS NOT NULL
       AND ((per_minute = 0 AND fallback_per_minute = 0) OR granted_at < t - interval '1 minute');

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
            INSERT INTO @extschema@.llm_call (holder, issue_id, claim_id, priority, provider)
            SELECT p_holder, u.issue_id, u.claim_id, COALESCE(u.priority, p.priority, 'briefing'),
                   CASE WHEN u.fallback_only THEN 'fallback' END
              FROM unnest(p_issue_ids, p_claim_ids, p_priorities, p_fallback_only)
                   WITH ORDINALITY AS u(issue_id, claim_id, priority, fallback_only, ord)
              LEFT JOIN @extschema@.issue_priority p ON p.issue_id = u.issue_id
             ORDER BY u.ord
            RETURNING id
        )
        -- Identities are drawn in insertion order, which is input order.
        SELECT COALESCE(array_agg(id ORDER BY id), '{}') INTO queued FROM added;
    END IF;

    SELECT * INTO primary_state FROM @extschema@.llm_provider WHERE provider = 'primary';
    SELECT * INTO fallback_state FROM @extschema@.llm_provider WHERE provider = 'fallback';
    IF budget.paused_until > t THEN
        paused_for_s := extract(epoch FROM budget.paused_until - t);
        pause_reason := budget.pause_reason;
        paused_by := budget.paused_by;
    END IF;
    -- The primary is down while paused or while its circuit is open; past
    -- the circuit's time, one call at a time probes it (half open), and
    -- the others are routed as if it were down.
    primary_down := paused_for_s IS NOT NULL OR primary_state.down_until > t
                    OR primary_state.failures >= circuit_failures;

    IF held IS DISTINCT FROM 'all' THEN
        SELECT count(*) FILTER (WHERE provider IS DISTINCT FROM 'fallback'),
               count(*) FILTER (WHERE provider = 'fallback')
          INTO in_flight_primary, in_flight_fallback
          FROM @extschema@.llm_call WHERE granted_at IS NOT NULL AND finished_at IS NULL;
        primary_room := CASE
            WHEN paused_for_s IS NOT NULL OR primary_state.down_until > t THEN 0
            WHEN primary_state.failures >= circuit_failures THEN (in_flight_primary = 0)::integer
            ELSE max_in_flight - in_flight_primary END;
        fallback_room := CASE
            WHEN fallback_state.down_until > t THEN 0
            WHEN fallback_state.failures >= circuit_failures THEN (in_flight_fallback = 0)::integer
            ELSE fallback_max - in_flight_fallback END;
        IF per_minute > 0 THEN
            SELECT count(*), min(granted_at) INTO started_primary, oldest_primary FROM @extschema@.llm_call
             WHERE granted_at >= t - interval '1 minute' AND provider IS DISTINCT FROM 'fallback';
            primary_room := least(primary_room, per_minute - started_primary);
        END IF;
        IF fallback_per_minute > 0 THEN
            SELECT count(*), min(granted_at) INTO started_fallback, oldest_fallback FROM @extschema@.llm_call
             WHERE granted_at >= t - interval '1 minute' AND provider = 'fallback';
            fallback_room := least(fallback_room, fallback_per_minute - started_fallback);
        END IF;
        -- Each holder's best waiting calls, as many as it may still start;
        -- of those, the best across holders, each to the primary while it
        -- has room, else to the fallback if the primary is down and the
        -- class may go there (or the call was queued for the fallback).
        FOR candidate IN
            SELECT w.id, w.priority, w.provider, r.has_fallback
              FROM (SELECT h.holder, h.has_fallback,
                           per_holder - (SELECT count(*) FROM @extschema@.llm_call c
                                          WHERE c.holder = h.holder AND c.granted_at IS NOT NULL
                                            AND c.finished_at IS NULL) AS free
                      FROM @extschema@.llm_holder h) r
             CROSS JOIN LATERAL (
                   SELECT c.id, c.priority, c.claim_id, c.provider FROM @extschema@.llm_call c
                    WHERE c.holder = r.holder AND c.granted_at IS NULL
                      AND (held IS NULL OR c.priority = 'briefing')
                    ORDER BY (c.priority = 'feed'), c.claim_id
                    LIMIT greatest(r.free, 0)) w
             ORDER BY (w.priority = 'feed'), w.claim_id
        LOOP
            EXIT WHEN primary_room <= 0 AND fallback_room <= 0;
            IF candidate.provider IS NULL AND primary_room > 0 THEN
                chosen := chosen || candidate.id;
                chosen_providers := chosen_providers || 'primary'::text;
                primary_room := primary_room - 1;
            ELSIF candidate.has_fallback AND fallback_room > 0
                  AND (candidate.provider = 'fallback'
                       OR (primary_down AND (fallback_for = 'all'
                                             OR (fallback_for = 'briefing' AND candidate.priority = 'briefing')))) THEN
                chosen := chosen || candidate.id;
                chosen_providers := chosen_providers || 'fallback'::text;
                fallback_room := fallback_room - 1;
            END IF;
        END LOOP;
        -- While a briefing call waits anywhere, no feed call starts.
        IF EXISTS (SELECT 1 FROM @extschema@.llm_call
                    WHERE granted_at IS NULL AND priority = 'briefing' AND id <> ALL (chosen)) THEN
            SELECT COALESCE(array_agg(u.id ORDER BY u.ord), '{}'), COALESCE(array_agg(u.provider ORDER BY u.ord), '{}')
              INTO chosen, chosen_providers
              FROM unnest(chosen, chosen_providers) WITH ORDINALITY AS u(id, provider, ord)
              JOIN @extschema@.llm_call c ON c.id = u.id
             WHERE c.priority = 'briefing';
        END IF;
        IF cardinality(chosen) > 0 THEN
            UPDATE @extschema@.llm_call c SET granted_at = t, provider = u.provider
              FROM unnest(chosen, chosen_providers) AS u(id, provider)
             WHERE c.id = u.id;
            PERFORM pg_notify('llm_budget', c.holder)
               FROM (SELECT DISTINCT holder FROM @extschema@.llm_call
                      WHERE id = ANY(chosen) AND holder <> p_holder) c;
            started_primary := started_primary + cardinality(array_positions(chosen_providers, 'primary'));
            started_fallback := started_fallback + cardinality(array_positions(chosen_providers, 'fallback'));
        END IF;
    END IF;

    IF p_leaving THEN
        RETURN;
    END IF;
    SELECT COALESCE(array_agg(id ORDER BY id), '{}'), COALESCE(array_agg(provider ORDER BY id), '{}'),
           COALESCE(array_agg(priority ORDER BY id), '{}')
      INTO granted, granted_providers, granted_priorities
      FROM @extschema@.llm_call
     WHERE holder = p_holder AND granted_at IS NOT NULL AND finished_at IS NULL;
    SELECT count(*) INTO holding FROM @extschema@.llm_call
     WHERE holder = p_holder AND finished_at IS NULL;
    IF EXISTS (SELECT 1 FROM @extschema@.llm_call WHERE holder = p_holder AND granted_at IS NULL) THEN
        ask_again_in_s := least(
            paused_for_s,
            CASE WHEN per_minute > 0 AND started_primary >= per_minute
                 THEN extract(epoch FROM oldest_primary + interval '1 minute' - t) END,
            CASE WHEN fallback_per_minute > 0 AND started_fallback >= fallback_per_minute
                 THEN extract(epoch FROM oldest_fallback + interval '1 minute' - t) END,
            -- A provider's circuit half-opening.
            CASE WHEN primary_state.down_until > t THEN extract(epoch FROM primary_state.down_until - t) END,
            CASE WHEN fallback_state.down_until > t THEN extract(epoch FROM fallback_state.down_until - t) END,
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
