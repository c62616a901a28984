//! The slot guard: at most one run per slot, and no bursts after a stall. Pure.
//!
//! A *slot* is a UTC wall-clock interval the schedule defines (a fixed-rate period on a grid anchored at the
//! Unix epoch, a cron occurrence, ...), identified by a monotone `i64`. Every trigger — timer, startup, a
//! manual "run now" — is admitted or dropped here:
//!
//! - a trigger for a slot already processed is **dropped** (a duplicate);
//! - a trigger for a later slot **runs once**; the slots missed in between are **merged** into it — the work a
//!   tick does ("settle everything that is due") covers them, so running each would only burst;
//! - when more than `max_catch_up` slots were missed (the process was suspended, the host overloaded, the clock
//!   jumped forward) the run is a **re-base**: still one run, reported as a stall;
//! - a trigger more than `max_catch_up` slots *behind* the last processed slot means the wall clock jumped
//!   back: the guard re-bases onto it rather than stay silent until the clock catches up. A smaller step back is
//!   a duplicate and dropped. A step the scheduler sees for what it is (see [`super::ClockWatch`]) makes it
//!   [`SlotGuard::forget`] the last slot instead, whatever the step's size.

/// What to do with a trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Run once for `slot`; `merged` missed slots are covered by this run; `rebased` marks a stall or clock jump.
    Run { slot: i64, merged: u64, rebased: bool },
    /// The slot was already processed.
    Drop,
}

/// Remembers the last processed slot.
#[derive(Debug, Clone)]
pub struct SlotGuard {
    last: Option<i64>,
    max_catch_up: u64,
}

impl SlotGuard {
    pub fn new(max_catch_up: u32) -> Self {
        SlotGuard {
            last: None,
            max_catch_up: u64::from(max_catch_up),
        }
    }

    /// The last slot admitted, if any.
    pub fn last(&self) -> Option<i64> {
        self.last
    }

    /// Forgets the last processed slot: the wall clock stepped, so slots counted on the old time say nothing
    /// about the new one. The next trigger runs.
    pub fn forget(&mut self) {
        self.last = None;
    }

    /// Decides on a trigger for `slot`. `missed(last, slot)` counts the slots strictly between the last processed
    /// slot and this one (for a fixed grid, `slot - last - 1`); it need not count past `max_catch_up + 1`.
    pub fn admit(&mut self, slot: i64, missed: impl FnOnce(i64, i64) -> u64) -> Decision {
        let Some(last) = self.last else {
            self.last = Some(slot);
            return Decision::Run {
                slot,
                merged: 0,
                rebased: false,
            };
        };
        if slot <= last {
            // i128: the distance between two arbitrary i64 slots does not fit an i64.
            let behind = (i128::from(last) - i128::from(slot)) as u128;
            if behind > u128::from(self.max_catch_up) {
                self.last = Some(slot);
                return Decision::Run {
                    slot,
                    merged: 0,
                    rebased: true,
                };
            }
            return Decision::Drop;
        }
        let merged = missed(last, slot);
        self.last = Some(slot);
        Decision::Run {
            slot,
            merged,
            rebased: merged > self.max_catch_up,
        }
    }
}

/// `missed` for a fixed grid of consecutive slots.
pub fn grid_missed(last: i64, slot: i64) -> u64 {
    (i128::from(slot) - i128::from(last) - 1).clamp(0, i128::from(u64::MAX)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn duplicates_are_dropped_and_gaps_merged() {
        let mut g = SlotGuard::new(3);
        assert_eq!(
            g.admit(10, grid_missed),
            Decision::Run {
                slot: 10,
                merged: 0,
                rebased: false
            }
        );
        assert_eq!(
            g.admit(10, grid_missed),
            Decision::Drop,
            "timer and startup in one slot"
        );
        assert_eq!(
            g.admit(11, grid_missed),
            Decision::Run {
                slot: 11,
                merged: 0,
                rebased: false
            }
        );
        assert_eq!(
            g.admit(14, grid_missed),
            Decision::Run {
                slot: 14,
                merged: 2,
                rebased: false
            }
        );
        assert_eq!(
            g.admit(19, grid_missed),
            Decision::Run {
                slot: 19,
                merged: 4,
                rebased: true
            }
        );
        assert_eq!(g.last(), Some(19));
    }

    #[test]
    fn the_clock_going_back_is_dropped_a_little_and_rebased_a_lot() {
        let mut g = SlotGuard::new(3);
        g.admit(100, grid_missed);
        assert_eq!(g.admit(98, grid_missed), Decision::Drop);
        assert_eq!(g.admit(97, grid_missed), Decision::Drop);
        assert_eq!(
            g.admit(96, grid_missed),
            Decision::Run {
                slot: 96,
                merged: 0,
                rebased: true
            }
        );
        assert_eq!(
            g.admit(97, grid_missed),
            Decision::Run {
                slot: 97,
                merged: 0,
                rebased: false
            }
        );
    }

    #[test]
    fn extreme_slots_do_not_overflow() {
        let mut g = SlotGuard::new(0);
        g.admit(i64::MIN, grid_missed);
        assert_eq!(
            g.admit(i64::MAX, grid_missed),
            Decision::Run {
                slot: i64::MAX,
                merged: u64::MAX - 1,
                rebased: true
            }
        );
        assert_eq!(
            g.admit(i64::MIN, grid_missed),
            Decision::Run {
                slot: i64::MIN,
                merged: 0,
                rebased: true
            }
        );
    }

    proptest! {
        /// For a monotone stream of triggers (with duplicates): runs are strictly increasing, never two in one
        /// slot, every slot between the first and last run is either run or merged exactly once, and every
        /// duplicate is dropped.
        #[test]
        fn monotone_triggers(steps in proptest::collection::vec((0i64..6, 1usize..4), 1..200), max in 0u32..5) {
            let mut g = SlotGuard::new(max);
            let mut slot = 1_000i64;
            let (mut runs, mut merged, mut drops, mut triggers) = (Vec::new(), 0u64, 0usize, 0usize);
            for (advance, copies) in steps {
                slot += advance;
                for _ in 0..copies {
                    triggers += 1;
                    match g.admit(slot, grid_missed) {
                        Decision::Run { slot: s, merged: m, rebased } => {
                            prop_assert_eq!(rebased, m > u64::from(max));
                            runs.push(s);
                            merged += m;
                        }
                        Decision::Drop => drops += 1,
                    }
                }
            }
            prop_assert!(runs.windows(2).all(|w| w[0] < w[1]), "runs strictly increase: {:?}", runs);
            let covered = (runs[runs.len() - 1] - runs[0] + 1) as u64;
            prop_assert_eq!(runs.len() as u64 + merged, covered);
            prop_assert_eq!(runs.len() + drops, triggers);
        }
    }
}
