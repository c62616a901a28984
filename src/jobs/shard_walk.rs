//! The settlement's walk on Citus, one Citus shard at a time (docs/citus.md, "Batches of one Citus shard").
//! (The accrual does not walk so: its batch's fixed cost — its locks, its several statements, its fence — paid
//! once per Citus shard made a day of 5,110 loans take 12–18 s against 1.5 s in batches by id.)
//!
//! A batch whose loans lie in one Citus shard is written by statements that the coordinator sends whole to
//! that shard's worker: one worker does the batch's work, and its commit involves that worker alone beside the
//! coordinator's fence. A batch cut from the shard's next loans by id instead falls in every Citus shard (ids
//! are spread over the shards by their hash): each of its statements reaches every shard, or one statement per
//! shard for a few rows each, and every worker. And listing the next loans by id costs on Citus about what
//! listing many times more costs, since each shard returns up to `limit` of its own and the coordinator keeps
//! `limit` of them all (measured on 1,000,000 loans, 32 shards: 298 ms for 10,000 ids, 424 ms for 320,000).
//!
//! So a walk lists a *window* once — the fine-settler shard's next unsettled loans of the month by id, as many as `limit` for
//! each Citus shard — groups it by Citus shard, and hands out the groups as batches of up to `limit` loans each.
//! The cursor a batch leaves must still mean that every loan below it is done, whatever a takeover makes of it:
//! each batch of a window but its last leaves it just below the window's first loan, and the window's last
//! batch at the window's last loan. A run taken over mid-window starts that window again; the loans its batches
//! did are passed over by the writes' own conditions (a settled loan, a charged day).
//!
//! A batch leaves the window only once it committed ([`ShardWalk::committed`], which the runner calls after
//! the fence passed), and each run starts without one ([`ShardWalk::start`], at the run's start): a window is
//! one run's. Each key has a window of its own, so a backfill's concurrent runs (one job value, several keys)
//! do not take each other's. However long a run waits between batches (the throttle), its window stays.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use std::future::Future;

use crate::jobs::RunKey;
use crate::store::{citus, Db};

/// The most loans a window lists (8 bytes each in memory): with many Citus shards and big batches, a window
/// stops here and the next one starts where it ends.
const MOST_IN_A_WINDOW: i64 = 1_000_000;

/// The loans of one window not yet written, grouped by Citus shard.
#[derive(Debug)]
struct Window {
    /// The window's loans are those with work and `id >= from_id` up to `last`; its first is `first`.
    from_id: i64,
    first: i64,
    last: i64,
    groups: VecDeque<Vec<i64>>,
}

impl Window {
    /// Whether the walk at `from_id` is still in this window: at its start, or where a batch of it left the
    /// cursor (just below its first loan).
    fn continues(&self, from_id: i64) -> bool {
        self.from_id <= from_id && from_id <= self.first.saturating_add(1)
    }

    /// The next batch: up to `limit` loans of the front group, left in the window until [`Window::done`].
    fn peek(&self, limit: usize) -> Option<Walked> {
        let front = self.groups.front()?;
        let loans = front[..front.len().min(limit)].to_vec();
        let last_of_window = self.groups.len() == 1 && loans.len() == front.len();
        let cursor = if last_of_window {
            self.last
        } else {
            self.first.saturating_sub(1)
        };
        Some(Walked { loans, cursor })
    }

    /// The front group's first `count` loans are written.
    fn done(&mut self, count: usize) {
        if let Some(front) = self.groups.front_mut() {
            front.drain(..count.min(front.len()));
            if front.is_empty() {
                self.groups.pop_front();
            }
        }
    }
}

/// One batch of a walk: its loans (ascending, all in one Citus shard), and the cursor it leaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walked {
    pub loans: Vec<i64>,
    pub cursor: i64,
}

/// A job's walk on Citus: the window being handed out, kept between the batches of a run. A copy of a job
/// starts a walk of its own.
#[derive(Debug, Default)]
pub struct ShardWalk {
    windows: Mutex<HashMap<RunKey, Window>>,
}

impl Clone for ShardWalk {
    fn clone(&self) -> Self {
        ShardWalk::new()
    }
}

impl ShardWalk {
    pub fn new() -> Self {
        ShardWalk {
            windows: Mutex::new(HashMap::new()),
        }
    }

    /// The next batch of `key`'s walk at `from_id`: from the window when the walk is still in it, else from a
    /// new window, which `list(most)` lists — the loans with work and `id >= from_id`, ascending, at most `most`;
    /// `None` when no loan is left.
    pub async fn next<F, Fut>(
        &self,
        pool: &Db,
        key: &RunKey,
        from_id: i64,
        limit: i64,
        list: F,
    ) -> Result<Option<Walked>, sqlx::Error>
    where
        F: FnOnce(i64) -> Fut,
        Fut: Future<Output = Result<Vec<i64>, sqlx::Error>>,
    {
        let size = usize::try_from(limit.max(1)).unwrap_or(usize::MAX);
        if let Some(batch) = self.peek(key, from_id, size) {
            return Ok(Some(batch));
        }
        let shards = citus::loan_shards(pool).await?.max(1);
        let listed = list(limit.max(1).saturating_mul(shards).min(MOST_IN_A_WINDOW)).await?;
        let (Some(&first), Some(&last)) = (listed.first(), listed.last()) else {
            self.lock().remove(key);
            return Ok(None);
        };
        let groups = citus::by_shard(pool, &listed).await?;
        let window = Window {
            from_id,
            first,
            last,
            groups: groups.into(),
        };
        let batch = window.peek(size);
        self.lock().insert(*key, window);
        Ok(batch)
    }

    /// A run of `key` starts: whatever an earlier run of it listed is let go.
    pub fn start(&self, key: &RunKey) {
        self.lock().remove(key);
    }

    /// `key`'s batch `batch` committed: its loans leave the window (the window itself, after its last).
    pub fn committed(&self, key: &RunKey, batch: &[i64]) {
        let mut windows = self.lock();
        let Some(window) = windows.get_mut(key) else {
            return;
        };
        if window
            .groups
            .front()
            .is_some_and(|front| front.starts_with(batch))
        {
            window.done(batch.len());
        }
        if window.groups.is_empty() {
            windows.remove(key);
        }
    }

    fn peek(&self, key: &RunKey, from_id: i64, limit: usize) -> Option<Walked> {
        let windows = self.lock();
        windows
            .get(key)
            .filter(|w| w.continues(from_id))
            .and_then(|w| w.peek(limit))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RunKey, Window>> {
        self.windows.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{jobs::JobName, shard::ShardSpec};
    use chrono::NaiveDate;

    fn key(shard: i64, shards: i64) -> RunKey {
        RunKey {
            job: JobName::FineSettlement,
            business_date: NaiveDate::from_ymd_opt(2026, 10, 31).expect("a date"),
            shard: ShardSpec::new(shard, shards).expect("a shard"),
        }
    }

    fn window(from_id: i64, groups: &[&[i64]]) -> Window {
        let all: Vec<i64> = groups.iter().flat_map(|g| g.iter().copied()).collect();
        Window {
            from_id,
            first: *all.iter().min().expect("loans"),
            last: *all.iter().max().expect("loans"),
            groups: groups.iter().map(|g| g.to_vec()).collect(),
        }
    }

    fn walk_with(k: RunKey, w: Window) -> ShardWalk {
        let walk = ShardWalk::new();
        walk.lock().insert(k, w);
        walk
    }

    #[test]
    fn a_window_hands_out_its_groups_in_batches_and_moves_the_cursor_only_at_its_last() {
        let walk = walk_with(
            key(0, 1),
            window(5, &[&[10, 13, 16, 19, 22], &[11, 14], &[12, 20]]),
        );
        let mut batches = Vec::new();
        while let Some(b) = walk.peek(&key(0, 1), 10, 2) {
            walk.committed(&key(0, 1), &b.loans);
            batches.push((b.loans, b.cursor));
        }
        assert_eq!(
            batches,
            [
                (vec![10, 13], 9),
                (vec![16, 19], 9),
                (vec![22], 9),
                (vec![11, 14], 9),
                (vec![12, 20], 22),
            ]
        );
        assert!(walk.lock().is_empty(), "a walked window is let go");
    }

    #[test]
    fn a_batch_that_did_not_commit_is_handed_out_again() {
        let walk = walk_with(key(0, 1), window(5, &[&[10, 13], &[11]]));
        let first = walk.peek(&key(0, 1), 10, 10).expect("a batch");
        assert_eq!(walk.peek(&key(0, 1), 10, 10), Some(first.clone()));
        walk.committed(&key(0, 1), &first.loans);
        assert_eq!(walk.peek(&key(0, 1), 10, 1).expect("a batch").loans, [11]);
    }

    #[test]
    fn a_walk_continues_a_window_only_for_its_key_between_its_start_and_its_first_loan() {
        let walk = walk_with(key(0, 1), window(5, &[&[10, 13], &[11]]));
        assert!(walk.peek(&key(0, 1), 5, 10).is_some());
        assert!(walk.peek(&key(0, 1), 10, 10).is_some());
        assert!(walk.peek(&key(0, 1), 4, 10).is_none());
        assert!(walk.peek(&key(0, 1), 14, 10).is_none());
        assert!(walk.peek(&key(1, 2), 5, 10).is_none());
        walk.start(&key(1, 2));
        assert!(
            walk.peek(&key(0, 1), 5, 10).is_some(),
            "another key's run leaves it"
        );
        walk.start(&key(0, 1));
        assert!(
            walk.peek(&key(0, 1), 5, 10).is_none(),
            "its key's next run starts afresh"
        );
    }

    #[test]
    fn the_lowest_id_keeps_a_cursor_that_does_not_overflow() {
        let walk = walk_with(key(0, 1), window(i64::MIN, &[&[i64::MIN, 7], &[3]]));
        let first = walk.peek(&key(0, 1), i64::MIN, 10).expect("a batch");
        assert_eq!(first.cursor, i64::MIN);
        walk.committed(&key(0, 1), &first.loans);
        let next = walk.peek(&key(0, 1), i64::MIN + 1, 10).expect("a batch");
        assert_eq!(next.cursor, 7);
        walk.committed(&key(0, 1), &next.loans);
        assert!(walk.peek(&key(0, 1), 8, 10).is_none());
    }
}
