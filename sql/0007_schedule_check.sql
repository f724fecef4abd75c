-- 0007: `newsnack_schedule_problem`: a `schedule` written with plain SQL is
-- checked field by field, each number in its field's range, in the forms
-- the scheduler's cron parser reads (listed in docs/sql.md, "Settings").

CREATE FUNCTION newsnack_schedule_problem(schedule text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    field_names constant text[] := ARRAY['second', 'minute', 'hour', 'day-of-month', 'month', 'day-of-week'];
    lowest constant int[] := ARRAY[0, 0, 0, 1, 1, 0];
    highest constant int[] := ARRAY[59, 59, 23, 31, 12, 7];
    months constant text[] := ARRAY['JAN', 'FEB', 'MAR', 'APR', 'MAY', 'JUN', 'JUL', 'AUG', 'SEP', 'OCT', 'NOV', 'DEC'];
    weekdays constant text[] := ARRAY['SUN', 'MON', 'TUE', 'WED', 'THU', 'FRI', 'SAT'];
    fields text[];
    field text;
    item text;
    part text[];
    i int;
    k int;
    first_value int;
    last_value int;
    step int;
    -- The days of the month and the months named, to check that they meet.
    days boolean[] := array_fill(false, ARRAY[31]);
    in_months boolean[] := array_fill(true, ARRAY[12]);
    any_day boolean := false;
    month_length constant int[] := ARRAY[31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
BEGIN
    IF schedule = 'off' THEN
        RETURN NULL;
    END IF;
    part := regexp_match(schedule, '^every ([1-9][0-9]{0,6})([smh])$');
    IF part IS NOT NULL THEN
        IF (part[1]::bigint * CASE part[2] WHEN 's' THEN 1 WHEN 'm' THEN 60 ELSE 3600 END) > 366 * 86400 THEN
            RETURN 'an interval must be at most 366 days';
        END IF;
        RETURN NULL;
    END IF;
    schedule := CASE upper(schedule)
        WHEN '@YEARLY' THEN '0 0 1 1 *'
        WHEN '@ANNUALLY' THEN '0 0 1 1 *'
        WHEN '@MONTHLY' THEN '0 0 1 * *'
        WHEN '@WEEKLY' THEN '0 0 * * 0'
        WHEN '@DAILY' THEN '0 0 * * *'
        WHEN '@HOURLY' THEN '0 * * * *'
        ELSE upper(schedule)
    END;
    fields := string_to_array(schedule, ' ');
    IF cardinality(fields) = 5 THEN
        fields := array_prepend('0', fields);
    ELSIF cardinality(fields) IS DISTINCT FROM 6 THEN
        RETURN 'expected "off", "every <n>s|m|h" or a cron expression of 5 or 6 fields';
    END IF;
    FOR k IN 1 .. 12 LOOP
        fields[5] := replace(fields[5], months[k], k::text);
    END LOOP;
    -- As the scheduler reads them: a range ending on Sunday ends on 7.
    fields[6] := replace(fields[6], '-SUN', '-7');
    FOR k IN 1 .. 7 LOOP
        fields[6] := replace(fields[6], weekdays[k], (k - 1)::text);
    END LOOP;
    IF fields[5] NOT IN ('*', '?') THEN
        in_months := array_fill(false, ARRAY[12]);
    END IF;
    any_day := fields[4] IN ('*', '?');
    FOR i IN 1 .. 6 LOOP
        field := fields[i];
        CONTINUE WHEN field = '*' OR (field = '?' AND i IN (4, 6));
        FOREACH item IN ARRAY string_to_array(field, ',') LOOP
            step := 1;
            -- A step: `*/s`, `n/s` (n to the field's end) or `a-b/s`.
            part := regexp_match(item, '^(\*|([0-9]{1,3})(-([0-9]{1,3}))?)/([0-9]{1,3})$');
            IF part IS NOT NULL THEN
                IF part[5]::int NOT BETWEEN 1 AND highest[i] - lowest[i] + 1 THEN
                    RETURN format('the step in "%s" must be between 1 and %s in the %s field',
                                  item, highest[i] - lowest[i] + 1, field_names[i]);
                END IF;
                first_value := COALESCE(part[2]::int, lowest[i]);
                last_value := COALESCE(part[4]::int, highest[i]);
                step := part[5]::int;
            ELSIF item ~ '^[0-9]{1,3}-[0-9]{1,3}$' THEN
                first_value := split_part(item, '-', 1)::int;
                last_value := split_part(item, '-', 2)::int;
            ELSIF item ~ '^[0-9]{1,3}$' THEN
                first_value := item::int;
                last_value := first_value;
            ELSIF i = 4 AND item ~ '^[0-9]{1,3}W$' THEN
                first_value := rtrim(item, 'W')::int;
                last_value := first_value;
            ELSIF i = 6 AND item ~ '^[0-9]{1,3}(L|#[0-9]{1,3})$' THEN
                -- The last, or the n-th, such weekday of the month: 0-6
                -- (a 7 here would never match).
                IF item ~ '#' AND split_part(item, '#', 2)::int NOT BETWEEN 1 AND 5 THEN
                    RETURN format('"%s": the n in day#n must be between 1 and 5', item);
                END IF;
                first_value := substring(item FROM '^[0-9]+')::int;
                last_value := first_value;
                IF first_value > 6 THEN
                    RETURN format('"%s": the weekday before L or # must be 0-6 (Sunday is 0)', item);
                END IF;
            ELSIF i = 4 AND item = 'L' THEN
                any_day := true;
                CONTINUE;
            ELSE
                RETURN format('"%s" is not something the %s field accepts', item, field_names[i]);
            END IF;
            IF first_value < lowest[i] OR last_value > highest[i] THEN
                RETURN format('"%s" is outside the %s field''s range %s-%s',
                              item, field_names[i], lowest[i], highest[i]);
            END IF;
            IF first_value > last_value THEN
                RETURN format('the range "%s" runs backwards', item);
            END IF;
            IF i IN (4, 5) THEN
                FOR k IN SELECT generate_series(first_value, last_value, step) LOOP
                    IF i = 4 THEN
                        days[k] := true;
                    ELSE
                        in_months[k] := true;
                    END IF;
                END LOOP;
            END IF;
        END LOOP;
    END LOOP;
    -- With any weekday, the days of the month named must fall in one of the
    -- months named (no 30 February), or the schedule never fires.
    IF fields[6] IN ('*', '?') AND NOT any_day AND NOT EXISTS (
        SELECT FROM generate_series(1, 12) m, generate_series(1, 31) d
         WHERE in_months[m] AND days[d] AND d <= month_length[m]
    ) THEN
        RETURN 'the days of the month given never fall in the months given';
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION setting_validate() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    spec setting_spec;
    parsed numeric;
    problem text;
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
        problem := newsnack_schedule_problem(NEW.value);
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION 'invalid schedule "%" for setting "%": % (expected "off", "every <n>s|m|h" or a cron expression of 5 or 6 fields, UTC)',
                NEW.value, NEW.key, problem USING ERRCODE = 'check_violation';
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
