//! The settlement's walk on Citus, one Citus shard at a time (docs/citus.md, "Settlement: one Citus shard at a
//! time").
//!
//! A batch whose loans lie in one Citus shard is written by one statement that the coordinator sends whole to
//! that shard's worker: one worker does the batch's work, and its commit involves that worker alone beside the
//! coordinator's fence. A batch cut from the shard's next loans by id instead falls in every Citus shard (ids
//! are spread over the shards by their hash): one statement per Citus shard, each for a few rows, and on every
//! worker. And listing the next loans by id costs on Citus about what listing many times more costs, since
//! each shard returns up to `limit` of its own and the coordinator keeps `limit` of them all (measured on
//! 1,000,000 loans, 32 shards: 298 ms for 10,000 ids, 424 ms for 320,000).
//!
//! So a walk lists a *window* once — the fine-settler shard's next unsettled loans of the month by id, as many as
//! `limit` for each Citus shard — groups it by Citus shard, and hands out the groups as batches of up to `limit`
//! loans each. The cursor a batch leaves must still mean that every loan below it is done, whatever a takeover
//! makes of it: each batch of a window but its last leaves it just below the window's first loan, and the
//! window's last batch at the window's last loan. A run taken over mid-window starts that window again; its
//! settled loans are passed over by the write's conditions (`fine_settled_at is null`).

use std::collections::VecDeque;
use std::sync::Mutex;

use chrono::NaiveDate;

use crate::jobs::RunKey;
use crate::store::{
    citus,
    loans::{self, SettleBatch},
    Db,
};

/// The most loans a window lists (8 bytes each in memory): with many Citus shards and big batches, a window
/// stops here and the next one starts where it ends.
const MOST_IN_A_WINDOW: i64 = 1_000_000;

/// The loans of one window still to hand out, grouped by Citus shard.
#[derive(Debug)]
struct Window {
    key: RunKey,
    /// The window's loans are the unsettled ones with `id >= from_id` up to `last`; its first is `first`.
    from_id: i64,
    first: i64,
    last: i64,
    groups: VecDeque<Vec<i64>>,
}

impl Window {
    /// Whether the walk of `key` at `from_id` is still in this window: at its start, or where a batch of it
    /// left the cursor (just below its first loan).
    fn continues(&self, key: &RunKey, from_id: i64) -> bool {
        self.key == *key && self.from_id <= from_id && from_id <= self.first.saturating_add(1)
    }

    /// The next batch: up to `limit` loans of the front group.
    fn take(&mut self, from_id: i64, limit: usize) -> Option<SettleBatch> {
        let front = self.groups.front_mut()?;
        let listed = if front.len() > limit {
            let rest = front.split_off(limit);
            std::mem::replace(front, rest)
        } else {
            self.groups.pop_front()?
        };
        let last_id = if self.groups.is_empty() {
            self.last
        } else {
            self.first.saturating_sub(1)
        };
        Some(SettleBatch {
            from_id,
            last_id,
            count: listed.len() as i64,
            listed,
        })
    }
}

/// The settlement's walk on Citus: the window being handed out, kept between the batches of a run.
#[derive(Debug, Default)]
pub(super) struct ShardWalk {
    window: Mutex<Option<Window>>,
}

impl ShardWalk {
    pub(super) const fn new() -> Self {
        ShardWalk {
            window: Mutex::new(None),
        }
    }

    /// The next batch of `key`'s walk at `from_id`: from the window when the walk is still in it, else from a
    /// new window listed at `from_id`; `None` when no loan is left.
    pub(super) async fn next(
        &self,
        pool: &Db,
        key: &RunKey,
        month: (NaiveDate, NaiveDate),
        from_id: i64,
        limit: i64,
    ) -> Result<Option<SettleBatch>, sqlx::Error> {
        let size = usize::try_from(limit.max(1)).unwrap_or(usize::MAX);
        if let Some(batch) = self.take(key, from_id, size) {
            return Ok(Some(batch));
        }
        let shards = citus::loan_shards(pool).await?.max(1);
        let most = limit.max(1).saturating_mul(shards).min(MOST_IN_A_WINDOW);
        let Some(listed) = loans::next_listed(pool, month, key.shard, from_id, most).await? else {
            *self.lock() = None;
            return Ok(None);
        };
        let groups = citus::by_shard(pool, &listed.listed).await?;
        let mut window = Window {
            key: *key,
            from_id,
            first: listed.listed[0],
            last: listed.last_id,
            groups: groups.into(),
        };
        let batch = window.take(from_id, size);
        *self.lock() = Some(window);
        Ok(batch)
    }

    fn take(&self, key: &RunKey, from_id: i64, limit: usize) -> Option<SettleBatch> {
        let mut window = self.lock();
        match window.as_mut() {
            Some(w) if w.continues(key, from_id) => w.take(from_id, limit),
            _ => None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Window>> {
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{jobs::JobName, shard::ShardSpec};

    fn key() -> RunKey {
        RunKey {
            job: JobName::FineSettlement,
            business_date: NaiveDate::from_ymd_opt(2026, 10, 31).expect("a date"),
            shard: ShardSpec::new(0, 1).expect("a shard"),
        }
    }

    fn window(from_id: i64, groups: &[&[i64]]) -> Window {
        let all: Vec<i64> = groups.iter().flat_map(|g| g.iter().copied()).collect();
        Window {
            key: key(),
            from_id,
            first: *all.iter().min().expect("loans"),
            last: *all.iter().max().expect("loans"),
            groups: groups.iter().map(|g| g.to_vec()).collect(),
        }
    }

    #[test]
    fn a_window_hands_out_its_groups_in_batches_and_moves_the_cursor_only_at_its_last() {
        let mut w = window(5, &[&[10, 13, 16, 19, 22], &[11, 14], &[12, 20]]);
        let cursors: Vec<(Vec<i64>, i64)> = std::iter::from_fn(|| w.take(10, 2))
            .map(|b| (b.listed, b.last_id))
            .collect();
        assert_eq!(
            cursors,
            [
                (vec![10, 13], 9),
                (vec![16, 19], 9),
                (vec![22], 9),
                (vec![11, 14], 9),
                (vec![12, 20], 22),
            ]
        );
    }

    #[test]
    fn a_walk_continues_a_window_only_for_its_key_between_its_start_and_its_first_loan() {
        let w = window(5, &[&[10, 13], &[11]]);
        assert!(w.continues(&key(), 5));
        assert!(w.continues(&key(), 10));
        assert!(!w.continues(&key(), 4));
        assert!(!w.continues(&key(), 14));
        let other = RunKey {
            shard: ShardSpec::new(1, 2).expect("a shard"),
            ..key()
        };
        assert!(!w.continues(&other, 5));
    }

    #[test]
    fn the_lowest_id_keeps_a_cursor_that_does_not_overflow() {
        let mut w = window(i64::MIN, &[&[i64::MIN, 7], &[3]]);
        let first = w.take(i64::MIN, 10).expect("a batch");
        assert_eq!(first.last_id, i64::MIN);
        assert!(w.continues(&key(), i64::MIN + 1));
        assert_eq!(w.take(i64::MIN + 1, 10).expect("a batch").last_id, 7);
        assert!(w.take(8, 10).is_none());
    }
}
