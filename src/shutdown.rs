//! A shutdown signal passed to every loop: triggered once (SIGTERM/SIGINT, or a test), waited on
//! with a timeout, so loops wake either for work or for shutdown.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Default)]
pub struct Shutdown(Arc<(Mutex<Option<Instant>>, Condvar)>);

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown::default()
    }

    /// Starts the shutdown; later calls keep the first time.
    pub fn trigger(&self) {
        let (lock, wake) = &*self.0;
        let mut since = lock.lock().unwrap_or_else(|p| p.into_inner());
        since.get_or_insert_with(Instant::now);
        wake.notify_all();
    }

    pub fn is_triggered(&self) -> bool {
        self.since().is_some()
    }

    /// When the shutdown was triggered.
    pub fn since(&self) -> Option<Instant> {
        *self.0 .0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits up to `timeout` for the shutdown; true if it was triggered.
    pub fn wait(&self, timeout: Duration) -> bool {
        let (lock, wake) = &*self.0;
        let since = lock.lock().unwrap_or_else(|p| p.into_inner());
        let (since, _) = wake
            .wait_timeout_while(since, timeout, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wakes_waiters_and_stays_triggered() {
        let shutdown = Shutdown::new();
        assert!(!shutdown.wait(Duration::from_millis(1)));
        let other = shutdown.clone();
        let waiter = std::thread::spawn(move || other.wait(Duration::from_secs(60)));
        shutdown.trigger();
        assert!(waiter.join().unwrap());
        let first = shutdown.since();
        shutdown.trigger();
        assert_eq!(shutdown.since(), first);
        assert!(shutdown.wait(Duration::ZERO));
    }
}
