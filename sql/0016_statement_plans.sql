-- 0016: `newsnack_claim` and `newsnack_complete`: the claim and the
-- completion as PL/pgSQL functions, which keep a generic plan of each
-- statement for the server session, so that the service can send them
-- unnamed (through a transaction pooler). Only the owner may call them.

CREATE FUNCTION @extschema@.newsnack_claim(
    ids bigint[], holder text, lease_s double precision, retry_below integer
) RETURNS TABLE (id bigint, claim_id bigint, attempts integer, title text, body text,
                 lease_until timestamptz)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH claimable AS MATERIALIZED (
         SELECT i.id
           FROM @extschema@.issue i
          WHERE i.id = ANY(ids)
            AND CASE WHEN retry_below IS NULL
                     THEN i.processing_status IN ('PENDING', 'FAILED')
                     WHEN retry_below < 0
                     THEN i.processing_status = 'PENDING'
                     ELSE i.processing_status = 'FAILED' AND i.attempts < retry_below
                          AND (i.retry_not_before IS NULL OR i.retry_not_before <= now())
                END
          ORDER BY i.id
            FOR NO KEY UPDATE OF i SKIP LOCKED
     ), claimed AS (
         UPDATE @extschema@.issue i
            SET processing_status = 'IN_PROGRESS',
                attempts = i.attempts + 1,
                claim_id = nextval('@extschema@.issue_claim_id_seq'),
                claimed_by = holder,
                lease_until = now() + make_interval(secs => lease_s)
           FROM claimable c
          WHERE i.id = c.id
      RETURNING i.id, i.claim_id, i.attempts, i.title, i.body, i.lease_until
     )
     SELECT c.id, c.claim_id, c.attempts, c.title, c.body, c.lease_until FROM claimed c
     UNION ALL
     SELECT i.id, NULL, NULL, NULL, NULL, NULL
       FROM @extschema@.issue i
      WHERE i.id = ANY(ids) AND i.processing_status = 'DONE';
END
$$;

CREATE FUNCTION @extschema@.newsnack_complete(
    ids bigint[], claim_ids bigint[], headlines text[], bodies text[], writer text
) RETURNS TABLE (id bigint, claim_id bigint, written boolean)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH input AS (
         SELECT * FROM unnest(ids, claim_ids, headlines, bodies)
                  AS t(id, claim_id, headline, body)
     ), current AS (
         SELECT i.id, i.claim_id FROM @extschema@.issue i JOIN input USING (id, claim_id)
          WHERE i.id = ANY(ids) AND i.processing_status = 'IN_PROGRESS'
     ), free AS MATERIALIZED (
         SELECT i.id FROM @extschema@.issue i JOIN current USING (id, claim_id)
          WHERE i.id = ANY(ids) AND i.processing_status = 'IN_PROGRESS'
          ORDER BY i.id FOR UPDATE OF i SKIP LOCKED
     ), done AS (
         UPDATE @extschema@.issue i SET processing_status = 'DONE'
           FROM current
          WHERE i.id = ANY(ids) AND i.id IN (SELECT f.id FROM free f)
            AND i.id = current.id AND i.claim_id = current.claim_id
      RETURNING i.id, i.claim_id
     ), written AS (
         INSERT INTO @extschema@.ai_article (issue_id, headline, body, writer, claim_id)
         SELECT d.id, input.headline, input.body, writer, d.claim_id
           FROM done d JOIN input ON input.id = d.id AND input.claim_id = d.claim_id
      RETURNING issue_id, claim_id
     )
     SELECT c.id, c.claim_id, w.issue_id IS NOT NULL
       FROM current c
       LEFT JOIN written w ON w.issue_id = c.id AND w.claim_id = c.claim_id;
END
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.newsnack_claim(bigint[], text, double precision, integer),
                           @extschema@.newsnack_complete(bigint[], bigint[], text[], text[], text)
    FROM PUBLIC;
