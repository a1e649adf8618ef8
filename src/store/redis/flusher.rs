//! Writing behind: the flusher thread, and the store's side of it — which keys a flush carries
//! and in which script calls (batching), handing it over (sending), taking in its replies
//! (completing: the success and failure paths), and how far everything counted is in Redis
//! (the durable mark). Also taking back a batch another worker now owns.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use redis::Value;

use super::config::FlushSample;
use super::slices::Slices;
use super::view::{refresh_due, ttl_ms, Cached, Dirty};
use super::RedisStore;
use crate::clock::MonotonicClock;
use crate::store::codec::{self, KeyFlush, Observation, Offsets, Reply, Stored};
use crate::store::counter_store::{StoreError, WindowId};
use crate::store::keys::StoredKey;
use crate::store::link::{slot, Batch, Link, Op};
use crate::store::scripts::ScriptCall;
use crate::window::WindowState;

pub(super) const FLUSHER_STOPPED: &str = "the flusher thread stopped";

/// Keys served by one script call that a partition waits for (a step counted ahead). Bounded
/// so one call never blocks Redis for long.
pub(super) const KEYS_PER_CALL: usize = 256;

/// Keys served by one write-behind call at most. Redis runs one script at a time, and while a
/// flush runs the partitions' reads and journal writes (made under the engine lock) wait behind
/// the call running. Measured at 2 000 events/s, the backlog flushed (`vigil bench --kafka ...
/// --latency-rate 2000`): 256 keys per call (~7 ms of Redis) in pipelines of 16 calls held each
/// batch's round trips for 5-15 ms and vigil's own p99 at ~160 ms; 32 keys per call, one call
/// per round trip ([`Batch::paced`]), brought it to ~65 ms, with throughput and Redis CPU within
/// the spread. The flush's Redis time is the same; it adds a loopback round trip per call.
const FLUSH_KEYS_PER_CALL: usize = 32;

/// Keys served by one write-behind call at least: a flush with time to spare (see
/// [`keys_per_call`]) sends calls this small, so a journal write waits behind a shorter one.
const MIN_FLUSH_KEYS_PER_CALL: usize = 8;

/// What one paced call is allowed of a flush's time: a round trip and the script.
const CALL_TIME: Duration = Duration::from_micros(500);

/// Keys per call for a flush of `keys` keys due every `every`: the fewest (down to
/// `MIN_FLUSH_KEYS_PER_CALL`) whose calls, one per round trip at `CALL_TIME` each, fit in a
/// quarter of the interval; `FLUSH_KEYS_PER_CALL` when someone waits for the flush or it is
/// behind (`hurried`: a flush too large for one, its rest, or a full table).
/// A journal write (made under the engine lock) waits for the call Redis is running: at 2 000
/// events/s, with ~10 keys per call, the journal's p99 per batch fell by 1-13 % (BENCHMARKS.md).
fn keys_per_call(keys: usize, every: Duration, hurried: bool) -> usize {
    if hurried {
        return FLUSH_KEYS_PER_CALL;
    }
    let calls = ((every / 4).as_micros() / CALL_TIME.as_micros()).max(1);
    let calls = usize::try_from(calls).unwrap_or(usize::MAX);
    keys.div_ceil(calls)
        .clamp(MIN_FLUSH_KEYS_PER_CALL, FLUSH_KEYS_PER_CALL)
}

/// Most keys one flush carries: a re-seed after a data loss is spread over several flushes.
const MAX_FLUSH_KEYS: usize = 16_384;

/// A flush for the flusher thread: first the epoch checks, then, if no data loss showed, the
/// script calls.
pub(super) struct FlushJob {
    first: Batch,
    epochs: usize,
    known: Vec<Option<Vec<u8>>>,
    /// The failovers the store has taken in (`Link::promotions`).
    promotions: u64,
    scripts: Batch,
    attempts: u32,
}

/// What the flusher thread sends back for one flush.
struct FlushDone {
    /// The replies of the first phase, and of the scripts (`None`: not run, data loss seen).
    result: Result<(Vec<Value>, Option<Vec<Value>>), StoreError>,
    retries: u64,
    /// The failovers the link had seen when the flush ended.
    promotions: u64,
    /// A replica of every master confirmed every write so far (`Link::replicated`).
    replicated: bool,
}

/// The flush in flight: its keys, its batch's reply order, its observation count and when it
/// was sent.
struct Inflight {
    keys: Vec<StoredKey>,
    order: Vec<usize>,
    observations: usize,
    /// When it was sent (real time: the flush latency).
    sent: Instant,
    /// When it was sent by the store's clock: how fresh the TTL refreshes and hold replies it
    /// brings back are.
    sent_stamp: Instant,
    /// How many epoch checks the flush starts with.
    epochs: usize,
    /// The holds raised by this flush: their calls follow the epoch checks.
    holds: Vec<StoredKey>,
    /// The failovers the store had followed when it was sent.
    promotions: u64,
}

/// A flush being built: its keys, epoch checks and hold raises were picked when it began; its
/// keys' deltas are taken in flight and encoded a slice at a time.
struct Building {
    /// Keys not reached yet.
    candidates: std::vec::IntoIter<StoredKey>,
    /// Keys whose deltas are in flight and in `scripts`.
    keys: Vec<StoredKey>,
    scripts: Batch,
    observations: usize,
    first: Batch,
    epochs: usize,
    holds: Vec<StoredKey>,
    pace: Slices,
    /// Keys per script call ([`keys_per_call`]).
    keys_per_call: usize,
}

/// The keys of an answered flush still to take in, with their replies.
struct TakingIn {
    keys: std::vec::IntoIter<StoredKey>,
    replies: std::vec::IntoIter<codec::KeyReply>,
    /// When the flush was sent, by the store's clock.
    sent_stamp: Instant,
    /// Whether a replica confirmed the flush's writes.
    replicated: bool,
    /// Whether the deltas Redis took in are kept until a replica confirms them.
    keep: bool,
    first_error: Option<StoreError>,
    pace: Slices,
}

impl Flushing {
    /// Whether a flush is being built, in flight, or its keys are still being taken in.
    pub(super) fn busy(&self) -> bool {
        self.building.is_some() || self.inflight.is_some() || self.taking_in.is_some()
    }
}

/// The write-behind task: runs flushes on its own connection while the caller goes on.
fn flusher(mut link: Link, jobs: mpsc::Receiver<FlushJob>, done: mpsc::Sender<FlushDone>) {
    for job in jobs {
        let (first, mut retries) = link.query(&job.first, job.attempts);
        let result = first.and_then(|first| {
            // Compared here, before any script runs: after a data loss nothing is merged into
            // the emptied keys; the store writes its views again instead.
            let lost = first
                .iter()
                .take(job.epochs)
                .zip(&job.known)
                .any(|(reply, known)| match (reply, known) {
                    (_, None) => false,
                    (Value::Nil, Some(_)) => true,
                    (reply, Some(known)) => {
                        redis::from_redis_value::<Vec<u8>>(reply.clone())
                            .ok()
                            .as_ref()
                            != Some(known)
                    }
                });
            // A failover seen before the scripts (the epoch keys were replicated, the last
            // writes may not have been): handled like a changed epoch.
            let lost = lost || link.promotions() != job.promotions;
            if lost || job.scripts.is_empty() {
                return Ok((first, if lost { None } else { Some(Vec::new()) }));
            }
            let (scripts, more) = link.query(&job.scripts, job.attempts);
            retries += more;
            // A failover seen while the scripts ran: some may have answered from a promoted
            // replica that lacks earlier writes, so their windows are not taken in; the views
            // are written again instead (a rewrite replaces what those scripts wrote).
            if link.promotions() != job.promotions {
                return scripts.map(|_| (first, None));
            }
            scripts.map(|scripts| (first, Some(scripts)))
        });
        let replicated = link.replicated();
        if done
            .send(FlushDone {
                result,
                retries,
                promotions: link.promotions(),
                replicated,
            })
            .is_err()
        {
            return;
        }
    }
}

/// The store's side of the flusher thread.
pub(super) struct Flushing {
    /// `None` once the store is dropped: the thread ends with its channel.
    pub(super) jobs: Option<mpsc::Sender<FlushJob>>,
    done: mpsc::Receiver<FlushDone>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
    /// The flush in flight.
    inflight: Option<Inflight>,
    /// The flush being built, a slice per tick (see `build_some`).
    building: Option<Building>,
    /// The flush Redis answered whose keys are being taken in (see `take_in_some`): until the
    /// last is, no other flush is sent.
    taking_in: Option<TakingIn>,
    /// When the last flush was sent: the next is due a flush (or probe) interval later.
    last_flush: Instant,
    /// The flush round under way, if its last flush took `MAX_FLUSH_KEYS` keys and may have
    /// left some: the keys pending when it began (their oldest pending observation counted at or
    /// before this mark) go out back to back, so that none waits past its turn (the durable
    /// mark, and with it the Kafka offsets, waits for the oldest pending delta); keys counted
    /// since wait for the next round, so that each is written about once per interval.
    round: Option<u64>,
    /// Acknowledged flushes not yet taken by `take_flush_samples`.
    pub(super) samples: Vec<FlushSample>,
    /// The last flush failure not yet reported.
    pub(super) last_error: Option<StoreError>,
    /// Replies still to come for steps counted ahead that were given up on (they come before
    /// any later flush's).
    stray: u32,
}

impl Flushing {
    /// Starts the flusher thread on `link`.
    pub(super) fn start(link: Link) -> Result<Flushing, StoreError> {
        let (jobs, job_rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("vigil-flusher".into())
            .spawn(move || flusher(link, job_rx, done_tx))
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot start the flusher thread: {e}"))
            })?;
        Ok(Flushing {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            inflight: None,
            building: None,
            taking_in: None,
            last_flush: Instant::now(),
            round: None,
            samples: Vec::new(),
            last_error: None,
            stray: 0,
        })
    }
}

impl<C: MonotonicClock> RedisStore<C> {
    /// Takes in a finished flush and starts the next when one is due; waits for Redis only under
    /// backpressure while it answers. A failed flush is kept for `take_flush_error`, not returned:
    /// its deltas stay pending. Only a stopped flusher thread is an error.
    pub(super) fn write_behind(&mut self) -> Result<(), StoreError> {
        let mut result = self.complete(false);
        let outage = self.breaker.is_open();
        let interval = self.flush_every();
        let full = self.pending >= self.config.max_pending;
        let due = ((full || self.flushing.round.is_some()) && !outage)
            || self.flushing.last_flush.elapsed() >= interval;
        if due && !self.flushing.busy() {
            self.send(false)?;
        } else if !outage && self.pending >= self.config.max_pending.max(1).saturating_mul(2) {
            // Backpressure: Redis is slower than counting; wait for it rather than grow (a Redis
            // that stops answering meanwhile opens the breaker).
            result = result.and(self.complete(true));
            if !self.flushing.busy() {
                self.send(true)?;
            }
        }
        match result {
            Err(StoreError::Unavailable(m)) if m == FLUSHER_STOPPED => {
                Err(StoreError::Unavailable(m))
            }
            Err(e) => {
                self.flushing.last_error = Some(e);
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// How often a flush is due now.
    fn flush_every(&self) -> Duration {
        if self.breaker.is_open() {
            self.config.probe_interval
        } else if self.views.shared {
            self.config.flush_interval
        } else {
            // Nobody else counts into these keys: fewer, larger writes.
            self.config
                .exclusive_flush_interval
                .max(self.config.flush_interval)
        }
    }

    /// Waits for the flush in flight, then sends everything still pending and waits for it: on
    /// success Redis holds every delta counted so far but those of batches not journaled yet.
    /// Keys whose writes met another writer, or that were gone, come back pending and go again;
    /// a large re-seed takes several flushes.
    pub(super) fn flush_all(&mut self) -> Result<(), StoreError> {
        self.complete(true)?;
        // Whoever waits for everything to be in Redis also learns whether Redis lost it.
        self.epochs.due = true;
        loop {
            self.send(true)?;
            self.complete(true)?;
            // What batches not journaled yet counted waits for them.
            self.reap_journaled();
            if self.holds.pending == 0 && self.only_held_back_left() {
                self.update_durable();
                return Ok(());
            }
        }
    }

    /// Takes back the window deltas the batch counted for `lane` at offsets `since` and later.
    /// None of them has been sent (flushes hold back what a batch not journaled counted), so
    /// once the flush in flight is in, they are all pending, tagged with lane and offset. The
    /// rest is flushed.
    pub(super) fn take_back_batch(&mut self, lane: u64, since: i64) -> Result<(), StoreError> {
        let completed = self.complete(true);
        let fenced = |o: &Observation| {
            o.origin
                .is_some_and(|origin| origin.lane == lane && origin.offset >= since)
        };
        let (mut discarded, mut relearned) = (0, 0);
        let mut emptied = Vec::new();
        for (key, dirty) in self.views.dirty.iter_mut() {
            let before = dirty.pending.len();
            dirty.pending.retain(|o| !fenced(o));
            let removed = before - dirty.pending.len();
            if removed == 0 {
                continue;
            }
            self.pending -= removed;
            discarded += removed;
            if dirty.pending.is_empty() && dirty.inflight.is_empty() && !dirty.full {
                // Only the batch was unsent: the view is read again from Redis when needed.
                emptied.push(key.clone());
            } else {
                // Its view still holds the batch: with no known version, the next flush of the
                // rest brings back Redis' window, and the view becomes that plus what is pending.
                // (A key Redis lost is written from its view in full, batch included: after a
                // data loss the view is all there is.)
                dirty.pending_oldest = dirty.pending_oldest.filter(|_| !dirty.pending.is_empty());
                dirty.version = None;
                relearned += 1;
            }
        }
        for key in &emptied {
            self.views.dirty.remove(key);
            self.views.cache.invalidate(key);
        }
        tracing::warn!(
            discarded,
            dropped = emptied.len(),
            relearned,
            "counts of a batch another worker now owns taken back"
        );
        // The rest goes now, so that no view holds the batch longer than this call.
        completed.and(self.flush_all())
    }

    /// Script calls covering the in-flight deltas of `keys`, up to `keys_per_call` keys per
    /// call, sent one call per round trip; in cluster mode each call holds keys of one hash slot.
    fn batch(&self, keys: &[StoredKey], keys_per_call: usize) -> Batch {
        let mut batch = self.script_batch(
            keys,
            keys_per_call,
            |key| key,
            |key, call, name| {
                let dirty = &self.views.dirty[key];
                let spec = self.windows.spec(key.window);
                let flush = KeyFlush {
                    spec: &spec,
                    prefix: self.section(key.window),
                    ttl_ms: ttl_ms(&spec, self.config.max_lateness),
                    version: dirty.version,
                    refresh: dirty.refresh_sent,
                    state: &dirty.state,
                    base_head: dirty.base_head,
                    offsets: &dirty.offsets,
                    deltas: &dirty.inflight,
                    full: dirty.full,
                    before: false,
                };
                codec::add_key(call, name, &flush);
            },
        );
        batch.paced = true;
        batch
    }

    /// Script calls covering `keys` (each naming its key through `stored`, added to its call by
    /// `add`), up to `keys_per_call` keys per call; in cluster mode each call holds keys of one
    /// hash slot. The batch's order maps the calls' replies back to `keys`.
    pub(super) fn script_batch<K>(
        &self,
        keys: &[K],
        keys_per_call: usize,
        stored: impl Fn(&K) -> &StoredKey,
        mut add: impl FnMut(&K, &mut ScriptCall, &str),
    ) -> Batch {
        let mut groups: Vec<(u16, Vec<usize>, ScriptCall)> = Vec::new();
        let mut open: HashMap<u16, usize> = HashMap::new();
        let mut batch = Batch::default();
        // The windows of a shared hash are sections of one key: named (hashed) once.
        let (names, name_of) = self.unique_redis_keys(keys.iter().map(|key| {
            let stored = stored(key);
            (WindowId(stored.window), stored.key.as_slice())
        }));
        for ((index, key), &at) in keys.iter().enumerate().zip(&name_of) {
            let name = names[at].as_str();
            let group_slot = if self.cluster { slot(name) } else { 0 };
            let group = *open.entry(group_slot).or_insert_with(|| {
                groups.push((group_slot, Vec::new(), ScriptCall::default()));
                groups.len() - 1
            });
            add(key, &mut groups[group].2, name);
            groups[group].1.push(index);
            if groups[group].1.len() == keys_per_call {
                open.remove(&group_slot);
            }
        }
        for (group_slot, members, call) in groups {
            batch.order.extend(members);
            batch.calls.push(Op::Script(call));
            batch.slots.push(group_slot);
        }
        batch
    }

    /// Runs `scripts` on the flusher's link now, with no flush in flight, and waits for them
    /// (at most two read deadlines): their replies and whether a replica confirmed every write so
    /// far; `None` if a failover crossed them (what they wrote may be lost).
    pub(super) fn run_on_flusher(
        &mut self,
        scripts: Batch,
    ) -> Result<Option<(Vec<Value>, bool)>, StoreError> {
        debug_assert!(!self.flushing.busy());
        while self.flushing.stray > 0 {
            match self.flushing.done.try_recv() {
                Ok(_) => self.flushing.stray -= 1,
                Err(mpsc::TryRecvError::Empty) => {
                    return Err(StoreError::Unavailable(
                        "an earlier step counted ahead is still waiting for Redis".into(),
                    ))
                }
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(StoreError::Unavailable(FLUSHER_STOPPED.into()))
                }
            }
        }
        let promotions = self.epochs.promotions;
        let job = FlushJob {
            first: Batch::default(),
            epochs: 0,
            known: Vec::new(),
            promotions,
            scripts,
            attempts: self.config.attempts,
        };
        self.submit(job)?;
        // On the counting path: waited for no longer than a read (two attempts).
        let deadline = self.read_deadline().saturating_mul(2);
        let done = match self.flushing.done.recv_timeout(deadline) {
            Ok(done) => done,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // Its reply is skipped when it comes: the next `complete` must not take it for
                // its own. Meanwhile Redis is taken as unavailable.
                let error = StoreError::Unavailable(format!(
                    "counting ahead got no reply within {deadline:?}"
                ));
                self.flushing.stray += 1;
                return Err(error);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(StoreError::Unavailable(FLUSHER_STOPPED.into()))
            }
        };
        self.stats.retries += done.retries;
        let follow = done.promotions > self.epochs.promotions;
        if follow {
            self.epochs.promotions = done.promotions;
            self.follow_failover();
        }
        match done.result {
            Ok((_, Some(scripts))) if !follow && done.promotions == promotions => {
                Ok(Some((scripts, done.replicated)))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Flattens per-call replies back into the order the keys were given.
    pub(super) fn replies(
        &mut self,
        calls: Vec<Value>,
        order: &[usize],
    ) -> Result<Vec<codec::KeyReply>, StoreError> {
        self.stats.script_calls += calls.len() as u64;
        let mut flat = Vec::with_capacity(order.len());
        for call in calls {
            flat.extend(codec::key_replies(call)?);
        }
        if flat.len() != order.len() {
            return Err(StoreError::Protocol(format!(
                "{} replies for {} keys",
                flat.len(),
                order.len()
            )));
        }
        let mut replies = vec![Vec::new(); order.len()];
        for (reply, &index) in flat.into_iter().zip(order) {
            replies[index] = reply;
        }
        Ok(replies)
    }

    /// Hands `job` to the flusher thread.
    fn submit(&self, job: FlushJob) -> Result<(), StoreError> {
        let jobs = self
            .flushing
            .jobs
            .as_ref()
            .expect("the flusher runs until drop");
        jobs.send(job)
            .map_err(|_| StoreError::Unavailable(FLUSHER_STOPPED.into()))
    }

    /// Starts a flush: picks up to `MAX_FLUSH_KEYS` keys with pending deltas, and the epoch
    /// checks and hold raises due; then takes the keys' deltas in flight and encodes them a
    /// slice per tick (`build_some`), or at once if `all`. The flush goes to the flusher thread
    /// when the last key is in it.
    fn send(&mut self, all: bool) -> Result<(), StoreError> {
        debug_assert!(!self.flushing.busy());
        self.reap_journaled();
        self.flushing.last_flush = Instant::now();
        // The rest of a flush too large for one, or a full table: Redis is the bound, calls large.
        let behind = self.flushing.round.is_some() || self.pending >= self.config.max_pending;
        let round = *self.flushing.round.get_or_insert(self.counted);
        let keys: Vec<StoredKey> = self
            .views
            .dirty
            .iter()
            .filter(|(_, d)| {
                d.full || (!d.pending.is_empty() && d.pending_oldest.is_none_or(|o| o <= round))
            })
            .map(|(k, _)| k.clone())
            .take(MAX_FLUSH_KEYS)
            .collect();
        self.flushing.round = (keys.len() == MAX_FLUSH_KEYS).then_some(round);
        if keys.is_empty() && self.pending == 0 && self.holds.pending == 0 {
            // Nothing pending and nothing in flight: everything counted is in Redis (and durable
            // once a replica has confirmed it).
            self.update_durable();
            // Idle: the epoch is still checked, but only once per probe interval.
            if !self.epochs.due && self.epochs.last_check.elapsed() < self.config.probe_interval {
                return Ok(());
            }
        }
        // The epoch is checked once per probe interval (and on every flush while Redis is away):
        // a round trip before the scripts. In between, a key lost at a version this process knew
        // is still caught by the script ("?").
        let mut first = Batch::default();
        let check_epochs = self.epochs.due
            || self.breaker.is_open()
            || self.epochs.last_check.elapsed() >= self.config.probe_interval;
        if check_epochs {
            self.epochs.due = false;
            self.epochs.last_check = Instant::now();
            self.epochs.add_checks(&mut first, self.cluster);
        }
        let epochs = if check_epochs {
            self.epochs.keys.len()
        } else {
            0
        };
        // Hold raises go with the epoch checks: one round trip before the scripts. Taken now,
        // between batches, as the keys' deltas are taken at each slice.
        let holds = self.send_holds(&mut first);
        let keys_per_call = keys_per_call(
            keys.len(),
            self.flush_every(),
            all || behind || keys.len() == MAX_FLUSH_KEYS,
        );
        let pace = Slices::new(
            keys.len(),
            self.flush_every() / 4,
            self.config.tick_budget,
            Instant::now(),
        );
        self.flushing.building = Some(Building {
            candidates: keys.into_iter(),
            keys: Vec::new(),
            scripts: Batch::default(),
            observations: 0,
            first,
            epochs,
            holds,
            pace,
            keys_per_call,
        });
        self.build_some(all)
    }

    /// Takes the next keys' deltas in flight and encodes them into the flush being built (all
    /// of them if `all`), a call's worth of keys at a time; hands the flush to the flusher
    /// thread once every key is in it. Deltas of batches not journaled yet (which may still be
    /// taken back) stay pending.
    fn build_some(&mut self, all: bool) -> Result<(), StoreError> {
        let Some(mut building) = self.flushing.building.take() else {
            return Ok(());
        };
        building.pace.begin_tick(Instant::now());
        let now = self.clock.now();
        let mut slice = Vec::with_capacity(building.keys_per_call);
        loop {
            let next = (all || building.pace.more(Instant::now()))
                .then(|| building.candidates.next())
                .flatten();
            let stop = next.is_none();
            if let Some(key) = next {
                let spec = self.windows.spec(key.window);
                let dirty = self
                    .views
                    .dirty
                    .get_mut(&key)
                    .expect("listed when the flush began");
                let batches = &self.batches;
                let held = if batches.is_empty() {
                    0
                } else {
                    dirty
                        .pending
                        .iter()
                        .filter(|o| batches.holds_back(o.origin))
                        .count()
                };
                if held == 0 {
                    self.pending -= dirty.pending.len();
                    // A key counted often will be again as often: its next deltas go into the
                    // list the last flush sent, emptied when Redis acknowledged it, or into one
                    // with room for as many — not into a fresh one doubling its way there (each
                    // doubling a copy, and a large one fresh pages the kernel zeroes). A list
                    // far larger than this flush needed is let go.
                    let sent = dirty.pending.len();
                    debug_assert!(dirty.inflight.is_empty(), "a key is in one flush at a time");
                    std::mem::swap(&mut dirty.inflight, &mut dirty.pending);
                    let room = if sent >= 16 { sent } else { 0 };
                    let spare = dirty.pending.capacity();
                    if spare < room || spare > 2 * sent.max(16) {
                        dirty.pending = Vec::with_capacity(room);
                    }
                    dirty.inflight_oldest = dirty.pending_oldest.take();
                } else if held == dirty.pending.len() || dirty.full {
                    if dirty.full || dirty.version.is_some() {
                        // All of it a batch's not journaled yet (or a view to write again in
                        // full, which holds that batch): it waits for the batch.
                        continue;
                    }
                    // A view that lost track of Redis (deltas of a fenced batch were taken
                    // out of it): the call only reads, and the reply's window, with what is
                    // held back applied over it, becomes the view.
                } else {
                    let (held_back, sendable): (Vec<_>, Vec<_>) =
                        std::mem::take(&mut dirty.pending)
                            .into_iter()
                            .partition(|o| batches.holds_back(o.origin));
                    self.pending -= sendable.len();
                    dirty.inflight = sendable;
                    dirty.inflight_oldest = dirty.pending_oldest;
                    dirty.pending = held_back;
                    dirty.pending_oldest = batches.oldest_index();
                    // The view holds what is held back: its fields are not what Redis should
                    // hold next. The script merges the deltas, and its reply brings the window.
                    dirty.version = None;
                }
                dirty.sent_head = dirty.state.head();
                dirty.refresh_sent = refresh_due(&spec, dirty.version, dirty.refreshed, now);
                building.observations += dirty.inflight.len();
                building.pace.did_one();
                slice.push(key);
            }
            // A call's worth at a time, and what the tick took when it stops.
            if slice.len() == building.keys_per_call || (stop && !slice.is_empty()) {
                let calls = self.batch(&slice, building.keys_per_call);
                building.scripts.append(calls, building.keys.len());
                building.keys.append(&mut slice);
            }
            if stop {
                break;
            }
        }
        if building.candidates.len() > 0 {
            self.flushing.building = Some(building);
            return Ok(());
        }
        self.submit_built(building)
    }

    /// Hands the flush built so far to the flusher thread; keys not reached yet keep their
    /// deltas pending, for the next flush.
    fn submit_built(&mut self, building: Building) -> Result<(), StoreError> {
        let Building {
            keys,
            mut scripts,
            observations,
            first,
            epochs,
            holds,
            ..
        } = building;
        scripts.confirm = true;
        scripts.paced = true;
        let order = scripts.order.clone();
        let job = FlushJob {
            first,
            epochs,
            known: self.epochs.known.clone(),
            promotions: self.epochs.promotions,
            scripts,
            attempts: self.config.attempts,
        };
        self.submit(job)?;
        let (sent, sent_stamp) = (Instant::now(), self.clock.now());
        let promotions = self.epochs.promotions;
        self.flushing.inflight = Some(Inflight {
            keys,
            order,
            observations,
            sent,
            sent_stamp,
            epochs,
            holds,
            promotions,
        });
        Ok(())
    }

    /// The longest the caller waits for a flush: every attempt's connection and reply, twice
    /// (a flush has two round trips).
    fn flush_deadline(&self) -> Duration {
        (self.config.connect_timeout + self.config.response_timeout)
            .saturating_mul(2 * self.config.attempts.max(1))
    }

    /// Takes in the flush in flight: waits for it if `wait` (at most `flush_deadline`: Redis is
    /// then taken as unavailable, and the flush is taken in whenever it ends), else only if it
    /// is already done. A flush being built goes on a slice (see `build_some`), or goes as it
    /// is if `wait`; its keys are taken in a slice per call unless `wait`, which takes them
    /// all (see `take_in_some`).
    pub(super) fn complete(&mut self, wait: bool) -> Result<(), StoreError> {
        if self.flushing.taking_in.is_some() {
            return self.take_in_some(wait);
        }
        if let Some(building) = self.flushing.building.take() {
            if !wait {
                self.flushing.building = Some(building);
                return self.build_some(false);
            }
            // Whoever waits may be in a batch: what is built goes as it is.
            self.submit_built(building)?;
        }
        let Some(done) = self.receive_flush(wait)? else {
            return Ok(());
        };
        let inflight = self.flushing.inflight.take().expect("checked above");
        self.stats.retries += done.retries;
        match done.result {
            Ok((first, mut scripts)) => {
                // A flush that crossed a failover (met one, or was sent before the store followed
                // one) is not taken in: its deltas go again, to the master there is now.
                if done.promotions != inflight.promotions
                    || inflight.promotions != self.epochs.promotions
                {
                    scripts = None;
                }
                let follow = done.promotions > self.epochs.promotions;
                if follow {
                    self.epochs.promotions = done.promotions;
                }
                self.flush_answered(inflight, &first, scripts, done.replicated, follow)?;
                self.take_in_some(wait)
            }
            Err(e) => Err(self.flush_failed(&inflight, e)),
        }
    }

    /// What the flusher says of the flush in flight (`None`: no flush in flight, or not done
    /// and not waited for). Waiting past `flush_deadline` opens the breaker.
    fn receive_flush(&mut self, wait: bool) -> Result<Option<FlushDone>, StoreError> {
        if self.flushing.inflight.is_none() {
            return Ok(None);
        }
        loop {
            let done = self.receive_done(wait)?;
            if done.is_some() && self.flushing.stray > 0 {
                // The late reply of a step counted ahead that was given up on.
                self.flushing.stray -= 1;
                continue;
            }
            return Ok(done);
        }
    }

    /// The next reply of the flusher thread, waited for if `wait` (see `receive_flush`).
    fn receive_done(&mut self, wait: bool) -> Result<Option<FlushDone>, StoreError> {
        if wait {
            match self.flushing.done.recv_timeout(self.flush_deadline()) {
                Ok(done) => Ok(Some(done)),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let error = StoreError::Unavailable(format!(
                        "a flush got no reply within {:?}",
                        self.flush_deadline()
                    ));
                    self.fail(&error, "flushing");
                    Err(error)
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    Err(StoreError::Unavailable(FLUSHER_STOPPED.into()))
                }
            }
        } else {
            match self.flushing.done.try_recv() {
                Ok(done) => Ok(Some(done)),
                Err(mpsc::TryRecvError::Empty) => Ok(None),
                Err(mpsc::TryRecvError::Disconnected) => {
                    Err(StoreError::Unavailable(FLUSHER_STOPPED.into()))
                }
            }
        }
    }

    /// The failure path: the flush failed after every attempt. Its deltas and hold raises go
    /// again with the next one, and Redis is taken as unavailable.
    fn flush_failed(&mut self, inflight: &Inflight, error: StoreError) -> StoreError {
        self.unsent_holds(&inflight.holds);
        self.unsent(&inflight.keys);
        self.stats.failed_flushes += 1;
        self.fail(&error, "flushing");
        error
    }

    /// The success path: Redis answered. First the epoch checks (after a data loss nothing of
    /// the flush was written: every view is written again), then the hold raises, then each key.
    fn flush_answered(
        &mut self,
        inflight: Inflight,
        first: &[Value],
        scripts: Option<Vec<Value>>,
        replicated: bool,
        follow: bool,
    ) -> Result<(), StoreError> {
        let Inflight {
            keys,
            order,
            observations,
            sent,
            sent_stamp,
            epochs,
            holds,
            ..
        } = inflight;
        self.recovered();
        let lost = match self.epochs.check(&first[..epochs.min(first.len())]) {
            Ok(lost) => lost,
            Err(e) => {
                self.unsent_holds(&holds);
                self.unsent(&keys);
                return Err(e);
            }
        };
        if let Err(e) =
            self.acknowledge_holds(&holds, first.get(epochs..).unwrap_or_default(), sent_stamp)
        {
            self.flushing.last_error = Some(e);
        }
        if lost {
            // Nothing of this flush's deltas was written: they go again, over views written
            // again in full.
            self.unsent(&keys);
            self.reseed();
            return Ok(());
        }
        let Some(scripts) = scripts else {
            // A failover: this flush's deltas go again (what of them the old master applied is
            // skipped by their positions), with whatever no replica had confirmed.
            self.unsent(&keys);
            if follow {
                self.follow_failover();
            }
            return Ok(());
        };
        let replies = match self.replies(scripts, &order) {
            Ok(replies) => replies,
            Err(e) => {
                // Not applied (or not known to be): the deltas go back in front of what was
                // counted since, and the next flush sends them again (they are tagged: the
                // script skips what it applied).
                self.unsent(&keys);
                self.stats.failed_flushes += 1;
                return Err(e);
            }
        };
        self.record_flush(FlushSample {
            keys: keys.len(),
            observations,
            elapsed: sent.elapsed(),
        });
        // Redis ran every call: each key's in-flight deltas are done unless its writes were
        // refused as stale or the key was gone. A reply we cannot read only costs the cached copy.
        // Until a replica confirms them, the deltas Redis took in are kept for a failover.
        let keep = !replicated && self.config.replica_ack_timeout.is_some();
        let (budget, every) = (self.config.tick_budget, self.flush_every());
        self.views.cache.age(every / 2, budget);
        let pace = Slices::new(keys.len(), every / 4, budget, Instant::now());
        self.flushing.taking_in = Some(TakingIn {
            keys: keys.into_iter(),
            replies: replies.into_iter(),
            sent_stamp,
            replicated,
            keep,
            first_error: None,
            pace,
        });
        Ok(())
    }

    /// Takes in the next keys of the flush Redis answered, all of them if `all`; once the last
    /// is in, the flush is done: a replica's confirmation and the durable mark are taken in,
    /// and the first key that failed is returned. Until then its keys stay in flight, as they
    /// were while Redis had them, and what is counted into them meanwhile stays pending.
    fn take_in_some(&mut self, all: bool) -> Result<(), StoreError> {
        let Some(mut taking) = self.flushing.taking_in.take() else {
            return Ok(());
        };
        taking.pace.begin_tick(Instant::now());
        while all || taking.pace.more(Instant::now()) {
            let (Some(key), Some(reply)) = (taking.keys.next(), taking.replies.next()) else {
                break;
            };
            taking.pace.did_one();
            let written = taking.keep.then(|| {
                let dirty = &self.views.dirty[&key];
                (key.clone(), dirty.inflight.clone(), dirty.inflight_oldest)
            });
            match self.take_in_reply(key, &reply, taking.sent_stamp) {
                // Written again with the next flush (and kept when that one is taken in).
                Ok(false) => {}
                result => {
                    if let Some((key, observations, oldest)) = written {
                        self.keep_unconfirmed(key, observations, oldest);
                    }
                    if let Err(e) = result {
                        taking.first_error.get_or_insert(e);
                    }
                }
            }
        }
        if taking.keys.len() > 0 && taking.replies.len() > 0 {
            self.flushing.taking_in = Some(taking);
            return Ok(());
        }
        if taking.replicated {
            self.confirmed();
        }
        self.update_durable();
        taking.first_error.map_or(Ok(()), Err)
    }

    /// Counts an acknowledged flush and keeps its sample.
    fn record_flush(&mut self, sample: FlushSample) {
        self.stats.flushes += 1;
        self.flushing.samples.push(sample);
        if self.flushing.samples.len() > 4096 {
            // Nobody takes them (replay): keep the newest only.
            self.flushing.samples.drain(..2048);
        }
    }

    /// Takes in Redis' reply for one key of the flush (sent at `sent` by the store's clock). The
    /// key's state becomes the window Redis now holds plus what was counted since; a key whose
    /// writes met another writer, or that was gone, goes again (`Ok(false)`: its deltas were not
    /// written). An unreadable reply keeps the view, with no known version, and is returned.
    fn take_in_reply(
        &mut self,
        key: StoredKey,
        reply: &codec::KeyReply,
        sent: Instant,
    ) -> Result<bool, StoreError> {
        let spec = self.windows.spec(key.window);
        let parsed = codec::parse_reply(&spec, reply);
        if let Ok((_, counts)) = &parsed {
            self.stats.refused_late += counts.late;
            self.stats.skipped_applied += counts.skipped;
        }
        match parsed {
            Ok((Reply::Stale, _)) => {
                self.write_stale_again(&key);
                return Ok(false);
            }
            Ok((Reply::Missing, _)) => {
                self.write_missing_again(&key);
                return Ok(false);
            }
            _ => {}
        }
        let dirty = self
            .views
            .dirty
            .remove(&key)
            .expect("in flight keys stay dirty");
        // Conservative: the refresh happened after the flush was sent.
        let refreshed = if dirty.refresh_sent || dirty.full {
            Some(sent)
        } else {
            dirty.refreshed
        };
        let mut result = Ok(());
        let (state, version, base_head, offsets) = match parsed {
            // Nobody else wrote since our view: it already holds the in-flight deltas and
            // those counted since, exactly as Redis now does plus what it has not seen.
            Ok((Reply::Current { version }, _)) => {
                let mut offsets = dirty.offsets;
                for origin in dirty.inflight.iter().filter_map(|o| o.origin) {
                    codec::raise(&mut offsets, origin.lane, origin.offset);
                }
                (dirty.state, Some(version), dirty.sent_head, offsets)
            }
            Ok((reply @ (Reply::Window(_) | Reply::Empty), _)) => {
                // The window as Redis has it now, plus what was counted since it was sent.
                let Stored {
                    mut state,
                    version,
                    offsets,
                } = match reply {
                    Reply::Window(stored) => stored,
                    _ => Stored {
                        state: WindowState::new(spec.aggregate),
                        version: 0,
                        offsets: Offsets::new(),
                    },
                };
                let base_head = state.head();
                // What was counted meanwhile at or below an offset Redis recorded was applied
                // by another writer of its lane (a zombie and the partition's new owner, a
                // restart after an outage): not counted into the view again — it would hold it
                // twice, and the next write computed from it would too. It stays pending: the
                // next flush sends it and the script skips it, so a failover that loses the
                // other writer's write still finds it among the writes no replica confirmed.
                for o in &dirty.pending {
                    if !codec::replayed(&offsets, o.origin) {
                        o.apply_to(&mut state, &spec);
                    }
                }
                (state, Some(version), base_head, offsets)
            }
            Ok((Reply::Stale | Reply::Missing, _)) => unreachable!("handled above"),
            Ok((Reply::Before(_), _)) => {
                // Only a call counting ahead asks for it: keep our own merged view, as for a
                // reply we cannot read.
                result = Err(StoreError::Protocol(
                    "apply_window reply: a prior window for a flush".into(),
                ));
                (dirty.state, None, None, dirty.offsets)
            }
            Err(e) => {
                // Keep our own merged view, which already holds every delta; with no known
                // version the next flush asks for the whole window.
                result = Err(e);
                (dirty.state, None, None, dirty.offsets)
            }
        };
        self.views.learn(key.window, &offsets, || {
            super::view::several_observations(&spec, &state)
        });
        if dirty.pending.is_empty() {
            self.views.cache.acknowledged(
                key,
                Arc::new(Cached {
                    state,
                    version,
                    refreshed,
                    offsets,
                }),
            );
        } else {
            let mut again = Dirty::new(state, version, base_head, refreshed, offsets);
            again.pending = dirty.pending;
            // Emptied, it takes the next flush's deltas (see `build_some`).
            again.inflight = dirty.inflight;
            again.inflight.clear();
            again.pending_oldest = dirty.pending_oldest;
            self.views.dirty.insert(key, again);
        }
        result.map(|()| true)
    }

    /// The key's writes met a version another writer had moved on.
    fn write_stale_again(&mut self, key: &StoredKey) {
        let dirty = self
            .views
            .dirty
            .get_mut(key)
            .expect("in flight keys stay dirty");
        if dirty.full && dirty.inflight.is_empty() && dirty.pending.is_empty() {
            // A view written again in full found the key re-created by someone else: theirs
            // stands, ours is read again when needed (and an early read planned before is not
            // taken in: it may be older than theirs).
            self.views.dirty.remove(key);
            self.views.cache.invalidate(key);
            return;
        }
        // Another writer moved the key on: send the deltas to be merged, and learn its window
        // from that reply.
        self.pending += dirty.inflight.len();
        dirty.send_again();
        dirty.version = None;
        dirty.full = false;
        self.stats.stale_writes += 1;
    }

    /// The key is gone at a version we knew: write the view again (its deltas were not applied).
    fn write_missing_again(&mut self, key: &StoredKey) {
        let dirty = self
            .views
            .dirty
            .get_mut(key)
            .expect("in flight keys stay dirty");
        self.pending += dirty.inflight.len();
        dirty.send_again();
        dirty.rewrite();
        self.stats.lost_keys += 1;
    }

    /// Durable: everything counted before the oldest observation Redis has not acknowledged.
    pub(super) fn update_durable(&mut self) {
        let holds = self.holds.views.values().filter_map(|h| {
            h.inflight
                .into_iter()
                .chain(h.pending)
                .map(|(_, index)| index)
                .min()
        });
        // What no replica has confirmed is not durable yet: a failover would need it again.
        let oldest = self
            .views
            .dirty
            .values()
            .filter_map(|d| d.inflight_oldest.into_iter().chain(d.pending_oldest).min())
            .chain(holds)
            .chain(self.batches.oldest_index())
            .chain(self.unconfirmed.oldest)
            .min();
        self.durable = oldest.map_or(self.counted, |oldest| oldest - 1);
    }

    /// The flush of `keys` did not happen (or is not known to have): their deltas go again with
    /// the next one.
    fn unsent(&mut self, keys: &[StoredKey]) {
        for key in keys {
            let dirty = self
                .views
                .dirty
                .get_mut(key)
                .expect("in flight keys stay dirty");
            self.pending += dirty.inflight.len();
            dirty.send_again();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{keys_per_call, FLUSH_KEYS_PER_CALL, MIN_FLUSH_KEYS_PER_CALL};

    #[test]
    fn a_flush_with_time_to_spare_sends_small_calls_and_a_large_or_awaited_one_large_calls() {
        let second = Duration::from_secs(1);
        let shared = Duration::from_millis(50);
        // A second's write-behind of 2 000 events/s: 500 calls fit in a quarter of it.
        assert_eq!(keys_per_call(100, second, false), MIN_FLUSH_KEYS_PER_CALL);
        assert_eq!(keys_per_call(5_000, second, false), 10);
        assert_eq!(keys_per_call(16_384, second, false), FLUSH_KEYS_PER_CALL);
        // Every 50 ms: 25 calls.
        assert_eq!(keys_per_call(250, shared, false), 10);
        assert_eq!(keys_per_call(2_000, shared, false), FLUSH_KEYS_PER_CALL);
        // Someone waits for it, or the write-behind is behind: as few round trips as possible.
        assert_eq!(keys_per_call(100, second, true), FLUSH_KEYS_PER_CALL);
        // An interval shorter than a call still gives a call.
        assert_eq!(
            keys_per_call(1, Duration::ZERO, false),
            MIN_FLUSH_KEYS_PER_CALL
        );
    }
}
