//! Benchmark: what each read and write path costs at 1,000 and at
//! 1,000,000 issues. Prints one JSON object: per path the median time of
//! one call (µs) at each size and the ratio of the medians, which should
//! stay at or below 1.5 for every one.
//!
//! Each size is bulk-loaded by one `INSERT ... SELECT generate_series`: a
//! history of `DONE` issues collected over the past years, plus the same
//! live set at both sizes (recent `PENDING` issues, claims in flight with
//! live leases, and `FAILED` ones with attempts left). The load runs with
//! `session_replication_role = replica`, which skips the triggers (a new
//! issue must otherwise start `PENDING` and log its transitions); the
//! counts per status are then rebuilt from the table, as migration 27
//! seeds them, and checked against `count(*)`.
//!
//! The paths: `counts` (counts per status: `newsnack status`), `dashboard`
//! (the whole snapshot of `GET /dashboard.json`), `get_issue`
//! (`GET /issues/{id}`), `claim` (one id, a fresh `PENDING` issue each
//! time), `selection` (the pipeline's top 10 of the last day), `retry`
//! (`newsnack retry` of one `FAILED` issue), `retry_candidates` (what the
//! retry scheduler reads on start), `reaper_sweep` (one sweep of
//! expired leases) and `scale_hint` (what KEDA's PostgreSQL scaler calls,
//! `newsnack_scale_hint(4)`). For contrast, not counted in `worst_ratio`:
//! `scale_hint_by_rows`, the same answer counted row by row from `issue`
//! (the backlog), which grows with the table. `cargo bench --bench
//! flat_costs`; about a minute.

mod common;

use common::{connect, knob, round3, start_cluster};

use std::time::{Duration, Instant};

use newsnack::db::issue::{self, ClaimScope};
use newsnack::db::{self, dashboard, pipeline_run, PoolOptions, Statements};
use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};
use serde_json::{json, Map};

/// The same live issues at every size: only the history grows.
const PENDING: i64 = 400;
const IN_FLIGHT: i64 = 50;
const FAILED: i64 = 100;

#[tokio::main]
async fn main() {
    let samples = knob("FLAT_COSTS_SAMPLES", 200) as usize;
    let large = knob("FLAT_COSTS_LARGE", 1_000_000) as i64;
    let cluster = start_cluster(EmbeddedOptions {
        durable: true,
        ..EmbeddedOptions::default()
    })
    .await;
    let admin = connect(&cluster.url("postgres")).await;
    let mut sides = Vec::new();
    for size in [1_000, large] {
        sides.push(Side::load(&cluster, &admin, size).await);
    }

    // The two sizes take turns call by call, so a machine that speeds up or
    // slows down during the run weighs on both alike.
    let mut small = Map::new();
    let mut large_at = Map::new();
    let mut ratios = Map::new();
    let mut worst: f64 = 0.0;
    for path in PATHS {
        let n = match *path {
            "claim" => samples.min(PENDING as usize),
            "retry" => samples.min(FAILED as usize),
            _ => samples,
        };
        let mut times = [Vec::with_capacity(n), Vec::with_capacity(n)];
        for i in 0..n {
            for (side, times) in sides.iter_mut().zip(times.iter_mut()) {
                times.push(side.call(path, i, samples).await);
            }
        }
        let [a, b] = times.map(median);
        small.insert(path.to_string(), json!(a));
        large_at.insert(path.to_string(), json!(b));
        if !CONTRAST.contains(path) {
            worst = worst.max(b / a);
        }
        ratios.insert(path.to_string(), json!(round3(b / a)));
    }
    for side in &sides {
        side.check_counts().await;
    }
    println!(
        "{}",
        json!({
            "bench": "flat_costs",
            "samples": samples,
            "sizes": [sides[0].size, sides[1].size],
            "load_s": [round3(sides[0].load_s), round3(sides[1].load_s)],
            "median_us_small": small,
            "median_us_large": large_at,
            "ratio_large_to_small": ratios,
            "worst_ratio": round3(worst),
            "flat": worst <= 1.5,
        })
    );
    drop(sides);
    drop(cluster);
}

/// Paths shown for contrast: expected to grow, left out of `worst_ratio`.
const CONTRAST: &[&str] = &["scale_hint_by_rows"];

/// The scale hint counted row by row: what `scale_hint` is compared with.
const SCALE_HINT_BY_ROWS: &str = "SELECT greatest(1, least(
     ceil((SELECT count(*) FROM issue WHERE processing_status IN ('PENDING', 'IN_PROGRESS'))::numeric / 4),
     ceil(8::numeric / 4)))::integer";

/// The paths, reads first: each write takes an issue of its own.
const PATHS: &[&str] = &[
    "counts",
    "dashboard",
    "get_issue",
    "selection",
    "retry_candidates",
    "reaper_sweep",
    "scale_hint",
    "scale_hint_by_rows",
    "claim",
    "retry",
];

/// One database loaded with `size` issues, and what the calls need.
struct Side {
    size: i64,
    load_s: f64,
    client: deadpool_postgres::Client,
    raw: tokio_postgres::Client,
    pending: Vec<i64>,
    failed: Vec<i64>,
}

impl Side {
    async fn load(cluster: &EmbeddedPostgres, admin: &tokio_postgres::Client, size: i64) -> Side {
        let name = format!("bench_{size}");
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let url = cluster.url(&name);
        let endpoint = db::Endpoint::parse(&url, "newsnack-bench").unwrap();
        let mut migrator = endpoint.connect().await.unwrap();
        db::migrate::migrate(&mut migrator).await.unwrap();
        let pool = db::pool(
            &endpoint,
            &PoolOptions {
                max_size: 1,
                // As `serve` sends them with no pooler in front.
                statements: Statements::Named,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        let raw = connect(&url).await;
        let started = Instant::now();
        load(&raw, size).await;
        let load_s = started.elapsed().as_secs_f64();
        Side {
            size,
            load_s,
            client: pool.get().await.unwrap(),
            pending: ids(&raw, "PENDING").await,
            failed: ids(&raw, "FAILED").await,
            raw,
        }
    }

    /// One call of `path`, timed; `i` picks the issue it works on.
    async fn call(&mut self, path: &str, i: usize, samples: usize) -> Duration {
        let client = &mut self.client;
        let started = Instant::now();
        match path {
            "counts" => {
                issue::count_by_status(client).await.unwrap();
            }
            "dashboard" => {
                dashboard::snapshot(
                    client,
                    dashboard::Limits::default(),
                    time::OffsetDateTime::now_utc(),
                )
                .await
                .unwrap();
            }
            "get_issue" => {
                let id = 1 + i as i64 * (self.size / samples as i64);
                issue::get_issue(client, id).await.unwrap().unwrap();
            }
            "selection" => {
                pipeline_run::select_targets(client, 10, 24, 3, 0.0)
                    .await
                    .unwrap();
            }
            "retry_candidates" => {
                issue::failed_with_attempts_left(client, 3).await.unwrap();
            }
            "reaper_sweep" => {
                issue::reap_expired(client, 500).await.unwrap();
            }
            "scale_hint" => {
                let pods: i32 = self
                    .raw
                    .query_one("SELECT newsnack_scale_hint(4)", &[])
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(pods, 2);
            }
            "scale_hint_by_rows" => {
                let pods: i32 = self
                    .raw
                    .query_one(SCALE_HINT_BY_ROWS, &[])
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(pods, 2);
            }
            "claim" => {
                let outcome = issue::claim_issues(
                    client,
                    &[self.pending[i]],
                    "bench",
                    Duration::from_secs(600),
                    ClaimScope::Claimable,
                )
                .await
                .unwrap();
                assert_eq!(outcome.claimed.len(), 1);
            }
            "retry" => {
                let id = self.failed[i];
                assert_eq!(issue::reset_failed(client, &[id]).await.unwrap(), vec![id]);
            }
            other => unreachable!("no path {other}"),
        }
        started.elapsed()
    }

    /// The kept counts still equal `count(*)` after the writes.
    async fn check_counts(&self) {
        let drift: i64 = self
            .raw
            .query_one(
                "SELECT count(*) FROM (
                     (SELECT processing_status, count(*) FROM issue GROUP BY 1
                      EXCEPT SELECT status, sum(n) FROM issue_status_delta GROUP BY 1 HAVING sum(n) <> 0)
                     UNION ALL
                     (SELECT status, sum(n) FROM issue_status_delta GROUP BY 1 HAVING sum(n) <> 0
                      EXCEPT SELECT processing_status, count(*) FROM issue GROUP BY 1)) d",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(drift, 0, "the kept counts differ from count(*)");
    }
}

/// Replaces every issue with `size` of them: `DONE` history collected over
/// the past years, then the live set. Triggers are skipped for the load;
/// the counts are rebuilt from the table afterwards.
async fn load(client: &tokio_postgres::Client, size: i64) {
    let history = size - PENDING - IN_FLIGHT - FAILED;
    client
        .batch_execute(&format!(
            "TRUNCATE issue CASCADE;
             SET session_replication_role = replica;
             INSERT INTO issue (id, title, body, score, collected_at, processing_status, attempts,
                                claim_id, claimed_by, lease_until)
             SELECT g, 'story ' || g, 'body of story ' || g, random() * 100,
                    now() - make_interval(secs => ({size} - g) * 60 + 86400 * 3),
                    'DONE', 1, g, NULL, NULL
               FROM generate_series(1, {history}) g
             UNION ALL
             SELECT g, 'story ' || g, 'body of story ' || g, random() * 100,
                    now() - make_interval(secs => {size} - g),
                    CASE WHEN g <= {history} + {FAILED} THEN 'FAILED'
                         WHEN g <= {history} + {FAILED} + {IN_FLIGHT} THEN 'IN_PROGRESS'
                         ELSE 'PENDING' END,
                    CASE WHEN g <= {history} + {FAILED} + {IN_FLIGHT} THEN 1 ELSE 0 END,
                    CASE WHEN g <= {history} + {FAILED} + {IN_FLIGHT} THEN g END,
                    CASE WHEN g > {history} + {FAILED} AND g <= {history} + {FAILED} + {IN_FLIGHT}
                         THEN 'someone' END,
                    CASE WHEN g > {history} + {FAILED} AND g <= {history} + {FAILED} + {IN_FLIGHT}
                         THEN now() + interval '1 hour' END
               FROM generate_series({history} + 1, {size}) g;
             SET session_replication_role = DEFAULT;
             SELECT setval(pg_get_serial_sequence('issue', 'id'), {size});
             SELECT setval('issue_claim_id_seq', {size});
             TRUNCATE issue_status_delta;
             INSERT INTO issue_status_delta (status, n)
                 SELECT processing_status, count(*) FROM issue GROUP BY processing_status;"
        ))
        .await
        .unwrap();
    client.batch_execute("VACUUM ANALYZE issue").await.unwrap();
}

/// The ids of the issues in `status`, in order.
async fn ids(client: &tokio_postgres::Client, status: &str) -> Vec<i64> {
    client
        .query(
            "SELECT id FROM issue WHERE processing_status = $1 ORDER BY id",
            &[&status],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// The median of the times, in µs.
fn median(mut times: Vec<Duration>) -> f64 {
    times.sort_unstable();
    round3(times[times.len() / 2].as_secs_f64() * 1e6)
}
