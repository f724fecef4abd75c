-- 0038: a traced claim or completion costs the server what an untraced
-- one does. `newsnack_claim` and `newsnack_complete` take the issues'
-- trace contexts themselves (`contexts`, `,<id>=<traceparent>,..` as
-- 0037's `newsnack.issue_traceparents`), so the service sends one
-- statement whether or not its requests are traced, instead of the
-- PL/pgSQL wrapper of 0034/0037 around the claim and a transaction of
-- three statements around the completion; the claim's wrappers
-- stay for instances of the previous release during a rolling upgrade
-- (their four-argument call finds this function's default). And
-- `newsnack_traceparent`, which every traced transition calls, is inlined
-- into its caller's plan: no `SET search_path` (every name it uses is
-- `pg_catalog`'s, written out), and no SQL function call of its own.

DROP FUNCTION @extschema@.newsnack_claim(bigint[], text, double precision, integer);

CREATE FUNCTION @extschema@.newsnack_claim(
    ids bigint[], holder text, lease_s double precision, retry_below integer,
    contexts text DEFAULT NULL
) RETURNS TABLE (id bigint, claim_id bigint, attempts integer, title text, body text,
                 lease_until timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    named text;
BEGIN
    -- Each issue's trace context (`,<id>=<traceparent>,..`), which its
    -- claim transition keeps (`issue_transition_record`); NULL leaves the
    -- setting as the caller made it.
    IF contexts IS NOT NULL THEN
        named := set_config('newsnack.issue_traceparents', contexts, true);
    END IF;
    RETURN QUERY
    WITH asked AS MATERIALIZED (
         SELECT DISTINCT a.id FROM unnest((SELECT ids)) AS a(id) ORDER BY a.id
     ), claimable AS MATERIALIZED (
         SELECT l.id, l.ctid
           FROM asked a
          CROSS JOIN LATERAL (
                SELECT i.id, i.ctid
                  FROM @extschema@.issue i
                 WHERE i.id = a.id
                   AND CASE WHEN (SELECT retry_below) IS NULL
                            THEN i.processing_status IN ('PENDING', 'FAILED')
                            WHEN (SELECT retry_below) < 0
                            THEN i.processing_status = 'PENDING'
                            ELSE i.processing_status = 'FAILED' AND i.attempts < (SELECT retry_below)
                                 AND (i.retry_not_before IS NULL OR i.retry_not_before <= now())
                       END
                   FOR NO KEY UPDATE OF i SKIP LOCKED
          ) l
     ), claimed AS (
         UPDATE @extschema@.issue i
            SET processing_status = 'IN_PROGRESS',
                attempts = i.attempts + 1,
                claim_id = nextval('@extschema@.issue_claim_id_seq'),
                claimed_by = holder,
                lease_until = now() + make_interval(secs => lease_s)
           FROM claimable c
          WHERE i.ctid = ANY(ARRAY(SELECT c.ctid FROM claimable c)) AND i.id = c.id
      RETURNING i.id, i.claim_id, i.attempts, i.title, i.body, i.lease_until
     )
     SELECT c.id, c.claim_id, c.attempts, c.title, c.body, c.lease_until FROM claimed c
     UNION ALL
     SELECT d.id, NULL, NULL, NULL, NULL, NULL
       FROM asked a
      CROSS JOIN LATERAL (
            SELECT i.id FROM @extschema@.issue i
             WHERE i.id = a.id AND i.processing_status = 'DONE'
            OFFSET 0
      ) d;
END
$$;

DROP FUNCTION @extschema@.newsnack_complete(
    bigint[], bigint[], text[], text[], text, integer[], integer[]);

CREATE FUNCTION @extschema@.newsnack_complete(
    ids bigint[], claim_ids bigint[], headlines text[], bodies text[], writer text,
    prompt_tokens integer[], completion_tokens integer[], contexts text DEFAULT NULL
) RETURNS TABLE (id bigint, claim_id bigint, written boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    named text;
BEGIN
    -- Each issue's trace context, for its `DONE` transition: as in
    -- `newsnack_claim`.
    IF contexts IS NOT NULL THEN
        named := set_config('newsnack.issue_traceparents', contexts, true);
    END IF;
    RETURN QUERY
    WITH input AS (
         SELECT * FROM unnest((SELECT ids), claim_ids, headlines, bodies, prompt_tokens, completion_tokens)
                  AS t(id, claim_id, headline, body, prompt_tokens, completion_tokens)
     ), current AS (
         SELECT l.id, l.claim_id
           FROM input
          CROSS JOIN LATERAL (
                SELECT i.id, i.claim_id FROM @extschema@.issue i
                 WHERE i.id = input.id AND i.claim_id = input.claim_id
                   AND i.processing_status = 'IN_PROGRESS'
                OFFSET 0
          ) l
     ), free AS MATERIALIZED (
         SELECT l.id, l.ctid
           FROM (SELECT c.id, c.claim_id FROM current c ORDER BY c.id) c
          CROSS JOIN LATERAL (
                SELECT i.id, i.ctid FROM @extschema@.issue i
                 WHERE i.id = c.id AND i.claim_id = c.claim_id
                   AND i.processing_status = 'IN_PROGRESS'
                   FOR UPDATE OF i SKIP LOCKED
          ) l
     ), done AS (
         UPDATE @extschema@.issue i SET processing_status = 'DONE'
           FROM current
          WHERE i.ctid = ANY(ARRAY(SELECT f.ctid FROM free f))
            AND i.id = current.id AND i.claim_id = current.claim_id
      RETURNING i.id, i.claim_id
     ), written AS (
         INSERT INTO @extschema@.ai_article (issue_id, headline, body, writer, claim_id,
                                             prompt_tokens, completion_tokens)
         SELECT d.id, input.headline, input.body, writer, d.claim_id,
                input.prompt_tokens, input.completion_tokens
           FROM done d JOIN input ON input.id = d.id AND input.claim_id = d.claim_id
      RETURNING issue_id, claim_id
     )
     SELECT c.id, c.claim_id, w.issue_id IS NOT NULL
       FROM current c
       LEFT JOIN written w ON w.issue_id = c.id AND w.claim_id = c.claim_id;
END
$$;

REVOKE EXECUTE ON FUNCTION
    @extschema@.newsnack_claim(bigint[], text, double precision, integer, text),
    @extschema@.newsnack_complete(bigint[], bigint[], text[], text[], text, integer[], integer[], text)
FROM PUBLIC;

-- A W3C `traceparent` of version 00 with non-zero ids, lower-cased; NULL
-- for anything else (a malformed setting is ignored, not an error).
CREATE OR REPLACE FUNCTION @extschema@.newsnack_traceparent(candidate text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN candidate OPERATOR(pg_catalog.~) '^00-[0-9a-fA-F]{32}-[0-9a-fA-F]{16}-[0-9a-fA-F]{2}$'
                 AND pg_catalog.substr(candidate, 4, 32) OPERATOR(pg_catalog.<>) '00000000000000000000000000000000'
                 AND pg_catalog.substr(candidate, 37, 16) OPERATOR(pg_catalog.<>) '0000000000000000'
                THEN pg_catalog.lower(candidate) END
$$;
