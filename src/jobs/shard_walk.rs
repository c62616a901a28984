//! The settlement's walk on Citus, one Citus shard at a time (docs/citus.md, "Batches of one Citus shard").
//! (The accrual does not walk so: its batch's fixed cost — its locks, its several statements, its fence — paid
//! once per Citus shard made a day of 5,110 loans take 12–18 s against 1.5 s in batches by id.)
//!
//! A batch's part whose loans lie in one Citus shard is written by statements that the coordinator sends whole
//! to that shard's worker: one worker does the part's work, and its commit involves that worker alone beside
//! the coordinator's fence. A batch cut from the shard's next loans by id instead falls in every Citus shard (ids
//! are spread over the shards by their hash): each of its statements reaches every shard, or one statement per
//! shard for a few rows each, and every worker. And listing the next loans by id costs on Citus about what
//! listing many times more costs, since each shard returns up to `limit` of its own and the coordinator keeps
//! `limit` of them all (measured on 1,000,000 loans, 32 shards: 298 ms for 10,000 ids, 424 ms for 320,000).
//!
//! So a walk lists a *window* once — the fine-settler shard's next unsettled loans of the month by id, as many as `limit` for
//! each Citus shard — groups it by Citus shard, and hands out the groups as batches of up to `limit` loans each.
//! A batch takes a part of one group of each node (worker) the window still has loans on, `limit` in all: the
//! runner writes its first part in the batch's transaction and the others beside it, each on a connection of
//! its own (`jobs/runner/beside.rs`), so that every worker settles at once (one worker at a time, a single
//! replica had settled at 0.55× the rate of one distributed `update`: bench/RESULTS.md, "Citus").
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
use crate::store::{
    citus::{self, ShardGroup},
    Db,
};

/// The most loans a window lists (8 bytes each in memory): with many Citus shards and big batches, a window
/// stops here and the next one starts where it ends.
const MOST_IN_A_WINDOW: i64 = 1_000_000;

/// The loans of one window not yet written, grouped by Citus shard (each group with its shard's node).
#[derive(Debug)]
struct Window {
    /// The window's loans are those with work and `id >= from_id` up to `last`; its first is `first`.
    from_id: i64,
    first: i64,
    last: i64,
    groups: VecDeque<ShardGroup>,
}

impl Window {
    /// Whether the walk at `from_id` is still in this window: at its start, or where a batch of it left the
    /// cursor (just below its first loan).
    fn continues(&self, from_id: i64) -> bool {
        self.from_id <= from_id && from_id <= self.first.saturating_add(1)
    }

    /// The next batch, left in the window until [`Window::done`]: a part of the front group and one of the
    /// first group of each other node, `limit` loans in all at most (at least one a part).
    fn peek(&self, limit: usize) -> Option<Walked> {
        let front = self.groups.front()?;
        let mut picked = vec![front];
        for group in self.groups.iter().skip(1) {
            if !picked.iter().any(|p| p.node == group.node) {
                picked.push(group);
            }
        }
        picked.truncate(limit.max(1));
        let each = (limit / picked.len()).max(1);
        let parts: Vec<Vec<i64>> = picked
            .iter()
            .map(|g| g.ids[..g.ids.len().min(each)].to_vec())
            .collect();
        let taken: usize = parts.iter().map(Vec::len).sum();
        let left: usize = self.groups.iter().map(|g| g.ids.len()).sum();
        let cursor = if taken == left {
            self.last
        } else {
            self.first.saturating_sub(1)
        };
        Some(Walked { parts, cursor })
    }

    /// `parts` are written: each leaves the group it was cut from (the first group it begins). A part not
    /// found so (never seen) lets the whole window go: the walk lists anew from its cursor, which no batch of
    /// this window moved past a loan not written.
    fn done(&mut self, parts: &[Vec<i64>]) {
        let found: Option<Vec<usize>> = parts
            .iter()
            .map(|part| {
                self.groups
                    .iter()
                    .position(|g| !part.is_empty() && g.ids.starts_with(part))
            })
            .collect();
        let Some(found) = found else {
            tracing::error!("a committed batch is not the window's; the window is listed again");
            self.groups.clear();
            return;
        };
        for (part, at) in parts.iter().zip(found) {
            self.groups[at].ids.drain(..part.len());
        }
        self.groups.retain(|g| !g.ids.is_empty());
    }
}

/// One batch of a walk: its parts (each ascending, in one Citus shard; no two on the same node, so that
/// they can be written at the same time), and the cursor it leaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walked {
    pub parts: Vec<Vec<i64>>,
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
        let groups = citus::by_shard_on_nodes(pool, &listed).await?;
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

    /// `key`'s batch of `parts` committed: its loans leave the window (the window itself, after its last).
    pub fn committed(&self, key: &RunKey, parts: &[Vec<i64>]) {
        let mut windows = self.lock();
        let Some(window) = windows.get_mut(key) else {
            return;
        };
        window.done(parts);
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

    /// A window whose groups all lie on one node.
    fn window(from_id: i64, groups: &[&[i64]]) -> Window {
        let on: Vec<(i32, &[i64])> = groups.iter().map(|g| (1, *g)).collect();
        window_on(from_id, &on)
    }

    fn window_on(from_id: i64, groups: &[(i32, &[i64])]) -> Window {
        let all: Vec<i64> = groups.iter().flat_map(|(_, g)| g.iter().copied()).collect();
        Window {
            from_id,
            first: *all.iter().min().expect("loans"),
            last: *all.iter().max().expect("loans"),
            groups: groups
                .iter()
                .map(|(node, ids)| ShardGroup {
                    node: *node,
                    ids: ids.to_vec(),
                })
                .collect(),
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
            walk.committed(&key(0, 1), &b.parts);
            assert_eq!(b.parts.len(), 1, "one node, one part");
            batches.push((b.parts[0].clone(), b.cursor));
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
        walk.committed(&key(0, 1), &first.parts);
        assert_eq!(walk.peek(&key(0, 1), 10, 1).expect("a batch").parts, [vec![11]]);
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
        walk.committed(&key(0, 1), &first.parts);
        let next = walk.peek(&key(0, 1), i64::MIN + 1, 10).expect("a batch");
        assert_eq!(next.cursor, 7);
        walk.committed(&key(0, 1), &next.parts);
        assert!(walk.peek(&key(0, 1), 8, 10).is_none());
    }

    #[test]
    fn a_batch_takes_a_part_on_each_node_and_the_last_batch_of_the_window_moves_the_cursor() {
        let walk = walk_with(
            key(0, 1),
            window_on(
                5,
                &[(1, &[10, 14, 18, 22]), (2, &[11, 15]), (1, &[12, 16]), (2, &[13])],
            ),
        );
        let mut batches = Vec::new();
        while let Some(b) = walk.peek(&key(0, 1), 10, 4) {
            walk.committed(&key(0, 1), &b.parts);
            batches.push((b.parts, b.cursor));
        }
        assert_eq!(
            batches,
            [
                (vec![vec![10, 14], vec![11, 15]], 9),
                (vec![vec![18, 22], vec![13]], 9),
                (vec![vec![12, 16]], 22),
            ]
        );
    }

    #[test]
    fn a_batch_whose_parts_are_not_all_in_the_window_lets_it_go() {
        let walk = walk_with(key(0, 1), window_on(5, &[(1, &[10, 12]), (2, &[11])]));
        walk.committed(&key(0, 1), &[vec![10], vec![99]]);
        assert!(walk.peek(&key(0, 1), 10, 4).is_none(), "listed again");
    }

    #[test]
    fn a_batch_smaller_than_the_nodes_takes_one_loan_of_as_many_nodes_as_it_may() {
        let walk = walk_with(key(0, 1), window_on(5, &[(1, &[10, 13]), (2, &[11]), (3, &[12])]));
        let b = walk.peek(&key(0, 1), 10, 2).expect("a batch");
        assert_eq!(b.parts, [vec![10], vec![11]]);
        let b = walk.peek(&key(0, 1), 10, 1).expect("a batch");
        assert_eq!(b.parts, [vec![10]]);
    }
}
