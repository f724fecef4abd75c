-- 0003: runtime settings: `setting_spec` (keys, defaults, bounds), a
-- trigger that refuses unknown keys and out-of-range values from any
-- writer, NOTIFY `setting_changed` on every change, every key at its default.

CREATE TABLE setting_spec (
    key           text PRIMARY KEY,
    default_value text NOT NULL,
    min_value     bigint NOT NULL,
    max_value     bigint NOT NULL,
    description   text NOT NULL
);

INSERT INTO setting_spec (key, default_value, min_value, max_value, description) VALUES
    ('content_gen_timeout_s', '600', 1, 86400, 'smart wait: seconds to wait for the targets before deciding'),
    ('content_gen_min_completion', '3', 0, 1000, 'smart wait: DONE targets needed to go on at the timeout'),
    ('top_k', '5', 1, 100, 'pipeline: how many of the hottest issues make a briefing'),
    ('lookback_hours', '24', 1, 8760, 'pipeline: only issues collected this recently are candidates'),
    ('max_attempts', '3', 1, 100, 'generation: attempts per issue before it stays FAILED'),
    ('lease_s', '60', 1, 86400, 'generation: how long a claim lives without a heartbeat'),
    ('generation_concurrency', '8', 1, 1024, 'generation: LLM calls in flight per instance'),
    ('retry_backoff_ms', '2000', 1, 3600000, 'generation: first retry delay; doubles per attempt, with jitter'),
    ('retry_backoff_max_ms', '300000', 1, 86400000, 'generation: longest retry delay');

CREATE FUNCTION setting_validate() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    spec setting_spec;
    parsed numeric;
BEGIN
    SELECT * INTO spec FROM setting_spec WHERE key = NEW.key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown setting "%" (known: %)', NEW.key,
            (SELECT string_agg(key, ', ' ORDER BY key) FROM setting_spec)
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.value := btrim(NEW.value);
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
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

CREATE FUNCTION setting_announce() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('setting_changed', COALESCE(NEW.key, OLD.key));
    RETURN NULL;
END
$$;

CREATE TRIGGER setting_validate BEFORE INSERT OR UPDATE ON setting
    FOR EACH ROW EXECUTE FUNCTION setting_validate();
CREATE TRIGGER setting_announce AFTER INSERT OR UPDATE OR DELETE ON setting
    FOR EACH ROW EXECUTE FUNCTION setting_announce();

INSERT INTO setting (key, value) SELECT key, default_value FROM setting_spec;
