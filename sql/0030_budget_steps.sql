-- 0030: the LLM budget's exchange as one policy in named steps
-- (docs/sql.md, "The LLM budget"): one typed request and one typed answer
-- (JSON, fields by name), the body small functions run in order, each
-- setting's default read from `setting_spec` only, and each granted call
-- told what a failure of it means. What the budget decided stays as it
-- was, and one step is new: the operator's pause (setting
-- `generation_paused`).

INSERT INTO @extschema@.setting_spec (key, default_value, min_value, max_value, description, kind, choices) VALUES
    ('generation_paused', 'false', 0, 0,
     'LLM: true stops every instance from starting an LLM call (calls in flight finish, claims queue) until it is false again (newsnack pause, newsnack resume)',
     'choice', '{false,true}');
INSERT INTO @extschema@.setting (key, value) VALUES ('generation_paused', 'false')
ON CONFLICT (key) DO NOTHING;

DROP FUNCTION @extschema@.newsnack_llm_exchange(
    text, text, float8, boolean, bigint[], bigint[], text[], boolean[], bigint[], bigint,
    text[], boolean[], float8[], text[], float8, text, boolean);

-- The LLM budget's policy (docs/sql.md, "The LLM budget"): one exchange of
-- a holder with the budget, its only writer, made of the steps below, run
-- in order by `newsnack_llm_exchange`. Each step takes what it needs by
-- name and can be replaced alone; `t` is the exchange's clock.

-- The settings the policy reads, each a stored value or its default in
-- `setting_spec` (the one place a default is written).
CREATE FUNCTION @extschema@.newsnack_llm_settings(
    OUT max_in_flight integer, OUT per_holder integer, OUT per_minute integer,
    OUT fallback_max integer, OUT fallback_per_minute integer,
    OUT circuit_failures integer, OUT circuit_open_s integer, OUT fallback_for text,
    OUT day_budget bigint, OUT reserve bigint, OUT zone text)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT max(v) FILTER (WHERE k = 'llm_max_in_flight')::integer,
           max(v) FILTER (WHERE k = 'generation_concurrency')::integer,
           max(v) FILTER (WHERE k = 'llm_requests_per_minute')::integer,
           max(v) FILTER (WHERE k = 'llm_fallback_max_in_flight')::integer,
           max(v) FILTER (WHERE k = 'llm_fallback_requests_per_minute')::integer,
           max(v) FILTER (WHERE k = 'llm_circuit_failures')::integer,
           max(v) FILTER (WHERE k = 'llm_circuit_open_s')::integer,
           max(v) FILTER (WHERE k = 'llm_fallback_for'),
           max(v) FILTER (WHERE k = 'llm_daily_token_budget')::bigint,
           max(v) FILTER (WHERE k = 'llm_briefing_reserve_tokens')::bigint,
           max(v) FILTER (WHERE k = 'timezone')
      FROM (SELECT sp.key, COALESCE(s.value, sp.default_value)
              FROM @extschema@.setting_spec sp LEFT JOIN @extschema@.setting s ON s.key = sp.key
             WHERE sp.key IN ('llm_max_in_flight', 'generation_concurrency', 'llm_requests_per_minute',
                              'llm_fallback_max_in_flight', 'llm_fallback_requests_per_minute',
                              'llm_circuit_failures', 'llm_circuit_open_s', 'llm_fallback_for',
                              'llm_daily_token_budget', 'llm_briefing_reserve_tokens', 'timezone')) AS v(k, v)
$$;

-- Whether a call of class `p_priority` may go to the fallback provider,
-- by `llm_fallback_for` (`briefing`, `all` or `none`).
CREATE FUNCTION @extschema@.newsnack_llm_may_fall_back(p_fallback_for text, p_priority text) RETURNS boolean
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT p_fallback_for = 'all' OR (p_fallback_for = 'briefing' AND p_priority = 'briefing')
$$;

-- Step 1, the holders: renews the holder's lease (or removes it, leaving,
-- with its calls), and removes every holder whose lease ran out, with its
-- calls: their share comes back.
CREATE FUNCTION @extschema@.newsnack_llm_renew(
    p_holder text, p_instance text, p_lease_s float8, p_has_fallback boolean, p_leaving boolean,
    t timestamptz) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF p_leaving THEN
        DELETE FROM @extschema@.llm_holder WHERE holder = p_holder;
    ELSE
        INSERT INTO @extschema@.llm_holder AS h (holder, instance, lease_until, has_fallback)
        VALUES (p_holder, p_instance, t + make_interval(secs => p_lease_s), p_has_fallback)
        ON CONFLICT (holder) DO UPDATE SET lease_until = EXCLUDED.lease_until,
                                           has_fallback = EXCLUDED.has_fallback;
    END IF;
    DELETE FROM @extschema@.llm_holder WHERE lease_until < t;
END
$$;

-- Step 2, the day's tokens: what the holder's finished calls spent counts
-- to the day (in `p_zone`) it is reported on; a year of days is kept.
-- `held`: which calls the day's budget holds until the next day: `feed`
-- once the day's tokens reach the budget less the briefing reserve, `all`
-- once they reach the budget, else NULL (also with no budget).
CREATE FUNCTION @extschema@.newsnack_llm_count_tokens(
    p_tokens bigint, p_day_budget bigint, p_reserve bigint, p_zone text, t timestamptz,
    OUT tokens_today bigint, OUT held text, OUT next_day_in_s float8)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    today date := (t AT TIME ZONE p_zone)::date;
BEGIN
    IF p_tokens > 0 THEN
        INSERT INTO @extschema@.llm_token_day AS d (day, tokens) VALUES (today, p_tokens)
        ON CONFLICT (day) DO UPDATE SET tokens = d.tokens + EXCLUDED.tokens;
        DELETE FROM @extschema@.llm_token_day WHERE day < today - 400;
    END IF;
    tokens_today := COALESCE((SELECT tokens FROM @extschema@.llm_token_day WHERE day = today), 0);
    held := CASE WHEN p_day_budget > 0 AND tokens_today >= p_day_budget THEN 'all'
                 WHEN p_day_budget > 0 AND tokens_today >= p_day_budget - p_reserve THEN 'feed' END;
    next_day_in_s := extract(epoch FROM ((today + 1)::timestamp AT TIME ZONE p_zone) - t);
END
$$;

-- Step 3, the providers' circuits, from `p_reports` (a JSON array of
-- `{"provider", "ok", "pause_s", "reason"}`): a success closes one;
-- failures in a row open it at `p_circuit_failures`, for
-- `p_circuit_open_s`, doubled with every failure past it (a failed probe),
-- 16 times at most; a pause a provider asked for keeps it down at least
-- that long.
CREATE FUNCTION @extschema@.newsnack_llm_record_reports(
    p_reports jsonb, p_circuit_failures integer, p_circuit_open_s integer, t timestamptz) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    report record;
BEGIN
    FOR report IN SELECT * FROM jsonb_to_recordset(p_reports)
                                AS r(provider text, ok boolean, pause_s float8, reason text) LOOP
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
                       WHEN p.failures + 1 >= p_circuit_failures
                           THEN greatest(p.down_until, t + make_interval(
                                    secs => p_circuit_open_s * 2 ^ least(p.failures + 1 - p_circuit_failures, 4)))
                       ELSE p.down_until END
             WHERE provider = report.provider;
        END IF;
    END LOOP;
END
$$;

-- Step 4, calls that ended (or will never run) go back. While starts are
-- counted per minute (`p_count_starts`), a started call stays a minute
-- after it ends, to count in the window.
CREATE FUNCTION @extschema@.newsnack_llm_take_back(
    p_holder text, p_finished bigint[], p_count_starts boolean, t timestamptz) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF cardinality(p_finished) > 0 THEN
        IF p_count_starts THEN
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
     WHERE finished_at IS NOT NULL AND (NOT p_count_starts OR granted_at < t - interval '1 minute');
END
$$;

-- Step 5, a rate limit's pause of the primary, every instance keeping it:
-- `p_pause_s` from now (NULL: none), unless one already lasts longer.
-- Answers the pause in force, if any.
CREATE FUNCTION @extschema@.newsnack_llm_record_pause(
    p_pause_s float8, p_reason text, p_instance text, t timestamptz,
    OUT paused_until timestamptz, OUT pause_reason text, OUT paused_by text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    SELECT b.paused_until, b.pause_reason, b.paused_by INTO paused_until, pause_reason, paused_by
      FROM @extschema@.llm_budget b;
    IF p_pause_s IS NOT NULL
       AND (paused_until IS NULL OR paused_until < t + make_interval(secs => p_pause_s)) THEN
        UPDATE @extschema@.llm_budget
           SET paused_until = t + make_interval(secs => p_pause_s), pause_reason = p_reason,
               paused_by = p_instance, paused_at = t
        RETURNING llm_budget.paused_until, llm_budget.pause_reason, llm_budget.paused_by
             INTO paused_until, pause_reason, paused_by;
        PERFORM pg_notify('llm_budget', '*');
    END IF;
    IF NOT paused_until > t THEN
        SELECT NULL, NULL, NULL INTO paused_until, pause_reason, paused_by;
    END IF;
END
$$;

-- Step 6, queueing: the holder's new calls (a JSON array of `{"issue_id",
-- "claim_id", "priority", "fallback_only"}`), in order. A class asked for
-- is remembered for the issue's retries; a call with none takes the one
-- the issue was last asked for at, else briefing. A call for the fallback
-- only (the primary failed it) waits for the fallback. Answers the ids,
-- drawn in input order.
CREATE FUNCTION @extschema@.newsnack_llm_queue(p_holder text, p_calls jsonb) RETURNS TABLE (id bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO @extschema@.issue_priority AS p (issue_id, priority)
    SELECT DISTINCT ON (u.issue_id) u.issue_id, u.priority
      FROM jsonb_to_recordset(p_calls) AS u(issue_id bigint, priority text)
     WHERE u.priority IS NOT NULL
    ON CONFLICT (issue_id) DO UPDATE SET priority = EXCLUDED.priority, requested_at = now()
     WHERE p.priority IS DISTINCT FROM EXCLUDED.priority;
    RETURN QUERY
    INSERT INTO @extschema@.llm_call AS c (holder, issue_id, claim_id, priority, provider)
    SELECT p_holder, u.issue_id, u.claim_id, COALESCE(u.priority, p.priority, 'briefing'),
           CASE WHEN u.fallback_only THEN 'fallback' END
      FROM jsonb_array_elements(p_calls) WITH ORDINALITY AS e(call, ord),
           jsonb_to_record(e.call) AS u(issue_id bigint, claim_id bigint, priority text, fallback_only boolean)
      LEFT JOIN @extschema@.issue_priority p ON p.issue_id = u.issue_id
     ORDER BY e.ord
    RETURNING c.id;
END
$$;

-- Step 7, a provider's room: how many calls may start on it now, and
-- whether it is down for routing. None while paused (`p_paused_until`) or
-- while its circuit is open; past the circuit's time, one call at a time
-- probes it (half open) and it counts as down for the others; else up to
-- `p_max_in_flight` in flight and `p_per_minute` started in the last
-- minute (0: unlimited).
CREATE FUNCTION @extschema@.newsnack_llm_room(
    p_provider text, p_max_in_flight integer, p_per_minute integer, p_circuit_failures integer,
    p_paused_until timestamptz, t timestamptz,
    OUT room integer, OUT down boolean, OUT room_grows_at timestamptz)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    state @extschema@.llm_provider;
    in_flight integer;
    started integer;
    oldest timestamptz;
BEGIN
    SELECT * INTO state FROM @extschema@.llm_provider WHERE provider = p_provider;
    SELECT count(*) INTO in_flight FROM @extschema@.llm_call
     WHERE granted_at IS NOT NULL AND finished_at IS NULL AND COALESCE(provider, 'primary') = p_provider;
    room := CASE WHEN p_paused_until > t OR state.down_until > t THEN 0
                 WHEN state.failures >= p_circuit_failures THEN (in_flight = 0)::integer
                 ELSE p_max_in_flight - in_flight END;
    down := (p_paused_until > t) IS TRUE OR (state.down_until > t) IS TRUE
            OR state.failures >= p_circuit_failures;
    room_grows_at := least(CASE WHEN p_paused_until > t THEN p_paused_until END,
                           CASE WHEN state.down_until > t THEN state.down_until END);
    IF p_per_minute > 0 THEN
        SELECT count(*), min(granted_at) INTO started, oldest FROM @extschema@.llm_call
         WHERE granted_at >= t - interval '1 minute' AND COALESCE(provider, 'primary') = p_provider;
        room := least(room, p_per_minute - started);
        IF started >= p_per_minute THEN
            room_grows_at := least(room_grows_at, oldest + interval '1 minute');
        END IF;
    END IF;
END
$$;

-- Step 8, the operator's pause (`generation_paused`, set by `newsnack
-- pause` and `newsnack resume`): while it is on, no call starts on any
-- instance; calls in flight finish, and new calls queue.
CREATE FUNCTION @extschema@.newsnack_llm_operator_paused() RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT COALESCE(s.value, sp.default_value) = 'true'
      FROM @extschema@.setting_spec sp LEFT JOIN @extschema@.setting s ON s.key = sp.key
     WHERE sp.key = 'generation_paused'
$$;

-- Step 9, the grant: each holder's best waiting calls, as many as it may
-- still start (`p_per_holder`); of those, the best across holders (briefing
-- first, then the oldest claim), each to the primary while it has room,
-- else to the fallback while it has room if the holder has one and the
-- call was queued for it, or the primary is down and the class may go
-- there (`p_fallback_for`). Calls of the class `p_held` holds (`feed`,
-- `all`) wait. While a briefing call waits anywhere, no feed call starts.
-- Rings the doorbell of every other holder granted a call.
CREATE FUNCTION @extschema@.newsnack_llm_grant(
    p_holder text, p_per_holder integer, p_fallback_for text, p_held text,
    p_primary_room integer, p_primary_down boolean, p_fallback_room integer, t timestamptz) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    candidate record;
    chosen bigint[] := '{}';
    chosen_providers text[] := '{}';
BEGIN
    IF p_held = 'all' THEN
        RETURN 0;
    END IF;
    FOR candidate IN
        SELECT w.id, w.priority, w.provider, r.has_fallback
          FROM (SELECT h.holder, h.has_fallback,
                       p_per_holder - (SELECT count(*) FROM @extschema@.llm_call c
                                        WHERE c.holder = h.holder AND c.granted_at IS NOT NULL
                                          AND c.finished_at IS NULL) AS free
                  FROM @extschema@.llm_holder h) r
         CROSS JOIN LATERAL (
               SELECT c.id, c.priority, c.claim_id, c.provider FROM @extschema@.llm_call c
                WHERE c.holder = r.holder AND c.granted_at IS NULL
                  AND (p_held IS NULL OR c.priority = 'briefing')
                ORDER BY (c.priority = 'feed'), c.claim_id
                LIMIT greatest(r.free, 0)) w
         ORDER BY (w.priority = 'feed'), w.claim_id
    LOOP
        EXIT WHEN p_primary_room <= 0 AND p_fallback_room <= 0;
        IF candidate.provider IS NULL AND p_primary_room > 0 THEN
            chosen := chosen || candidate.id;
            chosen_providers := chosen_providers || 'primary'::text;
            p_primary_room := p_primary_room - 1;
        ELSIF candidate.has_fallback AND p_fallback_room > 0
              AND (candidate.provider = 'fallback'
                   OR (p_primary_down AND @extschema@.newsnack_llm_may_fall_back(p_fallback_for, candidate.priority))) THEN
            chosen := chosen || candidate.id;
            chosen_providers := chosen_providers || 'fallback'::text;
            p_fallback_room := p_fallback_room - 1;
        END IF;
    END LOOP;
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
    END IF;
    RETURN cardinality(chosen);
END
$$;

-- Step 10, the holder's calls granted and not finished, each with where it
-- goes, its class and what a failure of it means (`on_failure`):
-- `fallback` (on the primary, with a fallback to go to, of a class
-- `p_fallback_for` lets go there: ask the fallback at once, in the same
-- claim) or `retry` (the attempt fails; the issue is retried later);
-- how many calls it holds in all, and whether some of them wait.
CREATE FUNCTION @extschema@.newsnack_llm_holding(
    p_holder text, p_fallback_for text, OUT granted jsonb, OUT holding bigint, OUT waiting boolean)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT COALESCE(jsonb_agg(jsonb_build_object(
               'id', c.id, 'provider', c.provider, 'priority', c.priority,
               'on_failure', CASE WHEN c.provider = 'primary' AND h.has_fallback
                                       AND @extschema@.newsnack_llm_may_fall_back(p_fallback_for, c.priority)
                                  THEN 'fallback' ELSE 'retry' END) ORDER BY c.id)
               FILTER (WHERE c.granted_at IS NOT NULL), '[]'),
           count(*),
           bool_or(c.granted_at IS NULL)
      FROM @extschema@.llm_call c JOIN @extschema@.llm_holder h ON h.holder = c.holder
     WHERE c.holder = p_holder AND c.finished_at IS NULL
$$;

-- Step 11, when the holder should ask again, if some of its calls wait for
-- something time brings (`p_rooms_grow_at`: a pause ending, a circuit half
-- opening, the minute's window moving on; another holder's lease running
-- out; the next day, for calls the day's budget holds), and what.
CREATE FUNCTION @extschema@.newsnack_llm_ask_again(
    p_holder text, p_rooms_grow_at timestamptz, p_held text, p_next_day_in_s float8, t timestamptz,
    OUT in_s float8, OUT what text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lease_ends timestamptz;
    day_holds boolean;
BEGIN
    SELECT min(h.lease_until) INTO lease_ends FROM @extschema@.llm_holder h
     WHERE h.holder <> p_holder
       AND EXISTS (SELECT 1 FROM @extschema@.llm_call c
                    WHERE c.holder = h.holder AND c.granted_at IS NOT NULL AND c.finished_at IS NULL);
    day_holds := p_held = 'all' OR (p_held = 'feed' AND EXISTS (
                     SELECT 1 FROM @extschema@.llm_call
                      WHERE holder = p_holder AND granted_at IS NULL AND priority = 'feed'));
    SELECT u.in_s, u.what INTO in_s, what
      FROM (VALUES (extract(epoch FROM p_rooms_grow_at - t), 'room'),
                   (extract(epoch FROM lease_ends - t), 'lease'),
                   (CASE WHEN day_holds THEN p_next_day_in_s END, 'day')) AS u(in_s, what)
     WHERE u.in_s IS NOT NULL
     ORDER BY u.in_s LIMIT 1;
END
$$;

-- The exchange: the one lock every dispatcher waits for, then the steps
-- in order at the database's clock. `request`: `{"holder", "instance",
-- "lease_s", "has_fallback", "queue", "finished", "tokens", "reports",
-- "pause": {"s", "reason"} | null, "leaving"}`. Answers `{"queued",
-- "granted", "holding", "pause": {"remaining_s", "reason", "by"} | null,
-- "ask_again_in_s", "tokens_today", "held"}` (see the steps).
CREATE FUNCTION @extschema@.newsnack_llm_exchange(request jsonb) RETURNS TABLE (answer jsonb)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- The budget's state is worth no WAL flush: every dispatcher waits for
    -- this lock, and a crash loses what the leases give back anyway (a
    -- call granted twice is finished by its holder at once, a call lost
    -- is queued again by its holder). Until the transaction ends only.
    PERFORM set_config('synchronous_commit', 'off', true);
    -- One dispatcher at a time. Every statement of the steps runs on a
    -- snapshot taken after the lock, so it sees what the previous holder
    -- committed.
    PERFORM FROM @extschema@.llm_budget FOR UPDATE;
    RETURN QUERY SELECT * FROM @extschema@.newsnack_llm_exchange_at(request, clock_timestamp());
END
$$;

-- The exchange's steps in order, at `t` (the caller holds the lock).
CREATE FUNCTION @extschema@.newsnack_llm_exchange_at(request jsonb, t timestamptz)
RETURNS TABLE (answer jsonb)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    holder text := request->>'holder';
    leaving boolean := COALESCE((request->>'leaving')::boolean, false);
    s record;
    day record;
    pause record;
    primary_room record;
    fallback_room record;
    queued jsonb := '[]';
    mine record;
    ask_again_in_s float8;
BEGIN
    SELECT * INTO s FROM @extschema@.newsnack_llm_settings();

    PERFORM @extschema@.newsnack_llm_renew(holder, request->>'instance', (request->>'lease_s')::float8,
                                           COALESCE((request->>'has_fallback')::boolean, false), leaving, t);
    SELECT * INTO day FROM @extschema@.newsnack_llm_count_tokens(
        COALESCE((request->>'tokens')::bigint, 0), s.day_budget, s.reserve, s.zone, t);
    PERFORM @extschema@.newsnack_llm_record_reports(COALESCE(request->'reports', '[]'),
                                                    s.circuit_failures, s.circuit_open_s, t);
    PERFORM @extschema@.newsnack_llm_take_back(
        holder, ARRAY(SELECT jsonb_array_elements_text(COALESCE(request->'finished', '[]'))::bigint),
        s.per_minute > 0 OR s.fallback_per_minute > 0, t);
    SELECT * INTO pause FROM @extschema@.newsnack_llm_record_pause(
        (request#>>'{pause,s}')::float8, request#>>'{pause,reason}', request->>'instance', t);
    IF NOT leaving THEN
        SELECT COALESCE(jsonb_agg(q.id ORDER BY q.id), '[]') INTO queued
          FROM @extschema@.newsnack_llm_queue(holder, COALESCE(request->'queue', '[]')) q;
    END IF;
    SELECT * INTO primary_room FROM @extschema@.newsnack_llm_room(
        'primary', s.max_in_flight, s.per_minute, s.circuit_failures, pause.paused_until, t);
    SELECT * INTO fallback_room FROM @extschema@.newsnack_llm_room(
        'fallback', s.fallback_max, s.fallback_per_minute, s.circuit_failures, NULL, t);
    IF NOT @extschema@.newsnack_llm_operator_paused() THEN
        PERFORM @extschema@.newsnack_llm_grant(holder, s.per_holder, s.fallback_for, day.held,
                                               primary_room.room, primary_room.down, fallback_room.room, t);
    END IF;
    IF leaving THEN
        answer := '{}';
        RETURN NEXT;
        RETURN;
    END IF;

    SELECT * INTO mine FROM @extschema@.newsnack_llm_holding(holder, s.fallback_for);
    IF mine.waiting THEN
        -- The rooms again, after this exchange's grants: when they grow.
        SELECT * INTO primary_room FROM @extschema@.newsnack_llm_room(
            'primary', s.max_in_flight, s.per_minute, s.circuit_failures, pause.paused_until, t);
        SELECT * INTO fallback_room FROM @extschema@.newsnack_llm_room(
            'fallback', s.fallback_max, s.fallback_per_minute, s.circuit_failures, NULL, t);
        SELECT a.in_s INTO ask_again_in_s FROM @extschema@.newsnack_llm_ask_again(
            holder, least(primary_room.room_grows_at, fallback_room.room_grows_at),
            day.held, day.next_day_in_s, t) a;
    END IF;
    answer := jsonb_build_object(
        'queued', queued, 'granted', mine.granted, 'holding', mine.holding,
        'pause', CASE WHEN pause.paused_until IS NOT NULL THEN jsonb_build_object(
                     'remaining_s', extract(epoch FROM pause.paused_until - t),
                     'reason', pause.pause_reason, 'by', pause.paused_by) END,
        'ask_again_in_s', ask_again_in_s, 'tokens_today', day.tokens_today, 'held', day.held);
    RETURN NEXT;
END
$$;
