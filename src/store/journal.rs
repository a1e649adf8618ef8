//! The decision journal: what each event of an input lane produced, written to Redis in the same
//! flush as (and before) the event's counter deltas, and read back by whoever takes the lane over.
//!
//! Why: after a crash, the lane's next owner re-reads the events after the last committed offset.
//! Those whose deltas were flushed are judged but not counted again (their keys recorded their
//! offset), but judged against counters that by then include later events: the decision could
//! differ from the one already delivered. The journal holds, for every offset up to `covered`,
//! the record the first run produced (no entry: it produced none), so the copy delivered again is
//! the same bytes. Entries below the committed offset are deleted: nobody re-reads them.
//!
//! Layout: one hash per lane, `vg:j:<digest of (namespace, lane)>`: field `n` = covered, field
//! `<offset>` = record. A TTL (refreshed by every write) removes journals of abandoned lanes.

use std::collections::{BTreeSet, HashMap};

use super::link::Batch;
use super::Origin;

/// How long a journal outlives its last write.
const JOURNAL_TTL_MS: i64 = 7 * 86_400_000;

/// A lane's journal as read back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journal {
    /// Every offset up to this one is journaled (no entry: the event produced no record).
    pub covered: Option<i64>,
    /// The lane's newest accepted event time after each batch end offset.
    pub newest_after: std::collections::BTreeMap<i64, i64>,
    /// The record each journaled event produced, by offset.
    pub records: HashMap<i64, Vec<u8>>,
}

impl Journal {
    /// What the first run of the event at `offset` produced: `None` if the journal does not
    /// cover it, `Some(None)` if it produced no record.
    pub fn produced(&self, offset: i64) -> Option<Option<&[u8]>> {
        match self.covered {
            Some(covered) if offset <= covered => Some(self.records.get(&offset).map(Vec::as_slice)),
            _ => None,
        }
    }

    /// The lane's newest accepted event time just before `offset`, if a batch ended there.
    pub fn newest_before(&self, offset: i64) -> Option<i64> {
        self.newest_after.get(&(offset - 1)).copied()
    }
}

#[derive(Default)]
struct Lane {
    key: String,
    /// The highest offset recorded so far.
    covered: Option<i64>,
    /// (batch end offset, newest accepted event time after it, the store's counted index of the
    /// mark) not yet written.
    marks: Vec<(i64, i64, u64)>,
    /// Batch end offsets Redis holds a newest event time for.
    held_marks: BTreeSet<i64>,
    /// The highest offset Redis holds as covered.
    written_covered: Option<i64>,
    /// The highest covered offset sent (written, or in a flush in flight).
    sent_covered: Option<i64>,
    /// Records not yet written.
    entries: Vec<(i64, Vec<u8>)>,
    /// Offsets Redis holds records for.
    held: BTreeSet<i64>,
    /// Records below this offset are no longer needed.
    trim_below: Option<i64>,
}

/// The journals of every lane this process writes.
pub(super) struct Journals {
    namespace: Vec<u8>,
    lanes: HashMap<u64, Lane>,
}

/// What a flush took from one lane.
struct SentLane {
    lane: u64,
    covered: Option<i64>,
    entries: Vec<(i64, Vec<u8>)>,
    marks: Vec<(i64, i64, u64)>,
    trims: Vec<i64>,
    trimmed_marks: Vec<i64>,
}

/// What a flush took from the journals, to put back if it fails.
#[derive(Default)]
pub(super) struct Sent {
    lanes: Vec<SentLane>,
}

impl Sent {
    /// How many records it carries.
    pub(super) fn records(&self) -> usize {
        self.lanes.iter().map(|l| l.entries.len()).sum()
    }
}

impl Journals {
    pub(super) fn new() -> Journals {
        Journals { namespace: Vec::new(), lanes: HashMap::new() }
    }

    /// Journals are named by (namespace, lane): the namespace tells apart consumer groups that
    /// number their lanes alike.
    pub(super) fn set_namespace(&mut self, namespace: &str) {
        self.namespace = namespace.as_bytes().to_vec();
        self.lanes.clear();
    }

    fn lane(&mut self, lane: u64) -> &mut Lane {
        let namespace = &self.namespace;
        self.lanes.entry(lane).or_insert_with(|| {
            let mut hasher = blake3::Hasher::new();
            hasher.update(namespace);
            hasher.update(&[0]);
            hasher.update(&lane.to_le_bytes());
            let mut key = String::from("vg:j:");
            super::redis::push_hex(&mut key, &hasher.finalize().as_bytes()[..16]);
            Lane { key, ..Lane::default() }
        })
    }

    /// The Redis key of `lane`'s journal.
    pub(super) fn key(&mut self, lane: u64) -> String {
        self.lane(lane).key.clone()
    }

    /// The event at `origin` produced `record` (or none).
    pub(super) fn record(&mut self, origin: Origin, record: Option<&[u8]>) {
        let lane = self.lane(origin.lane);
        lane.covered = Some(lane.covered.map_or(origin.offset, |c| c.max(origin.offset)));
        if let Some(record) = record {
            lane.entries.push((origin.offset, record.to_vec()));
        }
    }

    /// A batch of `lane` ended at `offset`, its newest accepted event time then `newest`; the
    /// store counts the mark as `index` (its offsets wait for it to be durable).
    pub(super) fn mark(&mut self, lane: u64, offset: i64, newest: i64, index: u64) {
        self.lane(lane).marks.push((offset, newest, index));
    }

    /// The counted index of the oldest mark not yet written (pending, or in `inflight`).
    pub(super) fn oldest_unwritten(&self, inflight: Option<&Sent>) -> Option<u64> {
        let pending = self.lanes.values().flat_map(|l| l.marks.iter().map(|m| m.2));
        let sent = inflight.into_iter().flat_map(|s| s.lanes.iter().flat_map(|l| l.marks.iter().map(|m| m.2)));
        pending.chain(sent).min()
    }

    /// Takes in `lane`'s journal as read from Redis (HGETALL); later writes keep its coverage.
    pub(super) fn loaded(&mut self, lane: u64, flat: &[Vec<u8>]) -> Journal {
        let mut journal = Journal::default();
        for pair in flat.chunks_exact(2) {
            let number = std::str::from_utf8(&pair[0]).ok().and_then(|s| s.parse::<i64>().ok());
            let value = || std::str::from_utf8(&pair[1]).ok().and_then(|s| s.parse().ok());
            let mark = pair[0].strip_prefix(b"w").and_then(|o| std::str::from_utf8(o).ok()?.parse::<i64>().ok());
            if pair[0] == b"n" {
                journal.covered = value();
            } else if let (Some(offset), Some(newest)) = (mark, value()) {
                journal.newest_after.insert(offset, newest);
            } else if let Some(offset) = number {
                journal.records.insert(offset, pair[1].clone());
            }
        }
        let state = self.lane(lane);
        state.covered = state.covered.max(journal.covered);
        state.held_marks.extend(journal.newest_after.keys().copied());
        state.written_covered = journal.covered;
        state.sent_covered = state.sent_covered.max(journal.covered);
        state.held.extend(journal.records.keys().copied());
        journal
    }

    /// Records of `lane` below `committed` are no longer needed: its input is committed there.
    pub(super) fn trim(&mut self, lane: u64, committed: i64) {
        let state = self.lane(lane);
        state.trim_below = Some(state.trim_below.map_or(committed, |t| t.max(committed)));
    }

    /// Whether anything waits to be written.
    pub(super) fn pending(&self) -> bool {
        self.lanes.values().any(|l| {
            !l.entries.is_empty()
                || l.covered > l.sent_covered
                || !l.marks.is_empty()
                || l.trim_below.is_some_and(|t| {
                    l.held.first().is_some_and(|&first| first < t) || l.held_marks.first().is_some_and(|&first| first < t - 1)
                })
        })
    }

    /// Appends the writes of every lane to `batch` and takes them out of the journals.
    pub(super) fn take(&mut self, batch: &mut Batch, cluster: bool) -> Sent {
        let mut sent = Sent::default();
        for (&id, lane) in self.lanes.iter_mut() {
            // Records below the committed offset, and marks below the one just before it (where
            // the next owner starts) are no longer needed.
            let (trims, trimmed_marks): (Vec<i64>, Vec<i64>) = match lane.trim_below {
                Some(below) => (lane.held.range(..below).copied().collect(), lane.held_marks.range(..below - 1).copied().collect()),
                None => (Vec::new(), Vec::new()),
            };
            let moved = lane.covered > lane.sent_covered;
            if lane.entries.is_empty() && lane.marks.is_empty() && !moved && trims.is_empty() && trimmed_marks.is_empty() {
                continue;
            }
            let entries = std::mem::take(&mut lane.entries);
            let marks = std::mem::take(&mut lane.marks);
            lane.sent_covered = lane.covered;
            if !entries.is_empty() || !marks.is_empty() || moved {
                let mut hset = redis::cmd("HSET");
                hset.arg(&lane.key);
                if let Some(covered) = lane.covered {
                    hset.arg("n").arg(covered);
                }
                for (offset, newest, _) in &marks {
                    hset.arg(format!("w{offset}")).arg(newest);
                }
                for (offset, record) in &entries {
                    hset.arg(offset).arg(record.as_slice());
                }
                batch.command(cluster, &lane.key, hset);
                let mut expire = redis::cmd("PEXPIRE");
                expire.arg(&lane.key).arg(JOURNAL_TTL_MS);
                batch.command(cluster, &lane.key, expire);
            }
            if !trims.is_empty() || !trimmed_marks.is_empty() {
                let mut hdel = redis::cmd("HDEL");
                hdel.arg(&lane.key).arg(&trims);
                for offset in &trimmed_marks {
                    hdel.arg(format!("w{offset}"));
                }
                batch.command(cluster, &lane.key, hdel);
            }
            sent.lanes.push(SentLane { lane: id, covered: lane.covered, entries, marks, trims, trimmed_marks });
        }
        sent
    }

    /// The writes of `sent` were made.
    pub(super) fn written(&mut self, sent: Sent) {
        for sent in sent.lanes {
            let lane = self.lane(sent.lane);
            lane.written_covered = lane.written_covered.max(sent.covered);
            lane.held.extend(sent.entries.iter().map(|(offset, _)| *offset));
            lane.held_marks.extend(sent.marks.iter().map(|(offset, _, _)| *offset));
            for offset in sent.trims {
                lane.held.remove(&offset);
            }
            for offset in sent.trimmed_marks {
                lane.held_marks.remove(&offset);
            }
        }
    }

    /// The writes of `sent` failed (or may have): they are made again by the next flush.
    pub(super) fn failed(&mut self, sent: Sent) {
        for mut sent in sent.lanes {
            let lane = self.lane(sent.lane);
            sent.entries.append(&mut lane.entries);
            lane.entries = sent.entries;
            sent.marks.append(&mut lane.marks);
            lane.marks = sent.marks;
            lane.sent_covered = lane.written_covered;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_journal_says_what_each_covered_offset_produced() {
        let mut journals = Journals::new();
        journals.set_namespace("group");
        let flat: Vec<Vec<u8>> =
            [&b"n"[..], b"12", b"w9", b"1700000000000", b"10", b"{\"a\":1}", b"3", b"{}"].iter().map(|b| b.to_vec()).collect();
        let journal = journals.loaded(4, &flat);
        assert_eq!(journal.newest_before(10), Some(1_700_000_000_000));
        assert_eq!(journal.newest_before(11), None);
        assert_eq!(journal.produced(10), Some(Some(&b"{\"a\":1}"[..])));
        assert_eq!(journal.produced(11), Some(None), "covered, no record");
        assert_eq!(journal.produced(13), None, "not covered");
    }

    #[test]
    fn writes_go_out_once_and_come_back_when_they_fail() {
        let mut journals = Journals::new();
        journals.set_namespace("group");
        journals.record(Origin { lane: 1, offset: 5 }, Some(b"r5"));
        journals.record(Origin { lane: 1, offset: 6 }, None);
        journals.mark(1, 6, 1_000, 3);
        assert_eq!(journals.oldest_unwritten(None), Some(3));
        assert!(journals.pending());
        let mut batch = Batch::default();
        let sent = journals.take(&mut batch, false);
        assert_eq!(batch.calls.len(), 2, "HSET and PEXPIRE");
        assert!(!journals.pending());
        assert_eq!(journals.oldest_unwritten(Some(&sent)), Some(3), "in flight");
        journals.failed(sent);
        assert!(journals.pending());
        let mut batch = Batch::default();
        let sent = journals.take(&mut batch, false);
        journals.written(sent);
        assert!(!journals.pending());
        assert_eq!(journals.oldest_unwritten(None), None);
        // Committed past 5: its record is deleted.
        journals.trim(1, 6);
        assert!(journals.pending());
        let mut batch = Batch::default();
        let sent = journals.take(&mut batch, false);
        assert_eq!(batch.calls.len(), 1, "HDEL");
        journals.written(sent);
        assert!(!journals.pending());
        // Different namespaces, different keys.
        let key = journals.key(1);
        journals.set_namespace("other");
        assert_ne!(journals.key(1), key);
    }
}
