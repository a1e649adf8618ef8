//! The decision journal: what each event of an input lane (a Kafka partition) produced, written
//! to Redis before the records go out, and read back by whoever takes the lane over.
//!
//! Why: after a crash, the lane's next owner re-reads the events after the last committed offset.
//! Those whose deltas were flushed are judged but not counted again (their keys recorded their
//! offset), but judged against counters that by then include later events: the decision could
//! differ from the one already delivered. The journal holds, for every offset up to `covered`,
//! the record the first run produced (no entry: it produced none), so the copy delivered again is
//! the same bytes. Entries below the committed offset are deleted: nobody re-reads them.
//!
//! Ordering: a batch's records are journaled before they are produced and before its deltas can
//! be flushed, so whatever a next owner finds counted, it also finds journaled.
//!
//! Fencing: the owner of a lane claims its journal with a fresh token; a write by an earlier
//! owner (a worker the broker already dropped from the group while it kept running) is refused,
//! and that worker drops the batch instead of producing it, and takes back what the batch
//! counted and the holds it raised (none of it was sent: the store sends nothing while a batch
//! runs). So two workers never deliver different records for one event, and the next owner
//! judges each event against exactly the events before it, even when a rebalance overlaps them.
//!
//! The journal also keeps the lane's newest accepted event time at each batch end (the points
//! offsets are committed at), so the next owner resumes the watermark where it was.
//!
//! Layout (`lua/journal.lua`): one hash per lane, `vg:j:<digest of (namespace, lane)>`: `owner`,
//! `n` = covered, `w<offset>` = newest event time after that batch end, `<offset>` = record. A TTL
//! refreshed by every write removes journals of abandoned lanes.
//!
//! While Redis is unavailable the journal is skipped (records still go out, counted locally and
//! marked degraded): an event re-read after a crash in that time is judged again.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use redis::Value;

use super::counter_store::StoreError;
use super::keys::push_hex;
use super::link::Batch;
use super::redis::{open_side_link, RedisStoreConfig};
use super::scripts::JOURNAL;

/// How long a journal outlives its last write.
const JOURNAL_TTL_MS: i64 = 7 * 86_400_000;

/// A lane's journal as read back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journal {
    /// Every offset up to this one is journaled (no entry: the event produced no record).
    pub covered: Option<i64>,
    /// The record each journaled event produced, by offset.
    pub records: HashMap<i64, Vec<u8>>,
    /// The lane's newest accepted event time after each batch end offset.
    pub newest_after: BTreeMap<i64, i64>,
}

impl Journal {
    /// What the first run of the event at `offset` produced: `None` if the journal does not
    /// cover it, `Some(None)` if it produced no record.
    pub fn produced(&self, offset: i64) -> Option<Option<&[u8]>> {
        match self.covered {
            Some(covered) if offset <= covered => {
                Some(self.records.get(&offset).map(Vec::as_slice))
            }
            _ => None,
        }
    }

    /// The lane's newest accepted event time just before `offset`, if a batch ended there.
    pub fn newest_before(&self, offset: i64) -> Option<i64> {
        self.newest_after.get(&(offset - 1)).copied()
    }

    /// Reads a journal hash (HGETALL).
    fn parse(flat: &[Vec<u8>]) -> Journal {
        let mut journal = Journal::default();
        let number = |bytes: &[u8]| {
            std::str::from_utf8(bytes)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
        };
        for pair in flat.chunks_exact(2) {
            let (field, value) = (pair[0].as_slice(), &pair[1]);
            if field == b"n" {
                journal.covered = number(value);
            } else if let Some(offset) = field.strip_prefix(b"w").and_then(number) {
                if let Some(newest) = number(value) {
                    journal.newest_after.insert(offset, newest);
                }
            } else if let Some(offset) = number(field) {
                journal.records.insert(offset, value.clone());
            }
        }
        journal
    }
}

/// What one batch of a lane adds to its journal.
#[derive(Debug, Default)]
pub struct JournalBatch {
    /// The last offset of the batch whose outcome is recorded.
    pub covered: Option<i64>,
    /// (batch end offset, the lane's newest accepted event time after it).
    pub mark: Option<(i64, i64)>,
    /// The records the batch produced, by offset.
    pub records: Vec<(i64, Vec<u8>)>,
}

/// Why a journal write was not made.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Another worker claimed the lane: this one no longer owns it.
    #[error("another worker took the partition over")]
    Fenced,
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl JournalError {
    /// Low-cardinality code for metrics.
    pub fn code(&self) -> &'static str {
        match self {
            JournalError::Fenced => "fenced",
            JournalError::Store(e) => e.code(),
        }
    }
}

#[derive(Default)]
struct Lane {
    key: String,
    token: String,
    /// Offsets Redis holds records for, and batch ends it holds watermarks for.
    held: BTreeSet<i64>,
    held_marks: BTreeSet<i64>,
    /// Records below this offset (and marks below the one just before it) are no longer needed.
    trim_below: Option<i64>,
}

struct Job {
    id: u64,
    batch: Batch,
}

struct Done {
    id: u64,
    result: Result<Vec<Value>, StoreError>,
}

/// Claims and writes the journals of the lanes this worker owns, on its own connection and
/// thread: callers wait at most a connection plus a reply for each call.
pub struct JournalWriter {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Done>,
    next_id: u64,
    /// A call the caller stopped waiting for: until it comes back, calls fail at once.
    outstanding: Option<u64>,
    cluster: bool,
    namespace: Vec<u8>,
    lanes: HashMap<u64, Lane>,
    /// Lanes whose claim failed (Redis did not answer): their batches go out unjournaled until a
    /// claim succeeds (the partition loop tries again before each batch).
    unclaimed: HashSet<u64>,
    deadline: Duration,
    /// Since when Redis has not answered the journal: calls fail at once, and a probe (a PING
    /// nobody waits for) is sent every `probe_interval` until one comes back answered.
    outage: Option<Instant>,
    probe_interval: Duration,
}

impl JournalWriter {
    /// Connects to the Redis at `url`; `namespace` (the consumer group) tells apart groups that
    /// number their lanes alike.
    pub fn connect(
        url: &str,
        config: &RedisStoreConfig,
        namespace: &str,
    ) -> Result<JournalWriter, StoreError> {
        let (mut link, cluster) = open_side_link(url, config)?;
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel();
        std::thread::Builder::new()
            .name("vigil-journal".into())
            .spawn(move || {
                for job in job_rx {
                    let (result, _) = link.query(&job.batch, 2);
                    if done_tx.send(Done { id: job.id, result }).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot start the journal thread: {e}"))
            })?;
        Ok(JournalWriter {
            jobs: Some(jobs),
            done,
            next_id: 0,
            outstanding: None,
            cluster,
            namespace: namespace.as_bytes().to_vec(),
            lanes: HashMap::new(),
            unclaimed: HashSet::new(),
            deadline: (config.connect_timeout + config.response_timeout) * 2,
            outage: None,
            probe_interval: config.probe_interval,
        })
    }

    /// The Redis key of `lane`'s journal.
    fn key(&self, lane: u64) -> String {
        let mut hasher = blake3::Hasher::new();
        hasher.update(&self.namespace);
        hasher.update(&[0]);
        hasher.update(&lane.to_le_bytes());
        let mut key = String::from("vg:j:");
        push_hex(&mut key, &hasher.finalize().as_bytes()[..16]);
        key
    }

    /// Runs one script call on the journal thread, waiting at most `deadline`.
    fn call(&mut self, key: &str, cmd: redis::Cmd) -> Result<Value, StoreError> {
        if self.outage.is_some() && !self.probe(key) {
            return Err(StoreError::Unavailable(
                "Redis did not answer the journal lately".into(),
            ));
        }
        if let Some(outstanding) = self.outstanding {
            loop {
                match self.done.try_recv() {
                    Ok(done) if done.id == outstanding => {
                        self.outstanding = None;
                        break;
                    }
                    Ok(_) => continue,
                    Err(_) => {
                        return Err(StoreError::Unavailable(
                            "an earlier journal call is still waiting for Redis".into(),
                        ))
                    }
                }
            }
        }
        self.next_id += 1;
        let id = self.next_id;
        let mut batch = Batch::default();
        batch.command(self.cluster, key, cmd);
        let jobs = self
            .jobs
            .as_ref()
            .expect("the journal thread runs until drop");
        jobs.send(Job { id, batch })
            .map_err(|_| StoreError::Unavailable("the journal thread stopped".into()))?;
        let sent = Instant::now();
        let mut deadline = sent + self.deadline;
        let mut waited_again = false;
        let result = loop {
            match self
                .done
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(done) if done.id == id => break done.result,
                Ok(_) => continue,
                Err(mpsc::RecvTimeoutError::Timeout)
                    if !waited_again && stalled(sent.elapsed(), self.deadline) =>
                {
                    // This process did not run for most of the wait (stopped, paused, starved),
                    // so Redis was not given the time: the reply may be on its way, and it may
                    // say another worker took the partition over meanwhile. Going on unjournaled
                    // would deliver a zombie's records and flush its counts (the stalled-worker
                    // fault test caught that: a next owner then judged those events on windows
                    // already holding them). So wait once more.
                    waited_again = true;
                    // Twice the deadline: the journal thread may reconnect and try again.
                    deadline = Instant::now() + self.deadline * 2;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.outstanding = Some(id);
                    break Err(StoreError::Unavailable(format!(
                        "no reply from Redis within {:?}",
                        self.deadline
                    )));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    break Err(StoreError::Unavailable("the journal thread stopped".into()))
                }
            }
        };
        match result {
            Ok(mut replies) => {
                self.outage = None;
                replies
                    .pop()
                    .ok_or_else(|| StoreError::Protocol("no reply to a journal call".into()))
            }
            Err(e) => {
                self.outage = Some(Instant::now());
                Err(e)
            }
        }
    }

    /// During an outage: whether Redis answers again (a call or probe sent earlier came back
    /// answered). Otherwise sends a probe if one is due, without waiting for it: an outage makes
    /// no batch wait beyond the first call that found it (a frozen Redis would otherwise hold
    /// every partition for a full deadline each `probe_interval`).
    fn probe(&mut self, key: &str) -> bool {
        if let Some(outstanding) = self.outstanding {
            loop {
                match self.done.try_recv() {
                    Ok(done) if done.id == outstanding => {
                        self.outstanding = None;
                        if done.result.is_ok() {
                            self.outage = None;
                            return true;
                        }
                        break;
                    }
                    Ok(_) => continue,
                    Err(_) => return false,
                }
            }
        }
        if self
            .outage
            .is_some_and(|since| since.elapsed() >= self.probe_interval)
        {
            self.outage = Some(Instant::now());
            self.next_id += 1;
            let mut batch = Batch::default();
            batch.command(self.cluster, key, redis::cmd("PING"));
            if let Some(jobs) = &self.jobs {
                if jobs
                    .send(Job {
                        id: self.next_id,
                        batch,
                    })
                    .is_ok()
                {
                    self.outstanding = Some(self.next_id);
                }
            }
        }
        false
    }

    fn script(&self, key: &str, op: &str, token: &str) -> redis::Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(JOURNAL.get_hash())
            .arg(1)
            .arg(key)
            .arg(op)
            .arg(token)
            .arg(JOURNAL_TTL_MS);
        cmd
    }

    /// Makes this worker the owner of `lane`'s journal and returns what it holds.
    pub fn claim(&mut self, lane: u64) -> Result<Journal, StoreError> {
        let key = self.key(lane);
        let mut token = String::new();
        push_hex(&mut token, &rand::random::<[u8; 12]>());
        let reply = match self.call(&key, self.script(&key, "claim", &token)) {
            Ok(reply) => reply,
            Err(e) => {
                self.lanes.remove(&lane);
                self.unclaimed.insert(lane);
                return Err(e);
            }
        };
        self.unclaimed.remove(&lane);
        let flat: Vec<Vec<u8>> = redis::from_redis_value(reply)
            .map_err(|e| StoreError::Protocol(format!("journal: {e}")))?;
        let journal = Journal::parse(&flat);
        let lane = self.lanes.entry(lane).or_default();
        *lane = Lane {
            key,
            token,
            held: journal.records.keys().copied().collect(),
            held_marks: journal.newest_after.keys().copied().collect(),
            trim_below: None,
        };
        Ok(journal)
    }

    /// Records a batch of `lane`, if this worker still owns it.
    pub fn write(&mut self, lane: u64, batch: &JournalBatch) -> Result<(), JournalError> {
        if self.unclaimed.contains(&lane) {
            return Err(JournalError::Store(StoreError::Unavailable(
                "the partition's journal could not be claimed when it was assigned".into(),
            )));
        }
        let Some(state) = self.lanes.get(&lane) else {
            return Err(JournalError::Fenced);
        };
        let (key, token) = (state.key.clone(), state.token.clone());
        let (trims, trimmed_marks): (Vec<i64>, Vec<i64>) = match state.trim_below {
            Some(below) => (
                state.held.range(..below).copied().collect(),
                state.held_marks.range(..below - 1).copied().collect(),
            ),
            None => (Vec::new(), Vec::new()),
        };
        let mut cmd = self.script(&key, "write", &token);
        let entries = usize::from(batch.covered.is_some())
            + usize::from(batch.mark.is_some())
            + batch.records.len();
        cmd.arg(2 * entries);
        if let Some(covered) = batch.covered {
            cmd.arg("n").arg(covered);
        }
        if let Some((offset, newest)) = batch.mark {
            cmd.arg(format!("w{offset}")).arg(newest);
        }
        for (offset, record) in &batch.records {
            cmd.arg(offset).arg(record.as_slice());
        }
        cmd.arg(&trims);
        for offset in &trimmed_marks {
            cmd.arg(format!("w{offset}"));
        }
        let fenced = match self.call(&key, cmd)? {
            Value::BulkString(reply) => reply == b"fenced",
            Value::SimpleString(reply) => reply == "fenced",
            _ => false,
        };
        if fenced {
            return Err(JournalError::Fenced);
        }
        let state = self.lanes.get_mut(&lane).expect("looked up above");
        state
            .held
            .extend(batch.records.iter().map(|(offset, _)| *offset));
        state
            .held_marks
            .extend(batch.mark.map(|(offset, _)| offset));
        for offset in trims {
            state.held.remove(&offset);
        }
        for offset in trimmed_marks {
            state.held_marks.remove(&offset);
        }
        Ok(())
    }

    /// The input of `lane` is committed up to `committed`: older entries go with its next write.
    pub fn trim(&mut self, lane: u64, committed: i64) {
        if let Some(state) = self.lanes.get_mut(&lane) {
            state.trim_below = Some(state.trim_below.map_or(committed, |t| t.max(committed)));
        }
    }

    /// Forgets a lane this worker no longer owns.
    pub fn release(&mut self, lane: u64) {
        self.lanes.remove(&lane);
        self.unclaimed.remove(&lane);
    }
}

/// Whether a wait of `waited` for a reply due within `deadline` overran it by more than
/// scheduling can explain: the process was not running (SIGSTOP, a paused VM, swapping) for much
/// of it.
fn stalled(waited: Duration, deadline: Duration) -> bool {
    waited >= deadline + (deadline / 2).max(Duration::from_millis(500))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_far_past_its_deadline_is_a_stall_not_a_slow_redis() {
        let deadline = Duration::from_secs(3);
        assert!(!stalled(deadline, deadline));
        assert!(!stalled(deadline + Duration::from_millis(300), deadline));
        assert!(stalled(Duration::from_secs(10), deadline));
        // Short deadlines still leave half a second for scheduling.
        let short = Duration::from_millis(100);
        assert!(!stalled(Duration::from_millis(400), short));
        assert!(stalled(Duration::from_millis(700), short));
    }

    #[test]
    fn a_journal_says_what_each_covered_offset_produced() {
        let flat: Vec<Vec<u8>> = [
            &b"owner"[..],
            b"t",
            b"n",
            b"12",
            b"w9",
            b"1700000000000",
            b"10",
            b"{\"a\":1}",
            b"3",
            b"{}",
        ]
        .iter()
        .map(|b| b.to_vec())
        .collect();
        let journal = Journal::parse(&flat);
        assert_eq!(journal.produced(10), Some(Some(&b"{\"a\":1}"[..])));
        assert_eq!(journal.produced(11), Some(None), "covered, no record");
        assert_eq!(journal.produced(13), None, "not covered");
        assert_eq!(journal.newest_before(10), Some(1_700_000_000_000));
        assert_eq!(journal.newest_before(11), None);
        assert_eq!(journal.records.len(), 2, "owner is not a record");
    }
}
