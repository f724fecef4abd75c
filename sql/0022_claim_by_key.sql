-- 0022: the claim finds every row by its key, and the claim and the
-- completion are written once, here.
--
-- On the seeds' table of 2,000 issues the claim read the whole table on
-- every call. Under a generic plan the planner cannot see how many ids
-- come and guesses ten; ten lookups in the primary key then cost more by
-- its estimate than one pass over a table of some thirty pages, and the
-- kept claim (migrations 16 and 21) scanned `issue` twice, testing every
-- row against the array of ids: for the rows to lock, and for the ids
-- already `DONE` (4,000 rows read per claim, most of them claims that
-- take nothing). Every such pass ran on the same two cores as the
-- transitions waiting on the log's lock (docs/performance.md, "The
-- seeds' workload from outside"). Now:
--
-- - the requested ids, sorted and without duplicates, drive a nested
--   loop: each is looked up on its own (`LATERAL`, a subquery that locks
--   or is fenced with `OFFSET 0`, so it is not pulled up into a join the
--   planner could answer with a scan), in the key, whatever the table's
--   size and statistics; rows are still locked in id order;
-- - the UPDATE takes the rows it locked by their address (`ctid`, a TID
--   scan): the claim holds their locks, so no other transaction can have
--   moved them;
-- - the completion finds the claims still current, and locks their rows,
--   the same way, one lookup per completion, and updates them by their
--   address too (its plans scanned the table once the statistics said few
--   issues were in flight).
--
-- Until now the service kept a copy of each statement (src/db/issue.rs),
-- prepared once per session where no pooler stands in front, and a test
-- held the copies to these functions' text. Now both paths call the
-- functions: the service keeps the call itself as a named statement where
-- it may, and each server session keeps the plan of the function's
-- statement whichever client it serves. The functions no longer carry
-- `SET plan_cache_mode` (a setting saved, set and restored on every
-- call): the values a plan could be costed by are read through scalar
-- subqueries (the ids, the retry bound), so every plan costs the same and
-- the server keeps the generic one from a session's sixth call on.
--
-- What the claim and the completion do, their arguments and their answers
-- are as in 16 and 17.

CREATE OR REPLACE FUNCTION @extschema@.newsnack_claim(
    ids bigint[], holder text, lease_s double precision, retry_below integer
) RETURNS TABLE (id bigint, claim_id bigint, attempts integer, title text, body text,
                 lease_until timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
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

CREATE OR REPLACE FUNCTION @extschema@.newsnack_complete(
    ids bigint[], claim_ids bigint[], headlines text[], bodies text[], writer text,
    prompt_tokens integer[], completion_tokens integer[]
) RETURNS TABLE (id bigint, claim_id bigint, written boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
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
