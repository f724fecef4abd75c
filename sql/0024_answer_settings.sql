-- 0024: the settings of a second LLM provider, a daily token budget and
-- checked answers (docs/configuration.md), with two new kinds of setting:
-- `choice` (one of the words in `setting_spec.choices`) and `phrase_list`
-- (phrases separated by `|`, none of them empty).

ALTER TABLE @extschema@.setting_spec ADD COLUMN choices text[];

ALTER TABLE @extschema@.setting_spec DROP CONSTRAINT setting_spec_kind_valid;
ALTER TABLE @extschema@.setting_spec ADD CONSTRAINT setting_spec_kind_valid
    CHECK (kind IN ('integer', 'schedule', 'prompt', 'prompt_template', 'time_zone', 'title_template',
                    'choice', 'phrase_list'));
-- A choice, and only a choice, lists what it may be.
ALTER TABLE @extschema@.setting_spec ADD CONSTRAINT setting_spec_choices_valid
    CHECK ((kind = 'choice') = (choices IS NOT NULL AND cardinality(choices) > 0));

INSERT INTO @extschema@.setting_spec (key, default_value, min_value, max_value, description, kind, choices) VALUES
    ('llm_fallback_for', 'briefing', 0, 0,
     'LLM: which calls go to the fallback provider while the primary is down: briefing, all or none',
     'choice', '{briefing,all,none}'),
    ('llm_daily_token_budget', '0', 0, 1000000000000,
     'LLM: prompt plus completion tokens per day (in the timezone setting''s time zone) across every instance and provider (0: unlimited)',
     'integer', NULL),
    ('llm_briefing_reserve_tokens', '0', 0, 1000000000000,
     'LLM: the part of the daily token budget only briefing calls may use',
     'integer', NULL),
    ('article_headline_max_chars', '120', 1, 10000,
     'answer checks: the longest headline, in user-perceived characters after Unicode NFC',
     'integer', NULL),
    ('article_body_min_chars', '1', 1, 1000000,
     'answer checks: the shortest body, in user-perceived characters after Unicode NFC',
     'integer', NULL),
    ('article_body_max_chars', '20000', 1, 1000000,
     'answer checks: the longest body, in user-perceived characters after Unicode NFC',
     'integer', NULL),
    ('article_reject_phrases', '', 0, 16000,
     'answer checks: phrases separated by |, matched case-insensitively, that reject an answer (e.g. a refusal); empty: none',
     'phrase_list', NULL),
    ('article_script', 'any', 0, 0,
     'answer checks: any, or hangul (at least half of the body''s letters are Hangul)',
     'choice', '{any,hangul}');

CREATE OR REPLACE FUNCTION @extschema@.setting_validate() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    spec @extschema@.setting_spec;
    parsed numeric;
    problem text;
    missing text;
    canonical text;
    phrases text[];
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
    IF spec.kind = 'choice' THEN
        NEW.value := lower(NEW.value);
        IF NOT NEW.value = ANY (spec.choices) THEN
            RAISE EXCEPTION 'setting "%" must be one of %, got "%"',
                NEW.key, array_to_string(spec.choices, ', '), NEW.value USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF spec.kind = 'phrase_list' THEN
        IF char_length(NEW.value) > spec.max_value THEN
            RAISE EXCEPTION 'setting "%" may be at most % characters long, got %',
                NEW.key, spec.max_value, char_length(NEW.value) USING ERRCODE = 'check_violation';
        END IF;
        IF NEW.value = '' THEN
            RETURN NEW;
        END IF;
        -- Each phrase trimmed; an empty one would match every answer.
        SELECT array_agg(btrim(p) ORDER BY n) INTO phrases
          FROM unnest(string_to_array(NEW.value, '|')) WITH ORDINALITY AS t(p, n);
        IF '' = ANY (phrases) THEN
            RAISE EXCEPTION 'setting "%" holds an empty phrase (a | at an end, or two with nothing between them), which would match every answer; separate non-empty phrases with |',
                NEW.key USING ERRCODE = 'check_violation';
        END IF;
        NEW.value := array_to_string(phrases, '|');
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

-- Every new setting at its default, checked by the rules above.
INSERT INTO @extschema@.setting (key, value)
SELECT key, default_value FROM @extschema@.setting_spec
 WHERE key IN ('llm_fallback_for', 'llm_daily_token_budget', 'llm_briefing_reserve_tokens',
               'article_headline_max_chars', 'article_body_min_chars', 'article_body_max_chars',
               'article_reject_phrases', 'article_script')
ON CONFLICT (key) DO NOTHING;
