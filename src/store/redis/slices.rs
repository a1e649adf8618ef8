//! Work the store spreads over ticks. Taking in a flush's keys and moving windows into the cache
//! cost microseconds each, a flush carries thousands of keys, and every partition waits for the
//! engine while they are done: in one piece, that is tens of milliseconds added to whichever
//! decisions are waiting. So a tick does a slice within a small budget, but never falls behind
//! a schedule that has everything done a set time after it began: a store that ticks rarely (one
//! tick per large batch at saturation, or only the committer's when idle) still finishes in time.

use std::time::{Duration, Instant};

/// A piece of work of `total` items, begun at `began`, to be done within `spread`, `budget` of
/// it per tick (`RedisStoreConfig::tick_budget`).
#[derive(Debug, Clone)]
pub(super) struct Slices {
    total: usize,
    done: usize,
    began: Instant,
    spread: Duration,
    budget: Duration,
    /// When the current tick began, and the items it did.
    tick: Instant,
    this_tick: usize,
}

impl Slices {
    pub(super) fn new(total: usize, spread: Duration, budget: Duration, began: Instant) -> Slices {
        Slices {
            total,
            done: 0,
            began,
            spread,
            budget,
            tick: began,
            this_tick: 0,
        }
    }

    /// A tick begins at `tick`: its slice starts.
    pub(super) fn begin_tick(&mut self, tick: Instant) {
        self.tick = tick;
        self.this_tick = 0;
    }

    /// Whether this tick does one more item, `now`: its first, one within its budget, or one
    /// while the work is behind its schedule.
    pub(super) fn more(&self, now: Instant) -> bool {
        self.done < self.total
            && (self.this_tick == 0
                || now.saturating_duration_since(self.tick) < self.budget
                || self.done < self.due(now))
    }

    pub(super) fn did_one(&mut self) {
        self.done += 1;
        self.this_tick += 1;
    }

    /// How many items the schedule wants done by `now`: in proportion to the time since the
    /// work began, all of them once `spread` has passed.
    fn due(&self, now: Instant) -> usize {
        let elapsed = now.saturating_duration_since(self.began);
        if elapsed >= self.spread {
            return self.total;
        }
        let due = self.total as u128 * elapsed.as_nanos() / self.spread.as_nanos().max(1);
        usize::try_from(due).unwrap_or(self.total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: Duration = Duration::from_micros(500);

    /// Counts the items one tick does, with time standing still but for `cost` per item.
    fn tick(slices: &mut Slices, at: Instant, cost: Duration) -> usize {
        slices.begin_tick(at);
        let mut now = at;
        let mut done = 0;
        while slices.more(now) {
            slices.did_one();
            done += 1;
            now += cost;
        }
        done
    }

    #[test]
    fn a_tick_stops_at_its_budget_while_the_work_is_on_schedule() {
        let began = Instant::now();
        let mut slices = Slices::new(10_000, Duration::from_secs(1), BUDGET, began);
        // 5 µs an item: 100 items fill the budget.
        assert_eq!(tick(&mut slices, began, Duration::from_micros(5)), 100);
        assert_eq!(
            tick(
                &mut slices,
                began + Duration::from_millis(1),
                Duration::from_micros(5)
            ),
            100
        );
    }

    #[test]
    fn a_tick_behind_schedule_catches_up_and_one_past_the_spread_does_everything_left() {
        let began = Instant::now();
        let mut slices = Slices::new(10_000, Duration::from_secs(1), BUDGET, began);
        let cost = Duration::from_micros(1);
        assert_eq!(tick(&mut slices, began, cost), 500);
        // Half the spread later, half the work is due: the tick goes past its budget to there.
        let half = tick(&mut slices, began + Duration::from_millis(500), cost);
        assert!(
            (5_000..=5_100).contains(&(500 + half)),
            "caught up to about half: {}",
            500 + half
        );
        let rest = tick(&mut slices, began + Duration::from_secs(2), cost);
        assert_eq!(500 + half + rest, 10_000);
        let later = began + Duration::from_secs(3);
        slices.begin_tick(later);
        assert!(!slices.more(later));
    }

    #[test]
    fn a_tick_without_budget_does_one_item_unless_behind() {
        let began = Instant::now();
        let mut slices = Slices::new(10, Duration::from_secs(1), Duration::ZERO, began);
        assert_eq!(tick(&mut slices, began, Duration::from_micros(1)), 1);
        assert_eq!(tick(&mut slices, began, Duration::from_micros(1)), 1);
        assert_eq!(
            tick(&mut slices, began + Duration::from_secs(1), Duration::ZERO),
            8
        );
    }
}
