-- 0032: the pods worth running now, for KEDA's PostgreSQL scaler
-- (docs/production.md, "Autoscaling"). Read from the kept counts per
-- status (migration 27) and a few settings, so it costs the same at a
-- thousand issues and at a million.

-- The work ready to claim (`PENDING`) and in flight (`IN_PROGRESS`),
-- `per_pod` issues a pod; capped by the pods the shared LLM budget keeps
-- busy (`llm_max_in_flight` calls, each pod holding at most `per_pod` and
-- `generation_concurrency` of them); 1 while no call may start
-- (`generation_paused`, or the day's token budget spent); never below 1,
-- so the scheduler's lock always has a home. Runs as its caller: a role
-- given `newsnack grant reader` may call it.
CREATE FUNCTION @extschema@.newsnack_scale_hint(per_pod integer) RETURNS integer
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    work bigint;
    max_in_flight integer;
    per_instance integer;
    day_budget bigint;
    zone text;
BEGIN
    IF per_pod IS NULL OR per_pod < 1 THEN
        RAISE EXCEPTION 'newsnack_scale_hint: per_pod must be at least 1 (issues a pod works on), not %',
            COALESCE(per_pod::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF COALESCE((SELECT value FROM @extschema@.setting WHERE key = 'generation_paused'), 'false') = 'true' THEN
        RETURN 1;
    END IF;
    day_budget := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_daily_token_budget'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_daily_token_budget'), '0')::bigint;
    IF day_budget > 0 THEN
        zone := COALESCE(
            (SELECT value FROM @extschema@.setting WHERE key = 'timezone'),
            (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'timezone'), 'UTC');
        IF COALESCE((SELECT tokens FROM @extschema@.llm_token_day
                      WHERE day = (now() AT TIME ZONE zone)::date), 0) >= day_budget THEN
            RETURN 1;
        END IF;
    END IF;
    max_in_flight := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'llm_max_in_flight'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'llm_max_in_flight'), '8')::integer;
    per_instance := COALESCE(
        (SELECT value FROM @extschema@.setting WHERE key = 'generation_concurrency'),
        (SELECT default_value FROM @extschema@.setting_spec WHERE key = 'generation_concurrency'), '8')::integer;
    SELECT COALESCE(sum(n), 0) INTO work FROM @extschema@.issue_status_delta
     WHERE status IN ('PENDING', 'IN_PROGRESS');
    RETURN greatest(1, least(
        ceil(work::numeric / per_pod),
        ceil(max_in_flight::numeric / least(per_pod, per_instance))))::integer;
END
$$;
