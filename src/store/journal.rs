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
//! be flushed (the store holds them back until then), so whatever a next owner finds counted, it
//! also finds journaled. Partitions wait for their writes without the writer, and the journal
//! thread sends the writes handed to it meanwhile in one round trip.
//!
//! Fencing: the owner of a lane claims its journal with a fresh token; a write by an earlier
//! owner (a worker the broker already dropped from the group while it kept running) is refused,
//! and that worker drops the batch instead of producing it, and takes back what the batch
//! counted and the holds it raised (none of it was sent: the store held it back). So two workers
//! never deliver different records for one event, and the next owner judges each event against
//! exactly the events before it, even when a rebalance overlaps them.
//!
//! Claims are ranked (a generation above every earlier claim's, at least Redis' clock in ms), so
//! a claim lost with Redis' data (a restart without persistence, a failover to a replica that
//! never got it) does not stop its owner: its next write finds no claim, or an earlier one, and
//! sets it again; a write under an earlier claim is still refused once the later owner has
//! written. (Between the loss and the later owner's first write, an earlier owner still running
//! may write a batch.)
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
    batch: Batch,
    reply: mpsc::Sender<Result<Vec<Value>, StoreError>>,
}

/// At most this many calls go in one pipeline: the journal thread sends what partitions handed
/// it while the call before was out, in one round trip.
const CALLS_PER_ROUND_TRIP: usize = 64;

/// Claims and writes the journals of the lanes this worker owns, on its own connection and
/// thread: callers wait at most a connection plus a reply for each call. Callers wait for a
/// write without the writer ([`JournalWriter::begin_write`], [`JournalWrite::wait`],
/// [`JournalWriter::finish_write`]): the thread sends the writes of several partitions in one
/// round trip.
pub struct JournalWriter {
    jobs: Option<mpsc::Sender<Job>>,
    /// A call a caller stopped waiting for: until it comes back, calls fail at once.
    outstanding: Option<mpsc::Receiver<Result<Vec<Value>, StoreError>>>,
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

/// A journal call sent to the thread, not answered yet.
struct PendingCall {
    reply: mpsc::Receiver<Result<Vec<Value>, StoreError>>,
    deadline: Duration,
}

/// How a call's wait ended.
enum Waited {
    Answered(Result<Vec<Value>, StoreError>),
    /// No reply within the deadline: the call may still come back.
    TimedOut,
    Stopped,
}

impl PendingCall {
    /// Waits for the reply, at most the deadline (twice more if this process was stalled).
    fn wait(&self) -> Waited {
        let sent = Instant::now();
        let mut deadline = sent + self.deadline;
        let mut waited_again = false;
        loop {
            match self
                .reply
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(result) => return Waited::Answered(result),
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
                Err(mpsc::RecvTimeoutError::Timeout) => return Waited::TimedOut,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Waited::Stopped,
            }
        }
    }
}

/// A batch's journal write handed to the journal thread ([`JournalWriter::begin_write`]).
pub struct JournalWrite {
    lane: u64,
    call: PendingCall,
    records: Vec<i64>,
    mark: Option<i64>,
    trims: Vec<i64>,
    trimmed_marks: Vec<i64>,
}

/// What a journal write's wait brought ([`JournalWrite::wait`]).
pub struct JournalReply(Waited);

impl JournalWrite {
    /// Waits for Redis' answer, without the writer.
    pub fn wait(&self) -> JournalReply {
        JournalReply(self.call.wait())
    }
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
        std::thread::Builder::new()
            .name("vigil-journal".into())
            .spawn(move || {
                while let Ok(first) = job_rx.recv() {
                    // Whatever else is waiting goes in the same round trip.
                    let mut jobs = vec![first];
                    while jobs.len() < CALLS_PER_ROUND_TRIP {
                        match job_rx.try_recv() {
                            Ok(job) => jobs.push(job),
                            Err(_) => break,
                        }
                    }
                    let mut batch = Batch::default();
                    let mut calls = Vec::with_capacity(jobs.len());
                    for job in &mut jobs {
                        calls.push(job.batch.calls.len());
                        batch.append(std::mem::take(&mut job.batch), 0);
                    }
                    let (result, _) = link.query(&batch, 2);
                    let mut replies = result.map(Vec::into_iter);
                    for (job, calls) in jobs.into_iter().zip(calls) {
                        let reply = match &mut replies {
                            Ok(replies) => Ok(replies.by_ref().take(calls).collect()),
                            Err(e) => Err(e.clone()),
                        };
                        // A caller that stopped waiting dropped its receiver.
                        let _ = job.reply.send(reply);
                    }
                }
            })
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot start the journal thread: {e}"))
            })?;
        Ok(JournalWriter {
            jobs: Some(jobs),
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

    /// Runs one script call on the journal thread, waiting at most the deadline.
    fn call(&mut self, key: &str, cmd: redis::Cmd) -> Result<Value, StoreError> {
        let pending = self.send_call(key, cmd)?;
        let waited = pending.wait();
        self.settle_call(pending, waited)
    }

    /// Hands one call to the journal thread, unless Redis is known to be away or an earlier call
    /// is still out.
    fn send_call(&mut self, key: &str, cmd: redis::Cmd) -> Result<PendingCall, StoreError> {
        if self.outage.is_some() && !self.probe(key) {
            return Err(StoreError::Unavailable(
                "Redis did not answer the journal lately".into(),
            ));
        }
        if let Some(outstanding) = &self.outstanding {
            match outstanding.try_recv() {
                Err(mpsc::TryRecvError::Empty) => {
                    return Err(StoreError::Unavailable(
                        "an earlier journal call is still waiting for Redis".into(),
                    ))
                }
                _ => self.outstanding = None,
            }
        }
        let reply = self
            .hand_over(key, cmd)
            .ok_or_else(|| StoreError::Unavailable("the journal thread stopped".into()))?;
        Ok(PendingCall {
            reply,
            deadline: self.deadline,
        })
    }

    /// Hands `cmd` to the journal thread; `None` if it stopped.
    fn hand_over(
        &self,
        key: &str,
        cmd: redis::Cmd,
    ) -> Option<mpsc::Receiver<Result<Vec<Value>, StoreError>>> {
        let mut batch = Batch::default();
        batch.command(self.cluster, key, cmd);
        let (reply, receiver) = mpsc::channel();
        self.jobs.as_ref()?.send(Job { batch, reply }).ok()?;
        Some(receiver)
    }

    /// Takes in how a call's wait ended: its reply, or the outage it reveals.
    fn settle_call(&mut self, pending: PendingCall, waited: Waited) -> Result<Value, StoreError> {
        let result = match waited {
            Waited::Answered(result) => result,
            Waited::TimedOut => {
                self.outstanding = Some(pending.reply);
                Err(StoreError::Unavailable(format!(
                    "no reply from Redis within {:?}",
                    self.deadline
                )))
            }
            Waited::Stopped => Err(StoreError::Unavailable("the journal thread stopped".into())),
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
        if let Some(outstanding) = &self.outstanding {
            match outstanding.try_recv() {
                Err(mpsc::TryRecvError::Empty) => return false,
                Ok(result) => {
                    self.outstanding = None;
                    if result.is_ok() {
                        self.outage = None;
                        return true;
                    }
                }
                Err(mpsc::TryRecvError::Disconnected) => self.outstanding = None,
            }
        }
        if self
            .outage
            .is_some_and(|since| since.elapsed() >= self.probe_interval)
        {
            self.outage = Some(Instant::now());
            if let Some(receiver) = self.hand_over(key, redis::cmd("PING")) {
                self.outstanding = Some(receiver);
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
        // The writes name the owner value the claim set: its generation ranks this claim
        // against others if the hash is lost (`lua/journal.lua`).
        let owner = flat
            .chunks_exact(2)
            .find(|pair| pair[0] == b"owner")
            .and_then(|pair| String::from_utf8(pair[1].clone()).ok())
            .filter(|owner| {
                owner
                    .strip_suffix(token.as_str())
                    .is_some_and(|g| g.ends_with(' '))
            });
        let Some(token) = owner else {
            self.lanes.remove(&lane);
            self.unclaimed.insert(lane);
            return Err(StoreError::Protocol(
                "journal: the claim did not name this worker the owner".into(),
            ));
        };
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
        let write = self.begin_write(lane, batch)?;
        let reply = write.wait();
        self.finish_write(write, reply)
    }

    /// Hands the journal write of a batch of `lane` to the journal thread; the caller waits for
    /// it ([`JournalWrite::wait`]) without the writer, then hands the reply to
    /// [`JournalWriter::finish_write`].
    pub fn begin_write(
        &mut self,
        lane: u64,
        batch: &JournalBatch,
    ) -> Result<JournalWrite, JournalError> {
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
        let call = self.send_call(&key, cmd)?;
        Ok(JournalWrite {
            lane,
            call,
            records: batch.records.iter().map(|(offset, _)| *offset).collect(),
            mark: batch.mark.map(|(offset, _)| offset),
            trims,
            trimmed_marks,
        })
    }

    /// Takes in the reply to a write: `Fenced` if another worker owns the lane now.
    pub fn finish_write(
        &mut self,
        write: JournalWrite,
        reply: JournalReply,
    ) -> Result<(), JournalError> {
        let JournalWrite {
            lane,
            call,
            records,
            mark,
            trims,
            trimmed_marks,
        } = write;
        let fenced = match self.settle_call(call, reply.0)? {
            Value::BulkString(reply) => reply == b"fenced",
            Value::SimpleString(reply) => reply == "fenced",
            _ => false,
        };
        if fenced {
            return Err(JournalError::Fenced);
        }
        // Released meanwhile: nothing to remember of it.
        let Some(state) = self.lanes.get_mut(&lane) else {
            return Ok(());
        };
        state.held.extend(records);
        state.held_marks.extend(mark);
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
