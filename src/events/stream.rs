//! A gapless, resumable stream of transitions for one consumer (the tail,
//! an SSE client, the retry scheduler): history from the log, then live from the
//! listener, and back to the log whenever the consumer falls behind.
//!
//! It subscribes to the live feed *before* reading the log, so every
//! transition is either in what the log read returns or arrives live
//! afterwards; anything at or below the last delivered `seq` is dropped, so
//! nothing is delivered twice. `seq` is allocated in commit order (see
//! `sql/0002_transitions.sql`), so reading `seq > last` never skips a row
//! that commits late.
//!
//! A prune removes rows from the log's start only. A log read that finds
//! the rows right after its position gone (the log's oldest row beyond it,
//! seen in the same snapshot as the rows read) goes on from the oldest kept
//! row, with no gap after it, and says so first:
//! [`TransitionStream::next_item`] yields [`StreamItem::Pruned`] before
//! the transitions that follow. [`TransitionStream::next`] passes over it.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::broadcast;

use crate::db::{self, DbError, DbPool};
use crate::model::transition::Transition;

/// Why a stream stopped.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("the listener has stopped")]
    Closed,
}

/// What [`TransitionStream::next_item`] yields.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamItem {
    Transition(Transition),
    /// The transitions after the stream's position up to `oldest` were
    /// pruned: the stream goes on from `oldest`, the oldest kept.
    Pruned {
        oldest: i64,
    },
}

/// See the module docs.
pub struct TransitionStream {
    pool: DbPool,
    live: broadcast::Receiver<Transition>,
    last_seq: i64,
    issue_id: Option<i64>,
    backlog: VecDeque<Transition>,
    reading_log: bool,
    /// A prune found by the last log read, not yet yielded.
    pruned: Option<i64>,
}

const PAGE: i64 = 500;

impl TransitionStream {
    pub(crate) fn new(
        pool: DbPool,
        live: broadcast::Receiver<Transition>,
        after_seq: i64,
        issue_id: Option<i64>,
    ) -> Self {
        TransitionStream {
            pool,
            live,
            last_seq: after_seq,
            issue_id,
            backlog: VecDeque::new(),
            reading_log: true,
            pruned: None,
        }
    }

    /// The `seq` of the last transition delivered (or the starting point).
    pub fn last_seq(&self) -> i64 {
        self.last_seq
    }

    /// Like [`TransitionStream::next`], but rides out database outages: a
    /// failed log read is retried with capped backoff (the stream resumes
    /// where it was, so nothing is lost or repeated). Fails only when the
    /// listener has stopped. For followers that must not give up on one
    /// failed read (the retry scheduler, the tail). Cancel-safe.
    pub async fn next_through_outages(&mut self) -> Result<Transition, StreamError> {
        loop {
            if let StreamItem::Transition(t) = self.next_item_through_outages().await? {
                return Ok(t);
            }
        }
    }

    /// [`TransitionStream::next_through_outages`], telling of prunes (see
    /// [`TransitionStream::next_item`]). Cancel-safe.
    pub async fn next_item_through_outages(&mut self) -> Result<StreamItem, StreamError> {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.next_item().await {
                Err(StreamError::Db(e)) => {
                    tracing::warn!(error = %e, retry_in = ?backoff, "cannot read the transition log; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                other => return other,
            }
        }
    }

    /// A live transition, if this stream is to deliver it (after the last
    /// one delivered, and of the issue followed); it is then delivered.
    fn deliver(&mut self, t: Transition) -> Option<Transition> {
        if t.seq <= self.last_seq || self.issue_id.is_some_and(|id| id != t.issue_id) {
            return None;
        }
        self.last_seq = t.seq;
        Some(t)
    }

    /// The next transition if one is at hand (queued from the log or already
    /// published live), without waiting or touching the database. `None`
    /// says nothing of what comes next: [`TransitionStream::next`] waits.
    pub fn try_next(&mut self) -> Option<Transition> {
        loop {
            if let Some(t) = self.backlog.pop_front() {
                self.last_seq = t.seq;
                return Some(t);
            }
            if self.reading_log {
                return None;
            }
            match self.live.try_recv() {
                Ok(t) => {
                    if let Some(t) = self.deliver(t) {
                        return Some(t);
                    }
                }
                Err(broadcast::error::TryRecvError::Lagged(missed)) => {
                    tracing::debug!(missed, "stream fell behind; reading the log");
                    self.reading_log = true;
                    return None;
                }
                Err(_) => return None,
            }
        }
    }

    /// The next transition, waiting for one if need be; passes over
    /// prunes. Cancel-safe: dropping the future loses nothing.
    pub async fn next(&mut self) -> Result<Transition, StreamError> {
        loop {
            if let StreamItem::Transition(t) = self.next_item().await? {
                return Ok(t);
            }
        }
    }

    /// The next transition, or first the news that the transitions after
    /// the stream's position were pruned (then the stream goes on from the
    /// oldest kept one). Cancel-safe: dropping the future loses nothing.
    pub async fn next_item(&mut self) -> Result<StreamItem, StreamError> {
        loop {
            if let Some(oldest) = self.pruned.take() {
                return Ok(StreamItem::Pruned { oldest });
            }
            if let Some(t) = self.backlog.pop_front() {
                self.last_seq = t.seq;
                return Ok(StreamItem::Transition(t));
            }
            if self.reading_log {
                let client = self.pool.get().await.map_err(DbError::from)?;
                let page = db::transition::read_page(&**client, self.last_seq, self.issue_id, PAGE)
                    .await?;
                self.reading_log = page.transitions.len() as i64 == PAGE;
                if let Some(oldest) = page.pruned_to {
                    self.last_seq = self.last_seq.max(oldest - 1);
                    self.pruned = Some(oldest);
                }
                self.backlog.extend(page.transitions);
                continue;
            }
            match self.live.recv().await {
                Ok(t) => {
                    if let Some(t) = self.deliver(t) {
                        return Ok(StreamItem::Transition(t));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::debug!(missed, "stream fell behind; reading the log");
                    self.reading_log = true;
                }
                Err(broadcast::error::RecvError::Closed) => return Err(StreamError::Closed),
            }
        }
    }
}
