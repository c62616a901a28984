//! The one retry policy: capped exponential backoff. The daemon waits by it between ticks while the database
//! is unreachable, the compensation queue schedules failed charges by it, and the runner retries the statement
//! that ends a run by it.

use std::time::Duration;

/// Waits of `first`, doubled per retry, never longer than `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    max: Duration,
}

impl Backoff {
    /// `max` below `first` caps every wait at `max`.
    pub const fn new(first: Duration, max: Duration) -> Self {
        Backoff { first, max }
    }

    /// The wait before retry number `retry` (1-based): `first * 2^(retry - 1)`, at most `max`. Retry 0 waits
    /// as long as retry 1; no retry number overflows.
    pub fn delay(self, retry: u32) -> Duration {
        let exponent = retry.saturating_sub(1).min(32);
        self.first
            .saturating_mul(2u32.saturating_pow(exponent))
            .min(self.max)
    }

    /// The first `retries` waits, in order.
    pub fn delays(self, retries: u32) -> impl Iterator<Item = Duration> {
        (1..=retries).map(move |n| self.delay(n))
    }

    pub fn first(self) -> Duration {
        self.first
    }

    pub fn max(self) -> Duration {
        self.max
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn delays_double_and_are_capped() {
        let b = Backoff::new(Duration::from_secs(60), Duration::from_secs(3600));
        let delays: Vec<u64> = b.delays(9).map(|d| d.as_secs()).collect();
        assert_eq!(delays, vec![60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]);
        assert_eq!(b.delay(u32::MAX), b.max());
        assert_eq!(b.delay(0), b.first());
    }

    proptest! {
        #[test]
        fn delays_never_shrink_and_never_pass_the_cap(
            first_ms in 1u64..100_000, max_ms in 1u64..10_000_000, retry in 0u32..u32::MAX
        ) {
            let b = Backoff::new(Duration::from_millis(first_ms), Duration::from_millis(max_ms));
            prop_assert!(b.delay(retry) <= b.max());
            prop_assert!(b.delay(retry) <= b.delay(retry.saturating_add(1)));
        }
    }
}
