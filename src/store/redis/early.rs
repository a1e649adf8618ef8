//! Reads made for a batch before it takes the engine. The windows a batch will need and this
//! process has no view of are listed under the engine ([`RedisStore::plan_early_reads`]), read
//! from Redis while the engine is free for other partitions ([`EarlyReader::read`]: its own
//! connection and thread), and taken in under the engine before the batch is counted
//! ([`RedisStore::take_early_reads`]). A partition loop then waits for Redis without holding
//! up the others.
//!
//! A window read this way may be older than what this process knows by the time it is taken in:
//! another partition's batch may have counted into the key, and its flush completed, meanwhile.
//! So a read is taken in only for a key that still has no view at all and whose view did not
//! come and go since the read was planned: the clean views record every key they take in from a
//! flush or drop while early reads are out ([`super::view::CleanViews::watch`]). What is
//! not taken in is read again under the engine by the batch's prefetch, as before; nothing here
//! decides a value on its own.

use std::hash::BuildHasher;
use std::sync::mpsc;
use std::time::Duration;

use redis::Value;

use super::holds::EarlyHoldReads;
use super::view::{CacheCheck, Layout};
use super::RedisStore;
use crate::clock::MonotonicClock;
use crate::store::codec::{self, Stored};
use crate::store::counter_store::{StoreError, WindowId};
use crate::store::keys::{KeyBytes, KeyRef, StoredKey};
use crate::store::link::{Batch, Link};
use crate::window::WindowSpec;

/// Windows to read for a batch before it takes the engine.
pub struct EarlyReads {
    keys: Vec<StoredKey>,
    /// By key: its hash's read in `batch` (the windows of a shared hash share one).
    reply_of: Vec<usize>,
    batch: Batch,
    /// The clean views' generation when planned: all of them dropped since voids the reads.
    generation: u64,
    /// Hashes of the keys the plan found with a clean view (alone only), handed to the
    /// prefetch that follows the take-in: carried here, not left in the store, because another
    /// partition may plan and prefetch in between (a worker releases the engine while it reads).
    cached_at_plan: hashbrown::HashSet<u64, foldhash::fast::RandomState>,
    /// By key: its window's shape and its section of the hash, to decode the replies with
    /// ([`EarlyReads::decode`]).
    shapes: Vec<(WindowSpec, Layout)>,
}

/// What came back for [`EarlyReads`], decoded: by key, its window as Redis holds it (`None`: its
/// hash's reply did not decode, and the prefetch reads it again and says why); or why nothing
/// came back.
pub struct EarlyReplies(Result<Vec<Option<Stored>>, StoreError>);

impl EarlyReplies {
    /// Nothing came back.
    pub fn failed(error: StoreError) -> EarlyReplies {
        EarlyReplies(Err(error))
    }

    /// Whether the replies came back (a window whose hash did not decode aside).
    pub fn is_ok(&self) -> bool {
        self.0.is_ok()
    }

    /// How many windows decoded.
    pub fn decoded(&self) -> usize {
        self.0
            .as_ref()
            .map_or(0, |windows| windows.iter().flatten().count())
    }
}

impl std::fmt::Debug for EarlyReplies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Ok(windows) => write!(f, "{} of {} windows decoded", self.decoded(), windows.len()),
            Err(e) => write!(f, "failed: {e}"),
        }
    }
}

impl EarlyReads {
    /// Decodes the replies of the read, window by window. Needs neither the store nor the
    /// engine: a partition loop decodes them before it takes the engine, so that the engine's
    /// time per batch is only the take-in.
    pub fn decode(&self, replies: Result<Vec<Value>, StoreError>) -> EarlyReplies {
        let replies = match replies {
            Ok(replies) if self.reply_of.iter().all(|&at| at < replies.len()) => replies,
            Ok(_) => {
                return EarlyReplies::failed(StoreError::Protocol(
                    "fewer replies than reads".into(),
                ))
            }
            Err(e) => return EarlyReplies::failed(e),
        };
        let hashes: Vec<Option<Vec<Vec<u8>>>> = replies
            .into_iter()
            .map(|reply| codec::flat(reply).ok())
            .collect();
        let windows = self
            .reply_of
            .iter()
            .zip(&self.shapes)
            .map(|(&at, (spec, layout))| {
                let hash = hashes[at].as_ref()?;
                codec::decode_section(spec, layout.prefix(), hash).ok()
            })
            .collect();
        EarlyReplies(Ok(windows))
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

struct Job {
    batch: Batch,
    attempts: u32,
    reply: mpsc::SyncSender<Result<Vec<Value>, StoreError>>,
}

/// Reads [`EarlyReads`] on a connection of its own, without the store; any thread may use it.
#[derive(Clone)]
pub struct EarlyReader {
    jobs: mpsc::Sender<Job>,
    /// Jobs sent and not answered yet.
    outstanding: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The longest a read is waited for (as the store waits for its own reads).
    deadline: Duration,
    attempts: u32,
}

impl EarlyReader {
    /// The replies, one per key, or why there are none: the batch's prefetch then reads the
    /// keys itself (and deals with Redis being away).
    pub fn read(&self, reads: &mut EarlyReads) -> Result<Vec<Value>, StoreError> {
        self.start(reads)?.wait()
    }

    /// Sends the read of `reads` and returns at once: the caller counts something else
    /// meanwhile and waits for the replies when it needs them.
    pub fn start(&self, reads: &mut EarlyReads) -> Result<PendingRead, StoreError> {
        self.send(std::mem::take(&mut reads.batch))
    }

    /// Sends the hold reads of `reads` and returns at once.
    pub fn start_holds(&self, reads: &mut EarlyHoldReads) -> Result<PendingRead, StoreError> {
        self.send(reads.take_batch())
    }

    /// Sends `batch` (reads only) and returns at once.
    pub(super) fn send(&self, batch: Batch) -> Result<PendingRead, StoreError> {
        let (reply, replies) = mpsc::sync_channel(1);
        let job = Job {
            batch,
            attempts: self.attempts,
            reply,
        };
        self.outstanding
            .fetch_add(1, std::sync::atomic::Ordering::Acquire);
        self.jobs
            .send(job)
            .map_err(|_| StoreError::Unavailable("the early reader stopped".into()))?;
        Ok(PendingRead {
            replies,
            deadline: self.deadline,
        })
    }

    /// Whether every job sent was answered.
    pub(super) fn idle(&self) -> bool {
        self.outstanding.load(std::sync::atomic::Ordering::Acquire) == 0
    }
}

/// An early read on its way ([`EarlyReader::start`]).
pub struct PendingRead {
    replies: mpsc::Receiver<Result<Vec<Value>, StoreError>>,
    deadline: Duration,
}

impl PendingRead {
    /// The replies if they are back already, without waiting (`None`: not yet).
    pub(super) fn ready(&self) -> Option<Result<Vec<Value>, StoreError>> {
        self.replies.try_recv().ok()
    }

    /// The replies, waited for at most the reader's deadline from now.
    pub fn wait(self) -> Result<Vec<Value>, StoreError> {
        match self.replies.recv_timeout(self.deadline) {
            Ok(result) => result,
            Err(_) => Err(StoreError::Unavailable(format!(
                "no early read reply within {:?}",
                self.deadline
            ))),
        }
    }
}

/// The early reader's thread: one job at a time on its own connection. A job whose caller
/// stopped waiting is still answered into its dropped channel.
fn early_reader(
    mut link: Link,
    jobs: mpsc::Receiver<Job>,
    outstanding: &std::sync::atomic::AtomicUsize,
) {
    for job in jobs {
        let (result, _) = link.query(&job.batch, job.attempts);
        // Answered before the reply goes: whoever receives it finds the reader idle.
        outstanding.fetch_sub(1, std::sync::atomic::Ordering::Release);
        let _ = job.reply.send(result);
    }
}

impl<C: MonotonicClock> RedisStore<C> {
    /// A reader for [`EarlyReads`], on a connection opened at the first call. `None` while Redis
    /// is unavailable.
    pub fn early_reader(&mut self) -> Option<EarlyReader> {
        if self.breaker.is_open() {
            return None;
        }
        if self.early.is_none() {
            self.early = self.open_early_reader("vigil-early");
        }
        self.early.clone()
    }

    /// The reader of holds sent ahead: a connection of its own, so that a batch's few hold
    /// reads never wait behind the next batch's many window reads (nothing waits for it: a read
    /// not back in time is left, see `holds.rs`).
    pub fn early_hold_reader(&mut self) -> Option<EarlyReader> {
        if self.breaker.is_open() {
            return None;
        }
        if self.early_holds.is_none() {
            self.early_holds = self.open_early_reader("vigil-early-holds");
        }
        self.early_holds.clone()
    }

    fn open_early_reader(&mut self, thread: &str) -> Option<EarlyReader> {
        let timeouts = super::side_timeouts(&self.config);
        let link = match Link::open(self.target.clone(), timeouts, self.config.retry_backoff) {
            Ok(link) => link,
            Err(e) => {
                tracing::debug!(error = %e, "cannot open the early reader's connection");
                return None;
            }
        };
        let (jobs, receiver) = mpsc::channel();
        let outstanding = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let answered = std::sync::Arc::clone(&outstanding);
        let spawned = std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || early_reader(link, receiver, &answered));
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "cannot start the early reader");
            return None;
        }
        let deadline = self
            .read_deadline()
            .saturating_mul(self.config.attempts.clamp(1, 2));
        Some(EarlyReader {
            jobs,
            outstanding,
            deadline,
            attempts: self.config.attempts,
        })
    }

    /// The windows of `keys` the batch's prefetch would read now, to read before the batch takes
    /// the engine; `None` if there are none (or Redis is unavailable).
    pub fn plan_early_reads(&mut self, keys: &[(WindowId, Vec<u8>)]) -> Option<EarlyReads> {
        if self.breaker.is_open() {
            return None;
        }
        self.views.cache.settle(&self.views.dirty);
        self.plan_reads(keys)
    }

    /// The reads [`RedisStore::plan_early_reads`] plans, leaving the windows read for the batch
    /// being counted where they are.
    fn plan_reads(&mut self, keys: &[(WindowId, Vec<u8>)]) -> Option<EarlyReads> {
        let mut cached = std::mem::take(&mut self.views.cached_at_plan);
        cached.clear();
        let wanted = self.wanted_windows(keys, CacheCheck::Record(&mut cached));
        if wanted.is_empty() {
            // Nothing to read: the prefetch that follows finds the record in the store.
            self.views.cached_at_plan = cached;
            return None;
        }
        let mut planned = Vec::with_capacity(wanted.len());
        for (window, key) in wanted {
            // A shared key's view read again stays with the prefetch, which reads it under the
            // engine, as late as it can. (Alone, `wanted_windows` left out every key with a view.)
            if self.views.shared
                && self.views.cache.contains_key(&KeyRef {
                    window: window.0,
                    key,
                })
            {
                continue;
            }
            planned.push(StoredKey {
                window: window.0,
                key: KeyBytes::new(key),
            });
        }
        if planned.is_empty() {
            self.views.cached_at_plan = cached;
            return None;
        }
        // One read per hash: the windows of a shared one are its sections.
        let (names, reply_of) = self.unique_redis_keys(
            planned
                .iter()
                .map(|key| (WindowId(key.window), key.key.as_slice())),
        );
        let batch = self.batch_of("HGETALL", names);
        let shapes = planned
            .iter()
            .map(|key| (self.windows.spec(key.window), self.layout(key.window)))
            .collect();
        let generation = self.views.cache.watch();
        Some(EarlyReads {
            keys: planned,
            reply_of,
            batch,
            generation,
            cached_at_plan: cached,
            shapes,
        })
    }

    /// Takes in what [`EarlyReader::read`] brought back for `reads`: each window whose key still
    /// has no view, or the same view as when the read was planned. Returns how many were taken.
    pub fn take_early_reads(&mut self, mut reads: EarlyReads, replies: EarlyReplies) -> usize {
        // What the plan found cached stays true unless every view was dropped since (checked
        // once the take-in is over): the prefetch after it trusts it (alone), whether or not
        // the reads came back.
        let generation = reads.generation;
        self.views.cached_at_plan = std::mem::take(&mut reads.cached_at_plan);
        let taken = self.take_in_early_reads(reads, replies);
        if self.views.cache.generation() != generation {
            self.views.cached_at_plan.clear();
        }
        taken
    }

    fn take_in_early_reads(&mut self, reads: EarlyReads, replies: EarlyReplies) -> usize {
        let Ok(windows) = replies.0 else {
            self.views.cache.unwatch();
            return 0;
        };
        let mut used = vec![false; reads.reply_of.iter().max().map_or(0, |&at| at + 1)];
        // As for any read: what a promoted replica lacks goes back into the views first (which
        // may drop them all: the generation, checked once after it, then tells).
        self.catch_up_failover();
        if self.views.cache.generation() != reads.generation {
            self.views.cache.unwatch();
            return 0;
        }
        let mut taken = 0;
        self.views.cache.release();
        for ((key, &at), window) in reads.keys.into_iter().zip(&reads.reply_of).zip(windows) {
            // Another read out may still record (and overflow `touched`, voiding every read).
            if self.views.cache.generation() != reads.generation {
                break;
            }
            // The key had no view when the read was planned. Any view of it now is as recent
            // as the read (another batch read or counted it meanwhile), and one taken in from a
            // flush or dropped since may be more recent: the clean views record every view
            // they take in while reads are out (no cache lookup, which is what costs here).
            let changed = self.views.dirty.contains_key(&key)
                || self.views.ahead.contains_key(&key)
                || self.views.cache.touched(&key);
            if changed {
                continue;
            }
            // A reply that does not decode is left to the prefetch, which says why.
            let Some(window) = window else { continue };
            // Unchanged since the plan, which found no view of it: it has none now.
            let cached = self.view_of_stored(&key, window);
            // Noted as the plan's cached keys are: the prefetch that follows, under the same
            // engine lock, need not look it up again.
            self.views
                .cached_at_plan
                .insert(self.views.plan_hasher.hash_one(&key));
            self.views.cache.load_unheld(key, cached);
            taken += 1;
            used[at] = true;
        }
        // Only now: what the views recorded since the plan is forgotten once no read is out.
        self.views.cache.forget_if_unwatched();
        self.views.cache.early_taken = true;
        // Hashes whose windows were all left out are read again by the prefetch: counted there.
        self.stats.loads += used.iter().filter(|&&u| u).count() as u64;
        self.stats.early_loads += taken as u64;
        taken
    }
}

impl<C: MonotonicClock> RedisStore<C> {
    /// Starts reading the windows the next batch will want while this one is counted (replay:
    /// its next batch of lines is known before this one is judged). The next prefetch takes in
    /// what came back, under the same rules as a partition loop's early reads.
    pub(super) fn start_read_ahead(&mut self, keys: &[(WindowId, Vec<u8>)]) {
        self.finish_read_ahead();
        if self.breaker.is_open() {
            return;
        }
        let Some(mut reads) = self.plan_reads(keys) else {
            return;
        };
        let started = match self.early_reader() {
            Some(reader) => reader.start(&mut reads),
            None => Err(StoreError::Unavailable("no early reader".into())),
        };
        match started {
            Ok(pending) => self.read_ahead = Some((reads, pending)),
            // Nothing read: the prefetch reads it all, as without a read ahead.
            Err(e) => {
                self.take_early_reads(reads, EarlyReplies::failed(e));
            }
        }
    }

    /// Gives up the read started by [`RedisStore::start_read_ahead`], if one is out: Redis
    /// became unavailable, and replay does not prefetch again until it answers.
    pub(super) fn give_up_read_ahead(&mut self) {
        self.holds.void_reads_ahead();
        if let Some((reads, _)) = self.read_ahead.take() {
            self.take_early_reads(
                reads,
                EarlyReplies::failed(StoreError::Unavailable("Redis became unavailable".into())),
            );
        }
    }

    /// Takes in the read started by [`RedisStore::start_read_ahead`], if one is out (waiting for
    /// it): before the windows read for the last batch go to the cache.
    pub(super) fn finish_read_ahead(&mut self) {
        let Some((reads, pending)) = self.read_ahead.take() else {
            return;
        };
        let replies = reads.decode(pending.wait());
        self.views.cache.settle(&self.views.dirty);
        self.take_early_reads(reads, replies);
    }
}
