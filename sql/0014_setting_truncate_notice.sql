-- 0014: `TRUNCATE setting` sends NOTIFY `setting_changed` with the payload
-- `*`, as every row change of `setting` sends its key.

CREATE FUNCTION setting_announce_truncation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('setting_changed', '*');
    RETURN NULL;
END
$$;

CREATE TRIGGER setting_truncated AFTER TRUNCATE ON setting
    FOR EACH STATEMENT EXECUTE FUNCTION setting_announce_truncation();
