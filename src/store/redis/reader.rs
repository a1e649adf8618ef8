//! The reader thread: window and hold reads on their own connection, so the counting path waits
//! for Redis at most a read deadline (then takes it as unavailable) instead of as long as a
//! frozen server keeps a pipeline waiting.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use redis::Value;

use super::RedisStore;
use crate::clock::MonotonicClock;
use crate::store::counter_store::StoreError;
use crate::store::link::{Batch, Link};

/// A read for the reader thread: windows (HGETALL per key).
pub(super) struct ReadJob {
    id: u64,
    batch: Batch,
    attempts: u32,
}

struct ReadDone {
    id: u64,
    result: Result<Vec<Value>, StoreError>,
    retries: u64,
}

/// Runs reads on their own connection, so that the counting path can stop waiting for a Redis
/// that stopped answering: a read's attempts (each a reconnection and a reply, with backoff
/// between them) may take longer than the counting path should wait.
fn reader(mut link: Link, jobs: mpsc::Receiver<ReadJob>, done: mpsc::Sender<ReadDone>) {
    for job in jobs {
        let (result, retries) = link.query(&job.batch, job.attempts);
        if done
            .send(ReadDone {
                id: job.id,
                result,
                retries,
            })
            .is_err()
        {
            return;
        }
    }
}

/// The store's side of the reader thread. Reads (loads, prefetches) go to it; the caller waits at
/// most `read_deadline` for each.
pub(super) struct Reads {
    /// `None` once the store is dropped: the thread ends with its channel.
    pub(super) jobs: Option<mpsc::Sender<ReadJob>>,
    done: mpsc::Receiver<ReadDone>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
    seq: u64,
    /// A read the caller stopped waiting for: until it comes back, reads fail at once.
    outstanding: Option<u64>,
}

impl Reads {
    /// Starts the reader thread on `link`.
    pub(super) fn start(link: Link) -> Result<Reads, StoreError> {
        let (jobs, job_rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("vigil-reader".into())
            .spawn(move || reader(link, job_rx, done_tx))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the reader thread: {e}")))?;
        Ok(Reads {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            seq: 0,
            outstanding: None,
        })
    }
}

impl<C: MonotonicClock> RedisStore<C> {
    /// One `command` per key name, pipelined on the reader thread (grouped per master on a
    /// cluster): a reply per name, in order.
    pub(super) fn read_each(
        &mut self,
        command: &'static str,
        names: Vec<String>,
    ) -> Result<Vec<Value>, StoreError> {
        let count = names.len();
        self.run_batch(self.batch_of(command, names), command, count)
    }

    /// One `command` per key name, each on the key it names.
    pub(super) fn batch_of(&self, command: &'static str, names: Vec<String>) -> Batch {
        let mut batch = Batch::default();
        batch.calls.reserve(names.len());
        for name in names {
            batch.read(self.cluster, command, name);
        }
        batch
    }

    /// Commands, each on the key it names, pipelined on the reader thread: a reply per
    /// command, in order. For the rare calls outside counting (inspecting a key, releasing a
    /// hold).
    pub(super) fn run_each(
        &mut self,
        commands: Vec<(String, redis::Cmd)>,
    ) -> Result<Vec<Value>, StoreError> {
        let mut batch = Batch::default();
        let count = commands.len();
        for (name, cmd) in commands {
            batch.command(self.cluster, &name, cmd);
        }
        self.run_batch(batch, "inspection", count)
    }

    fn run_batch(
        &mut self,
        batch: Batch,
        command: &str,
        count: usize,
    ) -> Result<Vec<Value>, StoreError> {
        // Every attempt (a dropped connection fails at once and is worth another), but within
        // two read deadlines: the counting path does not wait out a long outage.
        let replies = self.query_read(batch, self.config.attempts)?;
        // These replies may come from a promoted replica the flusher has not met yet: what it
        // lacks is put back in the views first, so the replies never stand in for it.
        self.catch_up_failover();
        if replies.len() != count {
            return Err(StoreError::Protocol(format!(
                "{} replies for {count} {command} reads",
                replies.len(),
            )));
        }
        Ok(replies)
    }

    /// The longest the counting path waits for Redis: a connection and a reply.
    pub(super) fn read_deadline(&self) -> Duration {
        self.config.connect_timeout + self.config.response_timeout
    }

    /// Runs `batch` on the reader thread, waiting at most `read_deadline` for it.
    fn query_read(&mut self, batch: Batch, attempts: u32) -> Result<Vec<Value>, StoreError> {
        if let Some(outstanding) = self.reads.outstanding {
            // A read the caller gave up on: Redis is taken as unavailable until it answers it.
            loop {
                match self.reads.done.try_recv() {
                    Ok(done) if done.id == outstanding => {
                        self.reads.outstanding = None;
                        break;
                    }
                    Ok(_) => continue,
                    Err(mpsc::TryRecvError::Empty) => {
                        return Err(StoreError::Unavailable(
                            "an earlier read is still waiting for Redis".into(),
                        ))
                    }
                    Err(mpsc::TryRecvError::Disconnected) => {
                        return Err(StoreError::Unavailable("the reader thread stopped".into()))
                    }
                }
            }
        }
        self.reads.seq += 1;
        let id = self.reads.seq;
        let reads = self
            .reads
            .jobs
            .as_ref()
            .expect("the reader runs until drop");
        reads
            .send(ReadJob {
                id,
                batch,
                attempts,
            })
            .map_err(|_| StoreError::Unavailable("the reader thread stopped".into()))?;
        let deadline = Instant::now() + self.read_deadline().saturating_mul(attempts.clamp(1, 2));
        loop {
            match self
                .reads
                .done
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(done) if done.id == id => {
                    self.stats.retries += done.retries;
                    return done.result;
                }
                Ok(_) => continue,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.reads.outstanding = Some(id);
                    return Err(StoreError::Unavailable(format!(
                        "no reply from Redis within {:?}",
                        self.read_deadline()
                    )));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(StoreError::Unavailable("the reader thread stopped".into()))
                }
            }
        }
    }
}
