-- 0031: the budget's steps written in SQL become PL/pgSQL, the same
-- signatures and answers: a SQL function with its own search_path is
-- never inlined and is planned again on every call, while PL/pgSQL keeps
-- its plans for the session (docs/sql.md, "The LLM budget").

CREATE OR REPLACE FUNCTION @extschema@.newsnack_llm_settings(
    OUT max_in_flight integer, OUT per_holder integer, OUT per_minute integer,
    OUT fallback_max integer, OUT fallback_per_minute integer,
    OUT circuit_failures integer, OUT circuit_open_s integer, OUT fallback_for text,
    OUT day_budget bigint, OUT reserve bigint, OUT zone text)
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
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
      INTO max_in_flight, per_holder, per_minute, fallback_max, fallback_per_minute,
           circuit_failures, circuit_open_s, fallback_for, day_budget, reserve, zone
      FROM (SELECT sp.key, COALESCE(s.value, sp.default_value)
              FROM @extschema@.setting_spec sp LEFT JOIN @extschema@.setting s ON s.key = sp.key
             WHERE sp.key IN ('llm_max_in_flight', 'generation_concurrency', 'llm_requests_per_minute',
                              'llm_fallback_max_in_flight', 'llm_fallback_requests_per_minute',
                              'llm_circuit_failures', 'llm_circuit_open_s', 'llm_fallback_for',
                              'llm_daily_token_budget', 'llm_briefing_reserve_tokens', 'timezone')) AS v(k, v);
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.newsnack_llm_may_fall_back(p_fallback_for text, p_priority text)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN p_fallback_for = 'all' OR (p_fallback_for = 'briefing' AND p_priority = 'briefing');
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.newsnack_llm_operator_paused() RETURNS boolean
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT COALESCE(s.value, sp.default_value) = 'true'
              FROM @extschema@.setting_spec sp LEFT JOIN @extschema@.setting s ON s.key = sp.key
             WHERE sp.key = 'generation_paused');
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.newsnack_llm_holding(
    p_holder text, p_fallback_for text, OUT granted jsonb, OUT holding bigint, OUT waiting boolean)
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    SELECT COALESCE(jsonb_agg(jsonb_build_object(
               'id', c.id, 'provider', c.provider, 'priority', c.priority,
               'on_failure', CASE WHEN c.provider = 'primary' AND h.has_fallback
                                       AND @extschema@.newsnack_llm_may_fall_back(p_fallback_for, c.priority)
                                  THEN 'fallback' ELSE 'retry' END) ORDER BY c.id)
               FILTER (WHERE c.granted_at IS NOT NULL), '[]'),
           count(*),
           bool_or(c.granted_at IS NULL)
      INTO granted, holding, waiting
      FROM @extschema@.llm_call c JOIN @extschema@.llm_holder h ON h.holder = c.holder
     WHERE c.holder = p_holder AND c.finished_at IS NULL;
END
$$;
