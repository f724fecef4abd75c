//! Claims through `FOR NO KEY UPDATE SKIP LOCKED`: a storm of overlapping
//! batches claims every issue exactly once, where a read-then-update
//! claimer hands the same issue out twice.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::{within, TestDb};
use newsnack::db::issue::{
    claim_issues, claim_issues_traced, complete, complete_in_contexts, ClaimScope, Completion,
    Fenced,
};
use newsnack::db::DbPool;
use tokio::sync::Barrier;

const ISSUES: usize = 10_000;
const CLAIMERS: usize = 32;
const BATCH: usize = 50;
const LEASE: Duration = Duration::from_secs(60);

/// How one claimer claims a batch; returns the ids it believes it won.
#[derive(Clone, Copy)]
enum Claimer {
    SkipLocked,
    /// The service's path: concurrent requests merged into shared statements.
    Merged,
    /// The seed's original bug: read the statuses, then update.
    ReadThenUpdate,
}

async fn claim_batch(
    pool: &DbPool,
    merged: &newsnack::claims::claim::Claimer,
    how: Claimer,
    ids: &[i64],
    worker: &str,
) -> Vec<i64> {
    if let Claimer::Merged = how {
        return merged
            .claim(ids.to_vec(), LEASE, ClaimScope::Claimable)
            .await
            .unwrap()
            .claimed_ids();
    }
    let client = pool.get().await.unwrap();
    match how {
        Claimer::Merged => unreachable!("answered above"),
        Claimer::SkipLocked => claim_issues(
            &pool.session(&client),
            ids,
            worker,
            LEASE,
            ClaimScope::Claimable,
        )
        .await
        .unwrap()
        .claimed_ids(),
        Claimer::ReadThenUpdate => {
            let rows = client
                .query(
                    "SELECT id FROM issue WHERE id = ANY($1) AND processing_status IN ('PENDING','FAILED')",
                    &[&ids],
                )
                .await
                .unwrap();
            let pending: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
            // Unordered multi-row updates can deadlock each other; the naive
            // claimer then answers an error and claims nothing.
            match client
                .execute(
                    "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = ANY($1)",
                    &[&pending],
                )
                .await
            {
                Ok(_) => pending,
                Err(_) => Vec::new(),
            }
        }
    }
}

/// 32 claimers walk every window of the id range, each starting at its
/// own offset, all starting at once. Returns how often each id was won.
async fn storm(db: &TestDb, how: Claimer) -> HashMap<i64, usize> {
    let ids = Arc::new(db.add_issues(ISSUES).await);
    let windows = ISSUES / BATCH;
    let start = Arc::new(Barrier::new(CLAIMERS));
    let merged = newsnack::claims::claim::Claimer::start(db.pool.clone(), "merged".into(), 2);
    let mut tasks = Vec::new();
    for c in 0..CLAIMERS {
        let (pool, ids, start) = (db.pool.clone(), ids.clone(), start.clone());
        let merged = merged.clone();
        tasks.push(tokio::spawn(async move {
            let mut won = Vec::new();
            start.wait().await;
            for w in 0..windows {
                // Claimers overlap: neighbours share most of their windows.
                let first = ((c * 3 + w) % windows) * BATCH;
                let batch = &ids[first..first + BATCH];
                won.extend(claim_batch(&pool, &merged, how, batch, &format!("claimer-{c}")).await);
            }
            won
        }));
    }
    let mut counts: HashMap<i64, usize> = HashMap::new();
    for task in tasks {
        for id in task.await.unwrap() {
            *counts.entry(id).or_default() += 1;
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_of_overlapping_claims_claims_every_issue_exactly_once() {
    exactly_once(Claimer::SkipLocked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_storm_through_merged_statements_claims_every_issue_exactly_once() {
    exactly_once(Claimer::Merged).await;
}

async fn exactly_once(how: Claimer) {
    let db = TestDb::with_pool_size(CLAIMERS + 4).await;
    let counts = within(240, "the claim storm", storm(&db, how)).await;
    let duplicates = counts.values().filter(|&&n| n > 1).count();
    assert_eq!(duplicates, 0, "no issue may be claimed twice");
    assert_eq!(counts.len(), ISSUES, "every issue claimed");
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM issue WHERE processing_status='IN_PROGRESS' AND attempts=1"
        )
        .await,
        ISSUES as i64
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue_transition WHERE to_status='IN_PROGRESS'")
            .await,
        ISSUES as i64,
        "one logged claim per issue"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_storm_catches_a_read_then_update_claimer() {
    let db = TestDb::with_pool_size(CLAIMERS + 4).await;
    let counts = within(240, "the naive storm", storm(&db, Claimer::ReadThenUpdate)).await;
    let duplicates = counts.values().filter(|&&n| n > 1).count();
    assert!(
        duplicates > 0,
        "the racy claimer should hand some issue out twice (it handed out {} claims for {} issues)",
        counts.values().sum::<usize>(),
        counts.len()
    );
}

/// Statistics that say most issues are done, as on a database in use: a
/// plan that saw a statement's values would expect few rows to claim or
/// complete and look cheaper than the generic one.
async fn most_issues_done(db: &TestDb) {
    db.add_issues(2_000).await;
    db.raw()
        .await
        .batch_execute(
            "ALTER TABLE issue DISABLE TRIGGER USER;
             UPDATE issue SET processing_status = 'DONE';
             ALTER TABLE issue ENABLE TRIGGER USER;
             ANALYZE issue;",
        )
        .await
        .unwrap();
}

/// On `client`'s session: how many statements it keeps that call
/// `function`, and how many times it ran them on their generic plan.
async fn kept_on_session(client: &deadpool_postgres::Client, function: &str) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT count(*), COALESCE(sum(generic_plans), 0)::bigint
               FROM pg_prepared_statements
              WHERE statement LIKE '%' || $1 || '(%'
                AND statement NOT LIKE '%pg_prepared_statements%'",
            &[&function],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// A pool of one session for a transaction pooler: nothing kept on it.
fn pool_for_a_pooler(db: &TestDb) -> DbPool {
    use newsnack::db::{PoolOptions, Statements};
    newsnack::db::pool(
        &db.endpoint,
        &PoolOptions {
            max_size: 1,
            statements: Statements::Unnamed,
            ..PoolOptions::default()
        },
    )
    .unwrap()
}

/// With no pooler in front, a pooled session keeps the claim as a named
/// statement, parsed once; a session that lost it (a pooler after all, a
/// `DEALLOCATE ALL`) gets the claim unnamed, and keeps it again on the next.
/// A pool for a transaction pooler keeps nothing on its sessions.
#[tokio::test]
async fn the_claim_is_kept_per_session_only_where_no_pooler_stands_in_front() {
    let db = TestDb::new().await;
    most_issues_done(&db).await;
    let ids = db.add_issues(10).await;
    let claim = |pool: DbPool, id: i64| async move {
        let client = pool.get().await.unwrap();
        let outcome = claim_issues(
            &pool.session(&client),
            &[id],
            "w",
            LEASE,
            ClaimScope::Claimable,
        )
        .await
        .unwrap();
        assert_eq!(outcome.claimed_ids(), vec![id]);
        kept_on_session(&client, "newsnack_claim").await
    };
    let named = db.pool_of_one(Duration::from_secs(5));
    assert_eq!(
        claim(named.clone(), ids[0]).await.0,
        1,
        "kept by the session"
    );
    let client = named.get().await.unwrap();
    client.batch_execute("DEALLOCATE ALL").await.unwrap();
    drop(client);
    assert_eq!(
        claim(named.clone(), ids[1]).await.0,
        0,
        "sent unnamed once lost"
    );
    // The call is planned for its first five runs, then its generic plan
    // is kept (the function keeps the plan of its own statement).
    let mut generic = 0;
    for &id in &ids[2..9] {
        generic = claim(named.clone(), id).await.1;
    }
    assert_eq!(generic, 2, "the 6th and 7th calls run the generic plan");

    let pooled = pool_for_a_pooler(&db);
    assert_eq!(
        claim(pooled, ids[9]).await.0,
        0,
        "nothing kept behind a pooler"
    );
}

/// With no pooler in front, a pooled session keeps the completion as a
/// named statement too, and the server keeps its generic plan for one-id
/// completions on statistics that say most issues are done, where a plan
/// that saw the ids would look cheaper. Behind a pooler nothing is kept.
#[tokio::test]
async fn the_completion_is_kept_per_session_with_its_generic_plan() {
    let db = TestDb::new().await;
    most_issues_done(&db).await;
    let ids = db.add_issues(9).await;
    let complete_one = |pool: DbPool, id: i64| async move {
        let client = pool.get().await.unwrap();
        let session = pool.session(&client);
        let claimed = claim_issues(&session, &[id], "w", LEASE, ClaimScope::Claimable)
            .await
            .unwrap()
            .claimed;
        assert_eq!(claimed.len(), 1, "issue {id} claimed");
        let written = complete(
            &session,
            &[Completion {
                id,
                claim_id: claimed[0].claim_id,
                headline: format!("headline {id}"),
                body: "body".into(),
                usage: Default::default(),
            }],
            "w",
        )
        .await
        .unwrap();
        assert_eq!(written, vec![Fenced::Written], "issue {id} completed");
        kept_on_session(&client, "newsnack_complete").await
    };
    let named = db.pool_of_one(Duration::from_secs(5));
    let mut seen = (0, 0);
    for &id in &ids[..7] {
        seen = complete_one(named.clone(), id).await;
    }
    assert_eq!(
        seen,
        (1, 2),
        "kept once; the 6th and 7th calls run the generic plan"
    );

    let pooled = pool_for_a_pooler(&db);
    assert_eq!(
        complete_one(pooled, ids[7]).await.0,
        0,
        "nothing kept behind a pooler"
    );
    let done: i64 = db
        .raw()
        .await
        .query_one(
            "SELECT count(*) FROM issue i JOIN ai_article a ON a.issue_id = i.id
              WHERE i.id = ANY($1) AND i.processing_status = 'DONE' AND a.claim_id = i.claim_id",
            &[&ids[..8].to_vec()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        done, 8,
        "each completion wrote its issue's article and set it DONE"
    );
}

/// Requests in different trace contexts share one claim statement, and
/// completions finishing together one transaction: each issue's
/// transitions keep the context of its own request or generation, not the
/// first one's (`newsnack.issue_traceparents`, migration 37).
#[tokio::test]
async fn one_statement_for_several_trace_contexts_keeps_each_issues_own() {
    let db = TestDb::new().await;
    let ids = db.add_issues(3).await;
    let a = "00-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-aaaaaaaaaaaaaaaa-01";
    let b = "00-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb-bbbbbbbbbbbbbbbb-01";
    let client = db.pool.get().await.unwrap();
    let outcome = claim_issues_traced(
        &client,
        &ids,
        &[Some(a), Some(b), None],
        "w",
        LEASE,
        ClaimScope::Claimable,
    )
    .await
    .unwrap();
    let carried: Vec<Option<&str>> = outcome
        .claimed
        .iter()
        .map(|c| c.traceparent.as_deref())
        .collect();
    assert_eq!(carried, [Some(a), Some(b), None]);
    let sql = db.raw().await;
    let kept = |to: &'static str| {
        let sql = &sql;
        async move {
            let rows = sql
                .query(
                    "SELECT traceparent FROM issue_transition
                      WHERE to_status = $1::text ORDER BY issue_id",
                    &[&to],
                )
                .await
                .unwrap();
            rows.iter()
                .map(|r| r.get::<_, Option<String>>(0))
                .collect::<Vec<_>>()
        }
    };
    let owned = |v: [Option<&str>; 3]| v.map(|t| t.map(str::to_owned)).to_vec();
    assert_eq!(kept("IN_PROGRESS").await, owned([Some(a), Some(b), None]));

    let completions: Vec<Completion> = outcome
        .claimed
        .iter()
        .map(|c| Completion {
            id: c.id,
            claim_id: c.claim_id,
            headline: "h".into(),
            body: "b".into(),
            usage: Default::default(),
        })
        .collect();
    let contexts = owned([Some(b), None, Some(a)]);
    let written = complete_in_contexts(&client, &completions, &contexts, "w")
        .await
        .unwrap();
    assert_eq!(written, vec![Fenced::Written; 3]);
    assert_eq!(kept("DONE").await, contexts);
}

#[tokio::test]
async fn duplicate_and_unknown_ids_are_handled_not_errors() {
    let db = TestDb::new().await;
    let ids = db.add_issues(2).await;
    let client = db.pool.get().await.unwrap();
    let outcome = claim_issues(
        &client,
        &[ids[0], ids[0], 9_999_999, ids[1]],
        "w",
        LEASE,
        ClaimScope::Claimable,
    )
    .await
    .unwrap();
    assert_eq!(outcome.claimed_ids(), vec![ids[0], ids[1]]);
    assert_eq!(outcome.skipped, vec![9_999_999]);
    let again = claim_issues(&client, &ids, "w", LEASE, ClaimScope::Claimable)
        .await
        .unwrap();
    assert!(again.claimed.is_empty());
    assert_eq!(again.skipped, ids);
    let first = &outcome.claimed[0];
    assert_eq!((first.attempts, first.title.as_str()), (1, "issue 0"));
}

#[tokio::test]
async fn a_claim_skips_rows_locked_by_an_open_claim_without_waiting() {
    let db = TestDb::new().await;
    let ids = db.add_issues(3).await;
    let mut holder = db.pool.get().await.unwrap();
    let open = holder.transaction().await.unwrap();
    let held = claim_issues(&open, &ids[..2], "holder", LEASE, ClaimScope::Claimable)
        .await
        .unwrap();
    assert_eq!(held.claimed_ids(), ids[..2].to_vec());
    let other = db.pool.get().await.unwrap();
    let outcome = within(
        5,
        "a non-blocking claim",
        claim_issues(&other, &ids, "other", LEASE, ClaimScope::Claimable),
    )
    .await
    .unwrap();
    assert_eq!(outcome.claimed_ids(), vec![ids[2]]);
    assert_eq!(outcome.skipped, ids[..2].to_vec());
    open.rollback().await.unwrap();
    let after = claim_issues(&other, &ids, "other", LEASE, ClaimScope::Claimable)
        .await
        .unwrap();
    assert_eq!(
        after.claimed_ids(),
        ids[..2].to_vec(),
        "rolled-back claims are claimable again"
    );
}

#[tokio::test]
async fn a_key_share_lock_from_an_article_insert_does_not_hide_an_issue() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    // What inserting an ai_article does to its issue (foreign key check).
    let other = db.raw().await;
    other
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM issue WHERE id = {id} FOR KEY SHARE"
        ))
        .await
        .unwrap();
    // The trap: FOR UPDATE SKIP LOCKED would skip the row.
    let probe = db.raw().await;
    let with_for_update = probe
        .query(
            "SELECT id FROM issue WHERE id = $1 FOR UPDATE SKIP LOCKED",
            &[&id],
        )
        .await
        .unwrap();
    assert!(
        with_for_update.is_empty(),
        "FOR UPDATE conflicts with KEY SHARE"
    );
    let client = db.pool.get().await.unwrap();
    let outcome = claim_issues(&client, &[id], "w", LEASE, ClaimScope::Claimable)
        .await
        .unwrap();
    assert_eq!(
        outcome.claimed_ids(),
        vec![id],
        "FOR NO KEY UPDATE does not"
    );
    other.batch_execute("COMMIT").await.unwrap();
}

/// Each scope takes what it should, sent either way: the call of
/// `newsnack_claim`, and the scope's own statement kept by the session.
#[tokio::test]
async fn retries_take_only_failed_issues_with_attempts_left() {
    for kept in [false, true] {
        let db = TestDb::new().await;
        let ids = db.add_issues(4).await;
        // ids[0]: FAILED after 1 attempt; ids[1]: FAILED after 3; ids[2]
        // and ids[3]: PENDING.
        for (id, attempts) in [(ids[0], 1), (ids[1], 3)] {
            for _ in 0..attempts {
                db.move_with_sql(&[id], &["IN_PROGRESS", "FAILED"]).await;
            }
        }
        let client = db.pool.get().await.unwrap();
        let session = db.pool.session(&client);
        let claim = |ids: Vec<i64>, scope: ClaimScope| {
            let (client, session) = (&client, &session);
            async move {
                let outcome = if kept {
                    claim_issues(session, &ids, "w", LEASE, scope).await
                } else {
                    claim_issues(client, &ids, "w", LEASE, scope).await
                };
                outcome.unwrap()
            }
        };
        let retry = claim(ids.clone(), ClaimScope::RetryBelow(3)).await;
        assert_eq!(retry.claimed_ids(), vec![ids[0]], "kept: {kept}");
        assert_eq!(retry.claimed[0].attempts, 2);
        let pending = claim(vec![ids[1], ids[3]], ClaimScope::Pending).await;
        assert_eq!(pending.claimed_ids(), vec![ids[3]], "kept: {kept}");
        let explicit = claim(ids.clone(), ClaimScope::Claimable).await;
        assert_eq!(
            explicit.claimed_ids(),
            vec![ids[1], ids[2]],
            "an explicit request takes exhausted ones too (kept: {kept})"
        );
        let kept_here: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_prepared_statements WHERE statement = $1",
                &[&newsnack::db::issue::CLAIM_STATEMENT],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            kept_here,
            if kept { 1 } else { 0 },
            "one kept claim for every scope"
        );
    }
}

/// Requests merged into one statement get the answers they would get one
/// after another: each id goes to the first that asked, `DONE` ids are
/// reported, and it takes one statement.
#[tokio::test]
async fn merged_requests_answer_as_if_one_after_another() {
    let db = TestDb::new().await;
    db.count_statements().await;
    let ids = db.add_issues(5).await;
    db.move_with_sql(&ids[4..], &["IN_PROGRESS", "DONE"]).await;
    let calls = || db.claim_statements();
    let before = calls().await;
    let claimer = newsnack::claims::claim::Claimer::start(db.pool.clone(), "merged".into(), 1);
    let ask = |wanted: Vec<i64>| claimer.claim(wanted, LEASE, ClaimScope::Claimable);
    // On this single-threaded runtime all four are queued before the lane
    // runs, so they form one batch.
    let (a, b, c, d) = tokio::join!(
        ask(vec![ids[0], ids[1], ids[2]]),
        ask(vec![ids[3], ids[2], ids[1]]),
        ask(vec![ids[2]]),
        ask(vec![ids[4], ids[0], 999_999]),
    );
    let (a, b, c, d) = (a.unwrap(), b.unwrap(), c.unwrap(), d.unwrap());
    assert_eq!(a.claimed_ids(), ids[..3].to_vec());
    assert!(a.skipped.is_empty() && a.done.is_empty());
    assert_eq!(b.claimed_ids(), vec![ids[3]]);
    assert_eq!(b.skipped, vec![ids[1], ids[2]]);
    assert_eq!(c.claimed_ids(), Vec::<i64>::new());
    assert_eq!(c.skipped, vec![ids[2]]);
    assert_eq!(d.claimed_ids(), Vec::<i64>::new());
    assert_eq!(d.skipped, vec![ids[0], ids[4], 999_999]);
    assert_eq!(d.done, vec![ids[4]]);
    assert_eq!(calls().await - before, 1, "one statement for the four");
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM issue WHERE processing_status = 'IN_PROGRESS' AND attempts = 1"
        )
        .await,
        4
    );
}

/// The claim and completion statements look up the ids they are given,
/// whatever else is in flight and whatever the statistics say: their
/// generic plans (the ones a session keeps from its sixth call on) read a
/// handful of `issue` rows for a one-issue batch while a thousand other
/// claims are live, on a table never analysed and on one analysed while
/// nothing was in flight. A completion once scanned the reaper's index of
/// live leases (every live claim, and every entry a claim left dead since
/// the last vacuum) on every batch; without that index, it scanned the
/// table. A claim once updated the rows it locked through a hash join
/// over the whole table (migration 22).
#[tokio::test]
async fn claim_and_completion_read_only_the_issues_they_are_given() {
    for analysed in [false, true] {
        let (claim, complete) = issue_rows_read_by_one_issue_batches(analysed).await;
        // One row to find: read by each part of the statement that looks
        // it up (and the article's foreign-key check), each time through
        // the index entries of its few versions. A plan that scanned the
        // live claims would read a thousand.
        assert!(
            claim <= 4,
            "analysed: {analysed}: the claim read {claim} issue rows"
        );
        assert!(
            complete <= 16,
            "analysed: {analysed}: the completion read {complete} issue rows"
        );
    }
}

/// Claims 1,000 of 1,500 issues, then returns how many `issue` rows a
/// one-issue claim and a one-issue completion read, as the service runs
/// them. With `analyse_first`, the table is analysed before the claims.
async fn issue_rows_read_by_one_issue_batches(analyse_first: bool) -> (i64, i64) {
    let db = TestDb::new().await;
    let client = db.raw().await;
    // The statistics stay as set here: autovacuum would analyse at will.
    client
        .batch_execute("ALTER TABLE issue SET (autovacuum_enabled = off)")
        .await
        .unwrap();
    let ids = db.add_issues(1_500).await;
    if analyse_first {
        client.batch_execute("ANALYZE issue").await.unwrap();
    }
    let pool_client = db.pool.get().await.unwrap();
    let live = claim_issues(
        &pool_client,
        &ids[..1_000],
        "others",
        LEASE,
        ClaimScope::Claimable,
    )
    .await
    .unwrap();
    assert_eq!(live.claimed.len(), 1_000);
    let (pending, mine) = (ids[1_400], ids[1_200]);
    let claim_id = claim_issues(&pool_client, &[mine], "me", LEASE, ClaimScope::Claimable)
        .await
        .unwrap()
        .claimed[0]
        .claim_id;
    let claim = format!("SELECT * FROM newsnack_claim(ARRAY[{pending}]::bigint[], 'me', 60, NULL)");
    let complete = format!(
        "SELECT * FROM newsnack_complete(ARRAY[{mine}]::bigint[], ARRAY[{claim_id}]::bigint[], '{{h}}', '{{b}}', 'me', NULL, NULL)"
    );
    // A session plans a function's statement anew for its first five
    // calls, then keeps the generic plan: the one every later call runs.
    // Its first calls here ask for other issues (the completion under a
    // claim that is not current), so the issues measured have no dead
    // versions for an index to step over.
    for k in 0..5 {
        let other = ids[1_401 + k];
        common::rows_read_for_real(
            &client,
            "issue",
            &format!("SELECT * FROM newsnack_claim(ARRAY[{other}]::bigint[], 'me', 60, NULL)"),
        )
        .await;
        common::rows_read_for_real(
            &client,
            "issue",
            &format!(
                "SELECT * FROM newsnack_complete(ARRAY[{mine}]::bigint[], ARRAY[0]::bigint[], '{{h}}', '{{b}}', 'me', NULL, NULL)"
            ),
        )
        .await;
    }
    (
        common::rows_read_for_real(&client, "issue", &claim).await,
        common::rows_read_for_real(&client, "issue", &complete).await,
    )
}

/// When the pool gives no connection in time, a batch of claims is answered
/// at once, every request of it. Retried one by one, each request would wait
/// out the pool's timeout again, and the lane (and every claim behind it)
/// with it. Timed on the paused test clock: the waits are the pool's own.
#[tokio::test]
async fn a_batch_that_gets_no_connection_is_answered_at_once() {
    let db = TestDb::new().await;
    let ids = db.add_issues(20).await;
    let timeout = Duration::from_secs(5);
    let pool = db.pool_of_one(timeout);
    let busy = pool.get().await.unwrap();
    let claimer = newsnack::claims::claim::Claimer::start(pool.clone(), "starved".into(), 1);

    tokio::time::pause();
    let started = tokio::time::Instant::now();
    let answers = futures::future::join_all(
        ids.iter()
            .map(|&id| claimer.claim(vec![id], LEASE, ClaimScope::Claimable)),
    )
    .await;
    let waited = started.elapsed();
    tokio::time::resume();

    for answer in &answers {
        let e = answer.as_ref().expect_err("no connection, no claim");
        assert!(e.is_pool_exhausted(), "{e}");
    }
    assert!(
        waited < timeout * 2,
        "{} requests waited {waited:?} for a pool timeout of {timeout:?}",
        ids.len()
    );
    drop(busy);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM issue WHERE processing_status <> 'PENDING'")
            .await,
        0
    );
}

/// A claim whose requester went away while its statement ran (a pipeline
/// run whose wait decided meanwhile, say) is released at once with its
/// attempt given back, not left `IN_PROGRESS` with nothing to generate it
/// until its lease runs out. The requester goes away while the batch waits
/// for the pool's only connection, which the test holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_nobody_waits_for_any_more_is_released() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let (hub, _listening) = db.listener().await;
    let pool = db.pool_of_one(Duration::from_secs(60));
    let busy = pool.get().await.unwrap();
    let claimer = newsnack::claims::claim::Claimer::start(pool.clone(), "forgetful".into(), 1);
    let mut claim = Box::pin(claimer.claim(vec![id], LEASE, ClaimScope::Claimable));
    assert!(futures::poll!(&mut claim).is_pending());
    within(30, "the batch to wait for a connection", async {
        while pool.status().waiting == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    drop(claim);
    drop(busy);
    released_unwanted(&db, &hub, id).await;
}

/// The same when the requester goes away after its answer arrived but
/// before it read it: the claim committed (the test sees the issue
/// `IN_PROGRESS` through the listener, well after the answer was sent), and
/// dropping the unread answer releases it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answered_but_never_read_is_released() {
    let db = TestDb::new().await;
    let id = db.add_issues(1).await[0];
    let (hub, _listening) = db.listener().await;
    let claimer = newsnack::claims::claim::Claimer::start(db.pool.clone(), "forgetful".into(), 1);
    let mut claim = Box::pin(claimer.claim(vec![id], LEASE, ClaimScope::Claimable));
    assert!(futures::poll!(&mut claim).is_pending());
    common::until_status(&db, &hub, 30, id, "IN_PROGRESS").await;
    drop(claim);
    released_unwanted(&db, &hub, id).await;
}

/// Waits for `id` to be released as a claim nobody wanted: `FAILED` with
/// its attempt given back.
async fn released_unwanted(db: &TestDb, hub: &newsnack::events::hub::EventHub, id: i64) {
    common::until_status(db, hub, 30, id, "FAILED").await;
    let row = db
        .raw()
        .await
        .query_one(
            "SELECT last_error, attempts FROM issue WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, Option<String>>(0).as_deref(),
        Some(newsnack::claims::claim::UNWANTED_CLAIM)
    );
    assert_eq!(
        row.get::<_, i32>(1),
        0,
        "nothing was tried: no attempt spent"
    );
}
