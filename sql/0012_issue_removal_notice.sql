-- 0012: removing issues is announced.
--
-- Running services remember which issue ids are `DONE`, so that a claim
-- request for finished issues needs no database; `DONE` is terminal, so
-- that knowledge never goes stale, unless the issue is removed and its id
-- comes back: a `TRUNCATE issue RESTART IDENTITY` while the service runs,
-- or rows deleted and inserted again under explicit ids. Then requests
-- for the new issues were answered as if they were finished, until the
-- service restarted. Now every statement that deletes issues (or
-- truncates the table) sends NOTIFY `issue_removed` at commit (nothing if
-- it rolls back), and the services forget what they knew.

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
