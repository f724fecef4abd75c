-- 0014: emptying the setting table is announced.
--
-- Every row change of `setting` sends NOTIFY `setting_changed` (0003), and
-- the services re-read their settings on it. A `TRUNCATE setting` changed
-- no row, so nothing was sent: every setting was back at its default for
-- the database, while running services kept the values they had cached
-- until the next change or reconnect.

CREATE FUNCTION setting_announce_truncation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('setting_changed', '*');
    RETURN NULL;
END
$$;

CREATE TRIGGER setting_truncated AFTER TRUNCATE ON setting
    FOR EACH STATEMENT EXECUTE FUNCTION setting_announce_truncation();
