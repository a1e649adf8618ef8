//! Partitions in step. A counter whose key spans partitions (per IP while events are keyed by
//! user) is fed by several partition loops, often in several workers. If one runs ahead in event
//! time, the key's head moves with it and the others' events become late for it: a backlog then
//! blinds short windows. So no partition loop processes an event more than
//! `input.max_partition_skew` ahead of the slowest active partition of the group (Flink's
//! watermark alignment): it waits, and its partition is paused in the consumer once its queue
//! is full. Only a partition that far ahead waits; nobody waits for another's batch.
//!
//! A partition's position is the newest event time it processed, or the time of the event it is
//! waiting to process (so that two partitions each waiting for the other cannot happen: the
//! one that is behind always may go on). A partition that has not moved for
//! `input.partition_idle_timeout` holds nobody back. Partitions of other workers come from the
//! group's progress board in Redis (`store::board`), exchanged every `BOARD_INTERVAL` by the
//! alignment thread; without Redis a worker owns every partition and aligns its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::shared::Worker;
use super::WorkerError;
use crate::clock::{Clock, SystemClock};
use crate::shutdown::Shutdown;
use crate::store::board::{LanePosition, ProgressBoard};

/// How often the alignment thread exchanges positions with the group's board. A partition
/// catching up on a backlog advances about one skew of event time per exchange while another
/// worker's partitions bound it, so this bounds how fast a group catches up (measured: 100 ms
/// made a 1 s skew take 300 s over an hour of events that took 60 s unaligned).
pub(super) const BOARD_INTERVAL: Duration = Duration::from_millis(20);

/// A partition just assigned holds the others back until it has a position (its first
/// events), for at most this long (or `partition_idle_timeout` if shorter): otherwise the first
/// partition to get its messages would run far ahead of the others before they even start.
const START_GRACE: Duration = Duration::from_secs(5);

/// After an assignment, how long the board must have answered for before its having no other
/// worker's partition means this worker is alone: the others post theirs within one
/// `BOARD_INTERVAL` of the same rebalance.
const BOARD_SETTLE: Duration = Duration::from_millis(100);

/// Where this worker's partitions stand, and the others' as the board last told.
pub(super) struct Alignment {
    /// `None`: alignment off.
    skew_ms: Option<i64>,
    idle: Duration,
    lanes: Mutex<Lanes>,
}

#[derive(Default)]
struct Lanes {
    /// This worker's lanes: position (none before its first event), and when it last moved
    /// (was assigned, before that).
    local: HashMap<u64, (Option<i64>, Instant)>,
    /// Other workers' lanes, from the board.
    remote: Vec<LanePosition>,
    /// When this worker was last assigned a partition.
    assigned: Option<Instant>,
    /// When the board last answered.
    exchanged: Option<Instant>,
}

impl Alignment {
    pub(super) fn new(skew: Option<Duration>, idle: Duration) -> Alignment {
        let skew_ms = skew.map(|s| i64::try_from(s.as_millis()).unwrap_or(i64::MAX));
        Alignment {
            skew_ms,
            idle,
            lanes: Mutex::new(Lanes::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lanes> {
        self.lanes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The worker took `lane` over (at `now`).
    pub(super) fn assign(&self, lane: u64, now: Instant) {
        let mut lanes = self.lock();
        lanes.local.entry(lane).or_insert((None, now));
        lanes.assigned = Some(now);
    }

    /// The worker gave `lane` up. Its entry stays on the board, where it stood, until the next
    /// owner moves it (or it goes idle).
    pub(super) fn revoke(&self, lane: u64) {
        self.lock().local.remove(&lane);
    }

    /// `lane` reached `event_ms` (processed it, or waits to process it) at `now`.
    pub(super) fn advance(&self, lane: u64, event_ms: i64, now: Instant) {
        let mut lanes = self.lock();
        let entry = lanes.local.entry(lane).or_insert((None, now));
        if entry.0.is_none_or(|at| event_ms > at) {
            *entry = (Some(event_ms), now);
        }
    }

    /// The newest event time `lane` may process now: the slowest other active partition's
    /// position plus the skew. `None`: no bound (alignment off, or no other active partition).
    /// `wall_ms` is the wall clock, to judge other workers' entries.
    pub(super) fn limit(&self, lane: u64, now: Instant, wall_ms: i64) -> Option<i64> {
        let skew = self.skew_ms?;
        let slowest = self.active(now, wall_ms, Some(lane)).min()?;
        Some(slowest.saturating_add(skew))
    }

    /// How far apart in event time the active partitions are (the newest minus the slowest).
    pub(super) fn spread_ms(&self, now: Instant, wall_ms: i64) -> i64 {
        let positions: Vec<i64> = self
            .active(now, wall_ms, None)
            .filter(|&p| p != i64::MIN)
            .collect();
        match (positions.iter().min(), positions.iter().max()) {
            (Some(min), Some(max)) => max - min,
            _ => 0,
        }
    }

    /// The positions of the active partitions other than `except` (`i64::MIN` for one just
    /// assigned that has none yet).
    fn active(&self, now: Instant, wall_ms: i64, except: Option<u64>) -> std::vec::IntoIter<i64> {
        let lanes = self.lock();
        let idle_ms = i64::try_from(self.idle.as_millis()).unwrap_or(i64::MAX);
        let grace = START_GRACE.min(self.idle);
        let local = lanes
            .local
            .iter()
            .filter(|(lane, _)| Some(**lane) != except)
            .filter_map(|(_, &(position, moved))| {
                let since = now.saturating_duration_since(moved);
                match position {
                    Some(position) if since < self.idle => Some(position),
                    None if since < grace => Some(i64::MIN),
                    _ => None,
                }
            });
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let remote = lanes
            .remote
            .iter()
            .filter(|entry| Some(entry.lane) != except && !lanes.local.contains_key(&entry.lane))
            .filter(|entry| {
                // Just assigned, no position yet: holds the others back for the grace only.
                let within = if entry.event_ms == i64::MIN {
                    grace_ms
                } else {
                    idle_ms
                };
                wall_ms.saturating_sub(entry.moved_wall_ms) < within
            })
            .map(|entry| entry.event_ms);
        local.chain(remote).collect::<Vec<_>>().into_iter()
    }

    /// What to write to the board: this worker's lanes with their positions (`i64::MIN` for one
    /// just assigned: the others wait for its first events as this worker's own lanes do, and
    /// know at once that it counts too), each with when it last moved by the wall clock.
    pub(super) fn outgoing(&self, now: Instant, wall_ms: i64) -> Vec<LanePosition> {
        self.lock()
            .local
            .iter()
            .map(|(&lane, &(position, moved))| {
                let ago = i64::try_from(now.saturating_duration_since(moved).as_millis())
                    .unwrap_or(i64::MAX);
                LanePosition {
                    lane,
                    event_ms: position.unwrap_or(i64::MIN),
                    moved_wall_ms: wall_ms.saturating_sub(ago),
                }
            })
            .collect()
    }

    /// What the board holds at `now` (this worker's own lanes are taken from itself).
    pub(super) fn incoming(&self, board: Vec<LanePosition>, now: Instant) {
        let mut lanes = self.lock();
        lanes.remote = board;
        lanes.exchanged = Some(now);
    }

    /// Whether other workers may count into the same keys: another worker's partition is
    /// active (its board entry moved within the idle timeout), or this worker was assigned a
    /// partition so recently that the others' entries may not have reached it yet (the board
    /// has not answered `BOARD_SETTLE` after the assignment; never, without a board).
    pub(super) fn others_active(&self, now: Instant, wall_ms: i64) -> bool {
        let lanes = self.lock();
        let idle_ms = i64::try_from(self.idle.as_millis()).unwrap_or(i64::MAX);
        let unsettled = lanes.assigned.is_some_and(|at| {
            now.saturating_duration_since(at) < START_GRACE
                && lanes.exchanged.is_none_or(|e| e < at + BOARD_SETTLE)
        });
        unsettled
            || lanes.remote.iter().any(|entry| {
                !lanes.local.contains_key(&entry.lane)
                    && wall_ms.saturating_sub(entry.moved_wall_ms) < idle_ms
            })
    }
}

impl Worker {
    /// Starts the aligner thread: every `BOARD_INTERVAL` it exchanges this worker's partitions'
    /// positions with the group's board in Redis (reconnecting when Redis is away: meanwhile
    /// other workers' entries age out and each worker aligns its own partitions), and exports
    /// the skew.
    pub(super) fn spawn_aligner(
        self: &Arc<Self>,
        done: &Shutdown,
    ) -> Result<JoinHandle<()>, WorkerError> {
        let (worker, done) = (Arc::clone(self), done.clone());
        std::thread::Builder::new()
            .name("vigil-align".into())
            .spawn(move || worker.align_loop(&done))
            .map_err(|e| WorkerError::ShutdownIncomplete(format!("cannot start the aligner: {e}")))
    }

    fn align_loop(&self, done: &Shutdown) {
        // The board is exchanged even with alignment off: it tells whether other workers count
        // into the same keys (see `Alignment::others_active`).
        let url = self.config.redis.url.clone();
        let mut board: Option<ProgressBoard> = None;
        let mut failed_at: Option<Instant> = None;
        // The board outlives a worker briefly: long enough for its entries to go idle.
        let ttl = self
            .config
            .input
            .partition_idle_timeout
            .saturating_mul(4)
            .max(Duration::from_secs(60));
        while !done.wait(BOARD_INTERVAL) {
            if let Some(url) = &url {
                let retry_due =
                    failed_at.is_none_or(|at| at.elapsed() >= self.config.redis.probe_interval);
                if board.is_none() && retry_due {
                    let config = self.config.redis.store_config(None);
                    match ProgressBoard::connect(url, &config, &self.config.kafka.group_id) {
                        Ok(connected) => board = Some(connected),
                        Err(e) => {
                            failed_at = Some(Instant::now());
                            tracing::debug!(error = %e, "partition alignment: the group's board in Redis is unavailable");
                        }
                    }
                }
                if let Some(connected) = board.as_mut() {
                    let mine = self.alignment.outgoing(Instant::now(), wall_ms());
                    match connected.exchange(&mine, ttl) {
                        Ok(entries) => self.alignment.incoming(entries, Instant::now()),
                        Err(e) => {
                            tracing::debug!(error = %e, "partition alignment: the group's board in Redis is unavailable");
                            board = None;
                            failed_at = Some(Instant::now());
                        }
                    }
                }
            }
            let spread = self.alignment.spread_ms(Instant::now(), wall_ms());
            self.metrics
                .partition_skew_seconds
                .set(spread as f64 / 1000.0);
        }
    }
}

/// The wall clock in ms since the Unix epoch (the board's time).
pub(super) fn wall_ms() -> i64 {
    SystemClock.now_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SKEW: Duration = Duration::from_secs(5);
    const IDLE: Duration = Duration::from_secs(30);

    #[test]
    fn a_partition_may_run_up_to_the_skew_ahead_of_the_slowest_other() {
        let alignment = Alignment::new(Some(SKEW), IDLE);
        let now = Instant::now();
        assert_eq!(alignment.limit(1, now, 0), None, "alone: no bound");
        alignment.advance(1, 100_000, now);
        alignment.advance(2, 90_000, now);
        alignment.advance(3, 120_000, now);
        assert_eq!(
            alignment.limit(1, now, 0),
            Some(95_000),
            "the slowest other is lane 2"
        );
        assert_eq!(
            alignment.limit(2, now, 0),
            Some(105_000),
            "the slowest may always go on"
        );
        assert_eq!(alignment.spread_ms(now, 0), 30_000);
        // Positions only move forward.
        alignment.advance(2, 80_000, now);
        assert_eq!(alignment.limit(1, now, 0), Some(95_000));
    }

    #[test]
    fn two_partitions_waiting_for_each_other_cannot_happen() {
        // Lane 1 processed up to 100 s and waits to process an event at 300 s; lane 2 processed
        // up to 200 s. Lane 1's position is the event it waits for, so lane 2 may go on.
        let alignment = Alignment::new(Some(SKEW), IDLE);
        let now = Instant::now();
        alignment.advance(1, 100_000, now);
        alignment.advance(2, 200_000, now);
        alignment.advance(1, 300_000, now);
        assert_eq!(alignment.limit(2, now, 0), Some(305_000));
        assert_eq!(alignment.limit(1, now, 0), Some(205_000));
    }

    #[test]
    fn an_idle_partition_holds_nobody_back_and_a_revoked_one_leaves() {
        let alignment = Alignment::new(Some(SKEW), IDLE);
        let start = Instant::now();
        alignment.advance(1, 100_000, start);
        alignment.advance(2, 10_000, start);
        let later = start + IDLE;
        alignment.advance(1, 101_000, later);
        assert_eq!(
            alignment.limit(1, later, 0),
            None,
            "lane 2 has not moved for the idle timeout"
        );
        alignment.advance(2, 11_000, later);
        assert_eq!(
            alignment.limit(1, later, 0),
            Some(16_000),
            "it moved: it counts again"
        );
        alignment.revoke(2);
        assert_eq!(alignment.limit(1, later, 0), None);
        assert_eq!(
            alignment.outgoing(later, 5_000).len(),
            1,
            "only lane 1 is this worker's now"
        );
    }

    #[test]
    fn a_partition_just_assigned_holds_the_others_until_it_has_a_position() {
        let alignment = Alignment::new(Some(SKEW), IDLE);
        let start = Instant::now();
        alignment.assign(1, start);
        alignment.assign(2, start);
        alignment.advance(1, 100_000, start);
        assert_eq!(
            alignment.limit(1, start, 0),
            Some(i64::MIN + 5_000),
            "lane 2 has not started yet"
        );
        assert_eq!(alignment.limit(2, start, 0), Some(105_000));
        alignment.advance(2, 90_000, start);
        assert_eq!(alignment.limit(1, start, 0), Some(95_000));
        alignment.assign(3, start);
        assert_eq!(
            alignment.limit(1, start + START_GRACE, 0),
            Some(95_000),
            "lane 3 got nothing within the grace"
        );
        assert_eq!(alignment.spread_ms(start, 0), 10_000);
    }

    #[test]
    fn other_workers_partitions_come_from_the_board_and_age_by_the_wall_clock() {
        let alignment = Alignment::new(Some(SKEW), IDLE);
        let now = Instant::now();
        alignment.assign(1, now);
        alignment.advance(1, 100_000, now);
        let wall = 1_800_000_000_000;
        alignment.incoming(
            vec![
                LanePosition {
                    lane: 2,
                    event_ms: 50_000,
                    moved_wall_ms: wall - 1_000,
                },
                LanePosition {
                    lane: 3,
                    event_ms: 10_000,
                    moved_wall_ms: wall - 31_000,
                },
                // This worker's own lane, as the board had it before: its own record wins.
                LanePosition {
                    lane: 1,
                    event_ms: 1_000,
                    moved_wall_ms: wall,
                },
            ],
            now,
        );
        assert_eq!(
            alignment.limit(1, now, wall),
            Some(55_000),
            "lane 3 is idle, lane 1's old entry ignored"
        );
        let mine = alignment.outgoing(now, wall);
        assert_eq!(
            mine,
            vec![LanePosition {
                lane: 1,
                event_ms: 100_000,
                moved_wall_ms: wall
            }]
        );
    }

    #[test]
    fn off_means_no_bound() {
        let alignment = Alignment::new(None, IDLE);
        let now = Instant::now();
        alignment.advance(1, 100_000, now);
        alignment.advance(2, 0, now);
        assert_eq!(alignment.limit(1, now, 0), None);
    }

    #[test]
    fn a_just_assigned_partition_of_another_worker_holds_for_the_grace_only() {
        let alignment = Alignment::new(Some(SKEW), IDLE);
        let now = Instant::now();
        alignment.assign(1, now);
        alignment.assign(2, now);
        let wall = 1_800_000_000_000;
        assert_eq!(
            alignment.outgoing(now, wall).len(),
            2,
            "lanes without a position are on the board too, so the others wait for their first events"
        );
        alignment.advance(1, 100_000, now);
        let grace = i64::try_from(START_GRACE.as_millis()).unwrap();
        alignment.incoming(
            vec![LanePosition {
                lane: 7,
                event_ms: i64::MIN,
                moved_wall_ms: wall - 1_000,
            }],
            now,
        );
        alignment.advance(2, 100_000, now);
        assert_eq!(
            alignment.limit(1, now, wall),
            Some(i64::MIN + 5_000),
            "lane 7 was just assigned to another worker"
        );
        alignment.incoming(
            vec![LanePosition {
                lane: 7,
                event_ms: i64::MIN,
                moved_wall_ms: wall - grace,
            }],
            now,
        );
        assert_eq!(
            alignment.limit(1, now, wall),
            Some(105_000),
            "past the grace, lane 7 holds nobody back"
        );
    }

    #[test]
    fn other_workers_count_too_while_the_board_shows_their_partitions_or_just_after_an_assignment()
    {
        let alignment = Alignment::new(Some(SKEW), IDLE);
        let now = Instant::now();
        let wall = 1_800_000_000_000;
        assert!(
            !alignment.others_active(now, wall),
            "nothing assigned, nobody on the board"
        );
        alignment.assign(1, now);
        assert!(
            alignment.others_active(now, wall),
            "just assigned: the others may not be on the board yet"
        );
        alignment.incoming(
            vec![LanePosition {
                lane: 1,
                event_ms: 5,
                moved_wall_ms: wall,
            }],
            now + BOARD_SETTLE / 2,
        );
        assert!(
            alignment.others_active(now + BOARD_SETTLE, wall),
            "the board answered too soon to tell"
        );
        let settled = now + BOARD_SETTLE;
        alignment.incoming(
            vec![LanePosition {
                lane: 1,
                event_ms: 5,
                moved_wall_ms: wall,
            }],
            settled,
        );
        assert!(
            !alignment.others_active(settled, wall),
            "alone: its own lane on the board is not another worker"
        );
        alignment.assign(2, now);
        assert!(
            !alignment.others_active(now + START_GRACE, wall),
            "the board answered after this assignment too: alone"
        );
        alignment.incoming(
            vec![LanePosition {
                lane: 3,
                event_ms: 5,
                moved_wall_ms: wall - 1_000,
            }],
            settled,
        );
        assert!(alignment.others_active(settled, wall));
        assert!(
            !alignment.others_active(settled, wall + 30_000),
            "its lane went idle"
        );
    }
}
