-- 0012: a statement that deletes issues (at least one), and every
-- `TRUNCATE issue`, sends NOTIFY `issue_removed` at commit, so that running
-- services forget the ids they knew `DONE`.

CREATE FUNCTION issue_announce_removal() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('issue_removed', TG_OP);
    RETURN NULL;
END
$$;

-- A DELETE that removed no row announces nothing.
CREATE FUNCTION issue_announce_deletion() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM removed) THEN
        PERFORM pg_notify('issue_removed', TG_OP);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER issue_deleted AFTER DELETE ON issue
    REFERENCING OLD TABLE AS removed
    FOR EACH STATEMENT EXECUTE FUNCTION issue_announce_deletion();
CREATE TRIGGER issue_truncated AFTER TRUNCATE ON issue
    FOR EACH STATEMENT EXECUTE FUNCTION issue_announce_removal();
