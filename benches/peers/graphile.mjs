// The graphile-worker side of benches/peers.rs: one round of the shared
// workload on the database at DATABASE_URL, printed as one JSON line.
//
// The schema is migrated first (not timed). Then N no-op jobs are added in
// one SQL statement (`graphile_worker.add_jobs`, timed as the enqueue), and
// a worker runs them with the given concurrency. Processing is timed from
// the first `job:start` event (and, for reference, from the `run()` call) to
// the moment the queue reads empty after the N-th `job:complete` event, so
// every completion is committed, not only reported. Then the worker stops.
//
// Environment: GRAPHILE_WORKER_DIR (where `npm install` put graphile-worker),
// DATABASE_URL, PEERS_ITEMS, PEERS_CONCURRENCY, PEERS_BATCHED ("1": the
// documented batching options, a local queue of concurrency + 1 jobs and
// completions batched with a 0 ms delay; otherwise the defaults).

import { createRequire } from "node:module";
import { EventEmitter } from "node:events";

const require = createRequire(process.env.GRAPHILE_WORKER_DIR + "/");
const { run, runMigrations, Logger } = require("graphile-worker");
const { version } = require("graphile-worker/package.json");
const pg = require("pg");

const connectionString = process.env.DATABASE_URL;
const items = Number(process.env.PEERS_ITEMS);
const concurrency = Number(process.env.PEERS_CONCURRENCY);
const batched = process.env.PEERS_BATCHED === "1";

// Warnings and errors only: a log line per job would be the cost measured.
const logger = new Logger(() => (level, message) => {
  if (level === "error" || level === "warning") console.error(message);
});
// The pool size its documentation recommends: concurrency + 2 (or 10).
const maxPoolSize = Math.max(10, concurrency + 2);

await runMigrations({ connectionString, logger });

const sql = new pg.Client({ connectionString });
await sql.connect();
const enqueueStarted = performance.now();
await sql.query(
  `SELECT count(*) FROM graphile_worker.add_jobs(ARRAY(
     SELECT ROW('noop', '{}'::json, NULL, NULL, NULL, NULL, NULL, NULL)::graphile_worker.job_spec
       FROM generate_series(1, $1::int)))`,
  [items],
);
const enqueueMs = performance.now() - enqueueStarted;

const queued = async () =>
  Number((await sql.query("SELECT count(*) FROM graphile_worker._private_jobs")).rows[0].count);
if ((await queued()) !== items) throw new Error(`expected ${items} queued jobs`);

const events = new EventEmitter();
let firstStart = null;
let completed = 0;
let failed = 0;
let lastComplete = null;
let allComplete;
const allCompleted = new Promise((resolve) => (allComplete = resolve));
events.on("job:start", () => {
  firstStart ??= performance.now();
});
events.on("job:complete", ({ error }) => {
  if (error) failed += 1;
  completed += 1;
  if (completed === items) {
    lastComplete = performance.now();
    allComplete();
  }
});

const runCalled = performance.now();
const runner = await run({
  connectionString,
  concurrency,
  maxPoolSize,
  logger,
  events,
  noHandleSignals: true,
  taskList: { noop: async () => {} },
  preset: batched
    ? { worker: { localQueue: { size: concurrency + 1 }, completeJobBatchDelay: 0 } }
    : {},
});
await allCompleted;
// `job:complete` fires before the job's row is deleted; the queue is empty
// once the last deletion is committed, a few milliseconds at most later.
let left = await queued();
while (left > 0) {
  await new Promise((resolve) => setTimeout(resolve, 1));
  left = await queued();
}
const queueEmpty = performance.now();
await runner.stop();
await sql.end();

const seconds = (ms) => Math.round(ms) / 1000;
console.log(
  JSON.stringify({
    version,
    batched,
    items,
    concurrency,
    max_pool_size: maxPoolSize,
    enqueue_seconds: seconds(enqueueMs),
    seconds: seconds(queueEmpty - firstStart),
    items_per_s: Math.round((10 * items * 1000) / (queueEmpty - firstStart)) / 10,
    seconds_from_run_call: seconds(queueEmpty - runCalled),
    last_complete_event_to_queue_empty_ms: Math.round(queueEmpty - lastComplete),
    jobs_completed: completed,
    jobs_failed: failed,
    jobs_left: left,
  }),
);
