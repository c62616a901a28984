//! How many keys a process's runs hold right now: what a stop tells apart. A replica told to stop while its
//! database is gone says it could not hand its key back only if it holds one; one that was doing anything else
//! (the compensation pass, the re-check, the status statement) holds nothing, says so and exits 0.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

/// The keys held by the runs sharing it, counted from the moment a claim has a connection to be sent on (its
/// answer may be lost after it committed) to the end of the run (finished, handed back, or lost).
#[derive(Debug, Default)]
pub struct HeldKeys(AtomicUsize);

impl HeldKeys {
    /// How many keys are held now.
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// Counts one more key until the returned guard is dropped.
    pub(super) fn hold(self: &Arc<Self>) -> Holding {
        self.0.fetch_add(1, Ordering::SeqCst);
        Holding(self.clone())
    }
}

/// One key counted in [`HeldKeys`] while it lives.
#[derive(Debug)]
pub(super) struct Holding(Arc<HeldKeys>);

impl Drop for Holding {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::SeqCst);
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
}
