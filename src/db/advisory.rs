//! Advisory lock keys, in one place, so `newsnack locks` can name what it
//! sees in `pg_locks` and no two concerns share a key by accident.

/// Serialises `issue_transition.seq` allocation with commit order; taken by
/// the transition trigger (`sql/0002_transitions.sql`), held to commit.
pub const TRANSITION_LOG: i64 = 7_236_284_560_371_893_001;
/// Held while migrations run, so concurrent start-ups apply them once.
pub const MIGRATIONS: i64 = 7_236_284_560_371_893_002;
/// Held by the one instance running the lease reaper.
pub const LEASE_REAPER: i64 = 7_236_284_560_371_893_003;
/// Held by the one instance running a pipeline tick.
pub const PIPELINE: i64 = 7_236_284_560_371_893_004;

/// A readable name for a key, for listings.
pub fn name_of(key: i64) -> &'static str {
    match key {
        TRANSITION_LOG => "transition-log",
        MIGRATIONS => "migrations",
        LEASE_REAPER => "lease-reaper",
        PIPELINE => "pipeline",
        _ => "other",
    }
}
