//! Offset progress of one partition: which offset may be committed. An offset is committable
//! once every event before it has been decided, its records (decision, dead letter) have been
//! acknowledged by the broker, and the counter deltas it made are durable in the store. Offsets
//! are committed only just after the end of a processed batch: the decision journal records the
//! partition's watermark there, for the next owner to resume from it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct Progress {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// (last offset of a processed batch, the store's counted mark after it), oldest first, until
    /// its deltas are durable.
    processed: VecDeque<(i64, u64)>,
    /// Last offsets of batches whose deltas are durable, oldest first (the newest one stays).
    durable_ends: VecDeque<i64>,
    /// Offsets with records not yet acknowledged, and how many.
    undelivered: BTreeMap<i64, u32>,
    /// The offset last handed to the consumer's offset store.
    stored: Option<i64>,
}

impl Progress {
    pub fn new() -> Progress {
        Progress::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A record for the event at `offset` was handed to the producer.
    pub fn expect_delivery(&self, offset: i64) {
        *self.lock().undelivered.entry(offset).or_default() += 1;
    }

    /// A record of the event at `offset` was acknowledged.
    pub fn delivered(&self, offset: i64) {
        let mut inner = self.lock();
        if let Some(n) = inner.undelivered.get_mut(&offset) {
            *n -= 1;
            if *n == 0 {
                inner.undelivered.remove(&offset);
            }
        }
    }

    /// Every event up to `last_offset` is decided and its records handed over; the store's counted
    /// mark was `mark` after them.
    pub fn processed(&self, last_offset: i64, mark: u64) {
        self.lock().processed.push_back((last_offset, mark));
    }

    /// The offset to commit (the next one to read) given the store's durable mark: `None` until
    /// something is committable.
    pub fn committable(&self, durable_mark: u64) -> Option<i64> {
        let mut inner = self.lock();
        while let Some(&(offset, mark)) = inner.processed.front() {
            if mark > durable_mark {
                break;
            }
            inner.durable_ends.push_back(offset);
            inner.processed.pop_front();
        }
        // The newest durable batch end with every record before it delivered.
        let first_undelivered = inner.undelivered.keys().next().copied().unwrap_or(i64::MAX);
        let end = inner
            .durable_ends
            .iter()
            .rev()
            .find(|&&end| end < first_undelivered)
            .copied()?;
        while inner.durable_ends.front().is_some_and(|&older| older < end) {
            inner.durable_ends.pop_front();
        }
        Some(end + 1)
    }

    /// The committable offset if it moved past the one stored last; remembers it as stored.
    pub fn advance(&self, durable_mark: u64) -> Option<i64> {
        let next = self.committable(durable_mark)?;
        let mut inner = self.lock();
        if inner.stored.is_some_and(|stored| stored >= next) {
            return None;
        }
        inner.stored = Some(next);
        Some(next)
    }

    /// Records with no acknowledgement yet.
    pub fn undelivered(&self) -> u32 {
        self.lock().undelivered.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_only_what_is_delivered_and_durable() {
        let progress = Progress::new();
        assert_eq!(progress.committable(0), None);
        // Batch 10..=12: a decision for 11; the store counted up to mark 5.
        progress.expect_delivery(11);
        progress.processed(12, 5);
        assert_eq!(progress.committable(4), None, "deltas not durable yet");
        assert_eq!(
            progress.committable(5),
            None,
            "11 waits for its decision, and 10..=12 is one batch"
        );
        progress.delivered(11);
        assert_eq!(progress.committable(5), Some(13));
        // Batch 13..=20 with two records for 15, then a later batch already durable.
        progress.expect_delivery(15);
        progress.expect_delivery(15);
        progress.processed(20, 9);
        progress.processed(25, 9);
        progress.delivered(15);
        assert_eq!(
            progress.committable(9),
            Some(13),
            "batch 13..=20 waits for 15"
        );
        progress.delivered(15);
        assert_eq!(progress.committable(9), Some(26));
        assert_eq!(progress.undelivered(), 0);
    }

    #[test]
    fn advance_reports_each_new_offset_once() {
        let progress = Progress::new();
        progress.processed(3, 0);
        assert_eq!(progress.advance(0), Some(4));
        assert_eq!(progress.advance(0), None);
        progress.processed(7, 1);
        assert_eq!(progress.advance(0), None);
        assert_eq!(progress.advance(1), Some(8));
    }
}
