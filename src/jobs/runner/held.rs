//! How many keys a process's runs hold right now: what a stop tells apart. A replica told to stop while its
//! database is gone says it could not hand its key back only if it holds one; one that was doing anything else
//! (the compensation pass, the re-check, the status statement) holds nothing, says so and exits 0.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::Duration,
};

use tokio::time::Instant;

use crate::jobs::RunKey;

/// The keys held by the runs sharing it, counted from the moment a claim has a connection to be sent on (its
/// answer may be lost after it committed) to the end of the run (finished, handed back, or lost).
///
/// A key that may be RUNNING under this process's owner with no run of it going on — a claim whose answer was
/// lost (it may commit after the replica gave up on it), an end that could not be recorded — is counted as
/// *stranded* until its lease ends, or until this process claims it again, hands it back, or hands back all of
/// its keys.
#[derive(Debug, Default)]
pub struct HeldKeys {
    running: AtomicUsize,
    /// When the leases of stranded keys end.
    stranded: Mutex<HashMap<RunKey, Instant>>,
    /// By when every claim statement given up on has ended on the server (committed or not): its
    /// `statement_timeout`, the batch timeout, after it was sent. A hand-back before then may find nothing that
    /// the claim commits a moment later.
    unresolved_until: Mutex<Option<Instant>>,
}

impl HeldKeys {
    /// How many keys are held now: by a run, or stranded with a lease that may still be live.
    pub fn count(&self) -> usize {
        self.running.load(Ordering::SeqCst) + self.stranded_now().len()
    }

    /// How many keys are stranded now.
    pub fn stranded(&self) -> usize {
        self.stranded_now().len()
    }

    fn stranded_now(&self) -> MutexGuard<'_, HashMap<RunKey, Instant>> {
        let now = Instant::now();
        let mut stranded = self.stranded.lock().unwrap_or_else(|e| e.into_inner());
        stranded.retain(|_, until| *until > now);
        stranded
    }

    /// How many keys runs hold now (claimed, a batch possibly in flight), stranded keys aside.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Counts one more key until the returned guard is dropped.
    pub(super) fn hold(self: &Arc<Self>) -> Holding {
        self.running.fetch_add(1, Ordering::SeqCst);
        Holding(self.clone())
    }

    /// Counts `key`, maybe left RUNNING under this process's owner, for `lease` from now.
    pub(super) fn strand(&self, key: RunKey, lease: Duration) {
        self.stranded_now().insert(key, Instant::now() + lease);
    }

    /// Notes that a claim statement given up on ends on the server by `until` at the latest.
    pub(super) fn unresolved_until(&self, until: Instant) {
        let mut latest = self.unresolved_until.lock().unwrap_or_else(|e| e.into_inner());
        *latest = Some(latest.map_or(until, |t| t.max(until)));
    }

    /// By when every claim statement given up on has ended on the server, if one may not have.
    pub fn claims_end_by(&self) -> Option<Instant> {
        let latest = *self.unresolved_until.lock().unwrap_or_else(|e| e.into_inner());
        latest.filter(|t| *t > Instant::now())
    }

    /// `key` is this process's own again (claimed) or handed back: not stranded.
    pub(super) fn recovered(&self, key: &RunKey) {
        self.stranded_now().remove(key);
    }

    /// Every key of this process was handed back.
    pub fn all_recovered(&self) {
        self.stranded_now().clear();
    }
}

/// One key counted in [`HeldKeys`] while it lives.
#[derive(Debug)]
pub(super) struct Holding(Arc<HeldKeys>);

impl Drop for Holding {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_counted_while_its_guard_lives() {
        let held = Arc::new(HeldKeys::default());
        let first = held.hold();
        let second = held.hold();
        assert_eq!(held.count(), 2);
        drop(first);
        assert_eq!(held.count(), 1);
        drop(second);
        assert_eq!(held.count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stranded_key_is_counted_until_its_lease_ends_or_it_is_recovered() {
        let key = |day: u32| RunKey {
            job: crate::jobs::JobName::FineSettlement,
            business_date: chrono::NaiveDate::from_ymd_opt(2026, 10, day).expect("date"),
            shard: crate::shard::ShardSpec::new(0, 1).expect("shard"),
        };
        let held = Arc::new(HeldKeys::default());
        held.strand(key(31), Duration::from_secs(3));
        held.strand(key(30), Duration::from_secs(60));
        assert_eq!((held.count(), held.stranded()), (2, 2));
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(held.count(), 1, "the first lease ended");
        held.recovered(&key(30));
        assert_eq!(held.count(), 0, "claimed again");
        held.strand(key(30), Duration::from_secs(60));
        held.all_recovered();
        assert_eq!(held.count(), 0, "every key handed back");
    }
}
