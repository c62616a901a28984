//! How many keys a process's runs hold right now: what a stop tells apart. A replica told to stop while its
//! database is gone says it could not hand its key back only if it holds one; one that was doing anything else
//! (the compensation pass, the re-check, the status statement) holds nothing, says so and exits 0.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::time::Instant;

/// The keys held by the runs sharing it, counted from the moment a claim has a connection to be sent on (its
/// answer may be lost after it committed) to the end of the run (finished, handed back, or lost).
///
/// A key whose claim or end could not be recorded for want of a server (the claim's answer lost, its hand-back
/// refused) stays RUNNING under this process's owner until its lease ends: it is counted as *stranded* until then.
#[derive(Debug, Default)]
pub struct HeldKeys {
    running: AtomicUsize,
    /// When the leases of stranded keys end.
    stranded: Mutex<Vec<Instant>>,
}

impl HeldKeys {
    /// How many keys are held now: by a run, or stranded with a lease that may still be live.
    pub fn count(&self) -> usize {
        let now = Instant::now();
        let mut stranded = self.stranded.lock().unwrap_or_else(|e| e.into_inner());
        stranded.retain(|until| *until > now);
        self.running.load(Ordering::SeqCst) + stranded.len()
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

    /// Counts a key left RUNNING under this process's owner for `lease` from now.
    pub(super) fn strand(&self, lease: Duration) {
        let mut stranded = self.stranded.lock().unwrap_or_else(|e| e.into_inner());
        stranded.push(Instant::now() + lease);
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
    async fn a_stranded_key_is_counted_until_its_lease_ends() {
        let held = Arc::new(HeldKeys::default());
        held.strand(Duration::from_secs(3));
        assert_eq!(held.count(), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(held.count(), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(held.count(), 0);
    }
}
