-- 0004: the daily pipeline: `briefing`, `pipeline_run` (a record of every
-- run), and the `schedule` setting, of a new kind.

CREATE TABLE briefing (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    title         text NOT NULL,
    briefing_date date NOT NULL,
    -- Exactly the issues it was built from, in reading order.
    issue_ids     bigint[] NOT NULL CONSTRAINT briefing_not_empty CHECK (cardinality(issue_ids) > 0),
    -- The readable document (Markdown): title, date, the articles in order.
    body          text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE pipeline_run (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- 'schedule' runs carry their tick; at most one run per tick.
    trigger       text NOT NULL CONSTRAINT pipeline_run_trigger_valid CHECK (trigger IN ('schedule', 'manual')),
    tick          timestamptz,
    instance      text NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    -- 'running' until decided: all_pass, timeout_pass, skip, or
    -- 'abandoned' when its instance died mid-run, 'error' on failure.
    outcome       text NOT NULL DEFAULT 'running'
                  CONSTRAINT pipeline_run_outcome_valid
                  CHECK (outcome IN ('running', 'all_pass', 'timeout_pass', 'skip', 'abandoned', 'error')),
    targets       bigint[] NOT NULL DEFAULT '{}',
    claimed       bigint[] NOT NULL DEFAULT '{}',
    completed     bigint[] NOT NULL DEFAULT '{}',
    failed        bigint[] NOT NULL DEFAULT '{}',
    unfinished    bigint[] NOT NULL DEFAULT '{}',
    settings      jsonb NOT NULL DEFAULT '{}',
    waited_ms     bigint,
    briefing_id   bigint REFERENCES briefing (id),
    error         text
);
CREATE UNIQUE INDEX pipeline_run_one_per_tick ON pipeline_run (tick) WHERE trigger = 'schedule';
CREATE INDEX pipeline_run_started_at_idx ON pipeline_run (started_at DESC);

-- Text-valued settings: a kind column, and a rule per kind.
ALTER TABLE setting_spec ADD COLUMN kind text NOT NULL DEFAULT 'integer'
    CONSTRAINT setting_spec_kind_valid CHECK (kind IN ('integer', 'schedule'));
INSERT INTO setting_spec (key, default_value, min_value, max_value, description, kind) VALUES
    ('schedule', 'off', 0, 0,
     'scheduler: "off", "every 30s" / "every 15m" / "every 6h", or a cron expression (5 or 6 fields, UTC)',
     'schedule');

CREATE OR REPLACE FUNCTION setting_validate() RETURNS trigger LANGUAGE plpgsql AS $$
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
    NEW.updated_at := now();
    IF spec.kind = 'schedule' THEN
        NEW.value := regexp_replace(NEW.value, '\s+', ' ', 'g');
        IF NEW.value !~ '^(off|every [1-9][0-9]{0,6}[smh]|[0-9*/,?LW#A-Za-z-]+( [0-9*/,?LW#A-Za-z-]+){4,5})$' THEN
            RAISE EXCEPTION 'setting "%" must be "off", "every <n>s|m|h" or a cron expression of 5 or 6 fields, got "%"',
                NEW.key, NEW.value USING ERRCODE = 'check_violation';
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

INSERT INTO setting (key, value) VALUES ('schedule', 'off');
