//! One read at a time for the status page, shared by every page load that arrives while it runs, and a bound on
//! how many loads may wait for it.
//!
//! A page load joins the read in flight or, when none is, starts one; either way it gets that read's answer.
//! So however many loads arrive, the page runs one read at a time (one connection of its pool, one reconnect
//! after a failure), and a flood of loads costs the database no more than one. The read runs as a task of its
//! own: it ends — its connection goes back to the pool whole — even if every load that waited for it went away.
//!
//! Each load that waits holds one of the HTTP listener's places, so at most `max_waiting` may wait at once; the
//! next one is told at once that the page is busy, which leaves the other places to the probes.

use std::{
    future::Future,
    sync::{Arc, Mutex},
};

use tokio::sync::{watch, Semaphore};

/// The read in flight, if any, and the loads that may wait for it.
#[derive(Debug)]
pub struct Flight<T> {
    /// The answer of the last read started: `None` while it runs.
    current: Mutex<Option<watch::Receiver<Option<T>>>>,
    waiting: Arc<Semaphore>,
    max_waiting: usize,
}

/// Why a load got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Missed {
    /// `max_waiting` loads were waiting already.
    #[error("{0} page loads are waiting for the database already")]
    Busy(usize),
    /// The read ended without an answer (its task panicked).
    #[error("the read ended without an answer")]
    Lost,
}

impl<T: Clone + Send + Sync + 'static> Flight<T> {
    /// At most `max_waiting` loads waiting for a read at once.
    pub fn new(max_waiting: usize) -> Self {
        Flight {
            current: Mutex::new(None),
            waiting: Arc::new(Semaphore::new(max_waiting)),
            max_waiting,
        }
    }

    /// The answer of the read in flight, or of the one `start` begins when none is; [`Missed::Busy`] at once when
    /// `max_waiting` loads are waiting already.
    pub async fn join<F, R>(&self, start: F) -> Result<T, Missed>
    where
        F: FnOnce() -> R,
        R: Future<Output = T> + Send + 'static,
    {
        let Ok(_waiting) = self.waiting.try_acquire() else {
            return Err(Missed::Busy(self.max_waiting));
        };
        let mut answer = self.in_flight_or(start);
        let answer = answer.wait_for(Option::is_some).await.map_err(|_| Missed::Lost)?;
        answer.clone().ok_or(Missed::Lost)
    }

    /// The read in flight, or a new one.
    fn in_flight_or<F, R>(&self, start: F) -> watch::Receiver<Option<T>>
    where
        F: FnOnce() -> R,
        R: Future<Output = T> + Send + 'static,
    {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        // Running: no answer yet, and its task still holds the sender.
        if let Some(running) = current
            .as_ref()
            .filter(|r| r.borrow().is_none() && r.has_changed().is_ok())
        {
            return running.clone();
        }
        let (answer, receiver) = watch::channel(None);
        let read = start();
        tokio::spawn(async move {
            let _ = answer.send(Some(read.await));
        });
        *current = Some(receiver.clone());
        receiver
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::atomic::{AtomicU32, Ordering},
        time::Duration,
    };

    use tokio::sync::Notify;

    use super::*;

    /// A read that counts its starts and answers its number once `go` is notified.
    fn read(
        starts: &Arc<AtomicU32>,
        go: &Arc<Notify>,
    ) -> impl FnOnce() -> std::pin::Pin<Box<dyn Future<Output = u32> + Send>> {
        let (starts, go) = (starts.clone(), go.clone());
        move || {
            let n = starts.fetch_add(1, Ordering::SeqCst) + 1;
            Box::pin(async move {
                go.notified().await;
                n
            })
        }
    }

    #[tokio::test]
    async fn loads_that_arrive_while_a_read_runs_share_its_answer_and_the_next_starts_another() {
        let flight = Arc::new(Flight::new(8));
        let (starts, go) = (Arc::new(AtomicU32::new(0)), Arc::new(Notify::new()));
        let loads: Vec<_> = (0..5)
            .map(|_| {
                let (flight, start) = (flight.clone(), read(&starts, &go));
                tokio::spawn(async move { flight.join(start).await })
            })
            .collect();
        // Every load has joined before the read answers.
        while flight.waiting.available_permits() > 3 {
            tokio::task::yield_now().await;
        }
        go.notify_one();
        for load in loads {
            assert_eq!(load.await.expect("load"), Ok(1));
        }
        assert_eq!(starts.load(Ordering::SeqCst), 1, "one read for five loads");
        // The read is over: the next load starts a new one.
        let next = tokio::spawn({
            let (flight, start) = (flight.clone(), read(&starts, &go));
            async move { flight.join(start).await }
        });
        while starts.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        go.notify_one();
        assert_eq!(next.await.expect("load"), Ok(2));
    }

    #[tokio::test]
    async fn past_the_bound_a_load_is_told_busy_at_once() {
        let flight = Arc::new(Flight::new(2));
        let (starts, go) = (Arc::new(AtomicU32::new(0)), Arc::new(Notify::new()));
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let (flight, start) = (flight.clone(), read(&starts, &go));
                tokio::spawn(async move { flight.join(start).await })
            })
            .collect();
        while flight.waiting.available_permits() > 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(flight.join(read(&starts, &go)).await, Err(Missed::Busy(2)));
        go.notify_one();
        for load in waiting {
            assert_eq!(load.await.expect("load"), Ok(1));
        }
        assert_eq!(starts.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_read_outlives_the_loads_that_left_it() {
        let flight = Flight::new(8);
        let (starts, go) = (Arc::new(AtomicU32::new(0)), Arc::new(Notify::new()));
        let left = tokio::time::timeout(Duration::from_millis(10), flight.join(read(&starts, &go))).await;
        assert!(left.is_err(), "the load gave up");
        // A load arriving later joins the same read, still running without anyone waiting.
        let (flight, start) = (Arc::new(flight), read(&starts, &go));
        let later = tokio::spawn({
            let flight = flight.clone();
            async move { flight.join(start).await }
        });
        while flight.waiting.available_permits() == 8 {
            tokio::task::yield_now().await;
        }
        go.notify_one();
        assert_eq!(later.await.expect("load"), Ok(1));
        assert_eq!(starts.load(Ordering::SeqCst), 1);
    }
}
