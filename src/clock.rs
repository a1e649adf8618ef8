//! The clocks, injected so tests set or advance them instead of waiting for time to pass: the
//! wall clock wherever the program compares event time with real time (the `max_future_skew`
//! bound), and a monotonic clock wherever it asks whether something read earlier is still fresh
//! (the Redis store's hold views and TTL refreshes).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> i64;
}

/// The system's real-time clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }
}

/// A clock that says what it is told: for tests.
#[derive(Debug, Default)]
pub struct FixedClock(AtomicI64);

impl FixedClock {
    pub fn new(now_ms: i64) -> FixedClock {
        FixedClock(AtomicI64::new(now_ms))
    }

    pub fn set(&self, now_ms: i64) {
        self.0.store(now_ms, Ordering::Relaxed);
    }
}

impl Clock for FixedClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A monotonic clock: how old something read earlier is.
pub trait MonotonicClock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Instant;
}

/// The system's monotonic clock (`Instant::now`).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemMonotonic;

impl MonotonicClock for SystemMonotonic {
    #[inline]
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A monotonic clock that moves only when told: for tests.
#[derive(Debug)]
pub struct ManualMonotonic {
    start: Instant,
    advanced_ns: AtomicU64,
}

impl ManualMonotonic {
    pub fn new() -> ManualMonotonic {
        ManualMonotonic {
            start: Instant::now(),
            advanced_ns: AtomicU64::new(0),
        }
    }

    /// Moves the clock on by `by`.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .advanced_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                Some(now.saturating_add(by))
            });
    }
}

impl Default for ManualMonotonic {
    fn default() -> Self {
        ManualMonotonic::new()
    }
}

impl MonotonicClock for ManualMonotonic {
    fn now(&self) -> Instant {
        self.start + Duration::from_nanos(self.advanced_ns.load(Ordering::Relaxed))
    }
}

/// A shared clock: the test keeps one handle to advance it, the store another.
impl<T: MonotonicClock + ?Sized> MonotonicClock for Arc<T> {
    #[inline]
    fn now(&self) -> Instant {
        (**self).now()
    }
}
