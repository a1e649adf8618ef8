//! The engine: decode → plan → count → decide for one event over a counter store, with the
//! watermark of each input lane (a Kafka partition; the whole input in replay), rule reloads
//! that keep the state of unchanged counters, and the per-rule and per-counter counts the
//! metrics and the replay summary report.

use std::sync::Arc;

use smallvec::SmallVec;

use crate::clock::{Clock, SystemClock};

use super::judge::{Judge, Outcome};
use super::touched::Touched;
use crate::event::{BadEvent, Event, TimeBounds, TimeSource};
use crate::rules::{
    Decision, Form, Hit, Mode, Plan, Reason, RuleSet, Scope, ScopeMemo, SkipReason,
};
use crate::store::{CounterStore, HoldSpace, InputPosition, Planned, StoreError, WindowId};
use crate::window::{Applied, Delta, LastValue};

/// Per-evaluation counts, for the replay summary and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvalCounts {
    /// Events judged (decoded successfully).
    pub events: u64,
    /// (event, counter) pairs not counted because the event was late: its bucket had slid out of
    /// the key's window, or the event was behind its input's watermark.
    pub late: u64,
    /// Distinct values not recorded because their key's window held `max_distinct` values.
    pub capped: u64,
    /// Events behind their input's watermark (`max_lateness`): late for every counter.
    pub behind_watermark: u64,
    /// (event, counter) pairs skipped because a dimension or the aggregated field was unusable.
    pub skipped_dimension: u64,
    pub skipped_sum_field: u64,
    pub skipped_sum_range: u64,
    pub skipped_distinct_field: u64,
    /// A `last` counter's field missing, not a scalar, or a string over 256 bytes.
    pub skipped_last_field: u64,
    /// Counter values read without counting (a rule referring to a counter the event did not feed).
    pub reads: u64,
    /// Events with at least one hit.
    pub decisions: u64,
    /// Hits made on values counted locally while the shared store was unavailable.
    pub degraded_hits: u64,
    /// Rule judgements on state dropped at the in-process bound (see [`RuleCounts`]).
    pub on_dropped_state: u64,
}

impl EvalCounts {
    pub fn skipped(&self) -> u64 {
        self.skipped_dimension
            + self.skipped_sum_field
            + self.skipped_sum_range
            + self.skipped_distinct_field
            + self.skipped_last_field
    }
}

/// What happened to one rule's evaluations, for per-rule metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuleCounts {
    /// Events in the rule's scope (its `match` held).
    pub matched: u64,
    pub hits: u64,
    /// Of `hits`, those in shadow mode (the rule's mode, or outside its rollout).
    pub shadow_hits: u64,
    /// Judgements on state dropped at the in-process bound (a counter known only as a lower
    /// bound, or a hold that may have been dropped), judged by the rule's `on_store_error`.
    pub on_dropped_state: u64,
}

/// What happened to one counter's observations, for per-counter metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterCounts {
    /// Events counted (their observation applied to the key's window).
    pub counted: u64,
    pub late: u64,
    /// Distinct values not recorded: the key's window held `max_distinct` values.
    pub capped: u64,
    /// Skips by reason, indexed by [`SkipReason::index`].
    pub skipped: [u64; 6],
}

/// What a rule reload did to the counters (for the reload log).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterChanges {
    /// Counters new in this set, or whose window (length, bucket, aggregate, `max_distinct`),
    /// dimensions or field changed: they start from nothing.
    pub fresh: Vec<String>,
    /// Counters whose id, window, dimensions and field are unchanged: they keep what they counted.
    pub kept: Vec<String>,
    /// Kept counters whose `match` or `allow_negative` changed: what they counted under the old
    /// definition stays in their windows (rename a counter to start it afresh).
    pub redefined: Vec<String>,
}

/// Evaluates events against a rule set over a counter store.
pub struct Engine<S> {
    rules: RuleSet,
    store: S,
    /// The store window of each active counter, by active position.
    pub(super) windows: Vec<WindowId>,
    /// Per active counter: its key for the current event, and its outcome.
    keys: Vec<Vec<u8>>,
    outcomes: Vec<Outcome>,
    /// Per active `last` counter: the value its outcome's time belongs to, for this event.
    last_values: Vec<Option<LastValue>>,
    /// The active positions of the `last` counters: the entries of `last_values` in use.
    last_positions: Vec<usize>,
    /// Per active counter, its plan for the current event.
    plans: Vec<Plan>,
    counts: EvalCounts,
    /// Per active rule, since the last [`Engine::take_rule_counts`].
    rule_counts: Vec<RuleCounts>,
    /// Per active counter, since the last [`Engine::take_counter_counts`].
    counter_counts: Vec<CounterCounts>,
    bounds: TimeBounds,
    clock: Arc<dyn Clock>,
    /// Where events decoded for this engine's rules take their time from.
    pub(super) time_source: TimeSource,
    /// The newest accepted event time of each input lane (a Kafka partition; the whole input in
    /// replay): its watermark follows it.
    newest: Vec<(u64, i64)>,
    /// Per active rule: its hold space in the store (`None`: no hold).
    pub(super) hold_spaces: Vec<Option<HoldSpace>>,
    /// The hold key of the rule being judged.
    hold_key: Vec<u8>,
    /// `match` results for the event being evaluated (and for prefetching).
    memo: ScopeMemo,
    /// A counter's key as [`Engine::touched_keys`] plans it (kept for its buffer).
    touched_key: Vec<u8>,
    /// Grows with every rule set put in force (events decoded for one are decoded again for
    /// the next: the projection may differ).
    rules_generation: u64,
}

/// Longest a shared store keeps a hold: ten years.
const MAX_HOLD_TTL_MS: i64 = 10 * 365 * 86_400_000;

/// Shortest a shared store keeps a hold: an hour. Holds count in event time, their TTL in wall
/// time: a short hold must not vanish while a slow consumer (or a replay slower than real time)
/// still judges events inside it.
const MIN_HOLD_TTL_MS: i64 = 3_600_000;

/// How long a shared store keeps a hold of `hold_ms` after setting it: max(2 × hold, hold +
/// lateness, an hour), so that an event up to the lateness bound behind still finds it.
fn hold_ttl_ms(hold_ms: i64, max_lateness_ms: Option<i64>) -> i64 {
    let by_lateness = max_lateness_ms.map_or(0, |lateness| hold_ms.saturating_add(lateness));
    hold_ms
        .saturating_mul(2)
        .max(by_lateness)
        .clamp(MIN_HOLD_TTL_MS, MAX_HOLD_TTL_MS)
}

impl<S: CounterStore> Engine<S> {
    /// An engine with the default time bounds (`max_future_skew` 5m, `max_lateness` 1h) on the
    /// system clock.
    pub fn new(rules: RuleSet, store: S) -> Engine<S> {
        let mut engine = Engine {
            rules: RuleSet::empty(),
            store,
            windows: Vec::new(),
            keys: Vec::new(),
            outcomes: Vec::new(),
            last_values: Vec::new(),
            last_positions: Vec::new(),
            plans: Vec::new(),
            counts: EvalCounts::default(),
            rule_counts: Vec::new(),
            counter_counts: Vec::new(),
            bounds: TimeBounds::default(),
            clock: Arc::new(SystemClock),
            time_source: TimeSource::Ts,
            newest: Vec::new(),
            hold_spaces: Vec::new(),
            hold_key: Vec::with_capacity(64),
            memo: ScopeMemo::default(),
            touched_key: Vec::new(),
            rules_generation: 0,
        };
        engine.replace_rules(rules);
        engine
    }

    /// The same engine with other time bounds, measured against `clock`.
    pub fn with_time(mut self, bounds: TimeBounds, clock: Arc<dyn Clock>) -> Engine<S> {
        self.bounds = bounds;
        self.clock = clock;
        self.open_hold_spaces();
        self
    }

    /// The same engine taking event time from `source` (for this rule set and every one reloaded).
    pub fn with_time_source(mut self, source: TimeSource) -> Engine<S> {
        self.rules.set_time_source(&source);
        self.time_source = source;
        self
    }

    /// Opens the hold space of every active rule with a hold (by rule id: a reloaded rule keeps
    /// its holds).
    fn open_hold_spaces(&mut self) {
        let lateness = self.bounds.max_lateness_ms;
        let mut spaces = Vec::with_capacity(self.rules.active().len());
        for index in self.rules.active() {
            let rule = self.rules.rule(index);
            spaces.push(rule.hold.as_ref().map(|hold| {
                self.store
                    .open_holds(&rule.id, hold_ttl_ms(hold.ms, lateness))
            }));
        }
        self.hold_spaces = spaces;
    }

    pub fn bounds(&self) -> TimeBounds {
        self.bounds
    }

    /// Refuses an event whose time is too far ahead of the wall clock (a bad event, `future_ts`):
    /// it is neither counted nor judged and does not move its input's watermark.
    pub fn admit(&self, event: &Event<'_>) -> Result<(), BadEvent> {
        self.bounds.check_future(event.ts, self.clock.now_ms())
    }

    /// The newest accepted event time of `lane` (what its watermark follows).
    pub fn newest(&self, lane: u64) -> Option<i64> {
        self.newest
            .iter()
            .find(|(l, _)| *l == lane)
            .map(|&(_, n)| n)
    }

    /// Starts `lane` from a known newest event time (what a previous owner of the lane had
    /// reached), so its watermark continues where it was.
    pub fn resume_lane(&mut self, lane: u64, newest: i64) {
        match self.newest.iter_mut().find(|(l, _)| *l == lane) {
            Some((_, n)) => *n = (*n).max(newest),
            None => self.newest.push((lane, newest)),
        }
        self.update_horizon();
    }

    /// Forgets an input lane (a revoked partition): its watermark no longer holds state back.
    pub fn close_lane(&mut self, lane: u64) {
        self.newest.retain(|&(l, _)| l != lane);
        self.update_horizon();
    }

    /// Tells the store the oldest event time any open lane may still count or read.
    fn update_horizon(&mut self) {
        if let Some(oldest) = self.newest.iter().map(|&(_, newest)| newest).min() {
            if let Some(horizon) = self.bounds.watermark(oldest) {
                self.store.set_horizon(horizon);
            }
        }
    }

    /// Whether `event` from `lane` is behind the lane's watermark (late for every counter);
    /// otherwise its time becomes the lane's newest if it is.
    fn behind_watermark(&mut self, lane: u64, ts: i64) -> bool {
        match self.newest.iter_mut().find(|(l, _)| *l == lane) {
            Some((_, newest)) => {
                if self
                    .bounds
                    .watermark(*newest)
                    .is_some_and(|watermark| ts < watermark)
                {
                    return true;
                }
                if ts > *newest {
                    *newest = ts;
                    self.update_horizon();
                }
            }
            None => {
                self.newest.push((lane, ts));
                self.update_horizon();
            }
        }
        false
    }

    /// Swaps in a new rule set between two events. A counter whose id, window and meaning
    /// (dimensions, field) are unchanged keeps its state (the store hands back the same window);
    /// any other starts afresh. Returns the old set and what happened to each counter.
    pub fn reload_rules(&mut self, rules: RuleSet) -> (RuleSet, CounterChanges) {
        let mut changes = CounterChanges::default();
        for index in rules.active_counters() {
            let new = rules.counter(index);
            let old = self
                .rules
                .active_counters()
                .map(|i| self.rules.counter(i))
                .find(|c| c.id == new.id);
            // The store keys a window by id, shape and identity (dimensions and field): the same
            // hands back the same state.
            match old {
                Some(old) if old.window == new.window => {
                    let same_scope = match (&old.scope, &new.scope) {
                        (Scope::All, Scope::All) => true,
                        (Scope::Table(a), Scope::Table(b)) => a == b,
                        (Scope::Expr(_), Scope::Expr(_)) => old.scope_text == new.scope_text,
                        _ => false,
                    };
                    if !same_scope || old.allow_negative != new.allow_negative {
                        changes.redefined.push(new.id.clone());
                    }
                    changes.kept.push(new.id.clone());
                }
                _ => changes.fresh.push(new.id.clone()),
            }
        }
        (self.replace_rules(rules), changes)
    }

    /// [`Engine::reload_rules`] without the report.
    pub fn replace_rules(&mut self, mut rules: RuleSet) -> RuleSet {
        rules.set_time_source(&self.time_source);
        self.windows = rules
            .active_counters()
            .map(|index| {
                let counter = rules.counter(index);
                self.store.open_window(&counter.id, counter.window)
            })
            .collect();
        self.keys = vec![Vec::with_capacity(64); self.windows.len()];
        self.outcomes = vec![Outcome::Unread; self.windows.len()];
        self.last_values = vec![None; self.windows.len()];
        self.last_positions = rules
            .active_counters()
            .enumerate()
            .filter(|&(_, index)| {
                rules.counter(index).aggregate() == crate::window::Aggregate::Last
            })
            .map(|(position, _)| position)
            .collect();
        self.counter_counts = vec![CounterCounts::default(); self.windows.len()];
        self.rule_counts = vec![RuleCounts::default(); rules.active().len()];
        self.memo = rules.scope_memo();
        let old = std::mem::replace(&mut self.rules, rules);
        self.open_hold_spaces();
        self.rules_generation += 1;
        old
    }

    /// Which rule set is in force: it changes whenever one is put in force.
    pub fn rules_generation(&self) -> u64 {
        self.rules_generation
    }

    /// Per-rule counts since the last call, as (rule index, counts) of the active rules.
    pub fn take_rule_counts(&mut self) -> impl Iterator<Item = (usize, RuleCounts)> + '_ {
        let active: Vec<usize> = self.rules.active().collect();
        let counts = std::mem::replace(
            &mut self.rule_counts,
            vec![RuleCounts::default(); active.len()],
        );
        active
            .into_iter()
            .zip(counts)
            .filter(|(_, c)| *c != RuleCounts::default())
    }

    /// Per-counter counts since the last call, as (counter index, counts) of the active counters.
    pub fn take_counter_counts(&mut self) -> impl Iterator<Item = (usize, CounterCounts)> + '_ {
        let active: Vec<usize> = self.rules.active_counters().collect();
        let counts = std::mem::replace(
            &mut self.counter_counts,
            vec![CounterCounts::default(); active.len()],
        );
        active
            .into_iter()
            .zip(counts)
            .filter(|(_, c)| *c != CounterCounts::default())
    }

    /// The value the active counter at `position` had after counting the last evaluated event,
    /// if that event fed it (`None`: out of scope, skipped or late).
    pub fn counted_value(&self, position: usize) -> Option<(i64, &[u8])> {
        match self.outcomes.get(position) {
            // A counted event's key bytes are still where counting wrote them.
            Some(Outcome::Known {
                value,
                counted: true,
                ..
            }) => Some((*value, &self.keys[position])),
            _ => None,
        }
    }

    /// The value the active counter at `position` had for the last evaluated event, counted or
    /// read (`None`: neither, or unknown), with its key.
    pub fn known_value(&self, position: usize) -> Option<(i64, &[u8])> {
        match self.outcomes.get(position) {
            Some(Outcome::Known { value, .. }) => Some((*value, &self.keys[position])),
            _ => None,
        }
    }

    /// Events the active counter at `position` skipped because a dimension was missing, since
    /// its counts were last taken.
    pub fn dimension_skips(&self, position: usize) -> u64 {
        self.counter_counts
            .get(position)
            .map_or(0, |c| c.skipped[SkipReason::Dimension.index()])
    }

    pub fn rules(&self) -> &RuleSet {
        &self.rules
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut S {
        &mut self.store
    }

    /// Gives the store back (flush it first if it buffers).
    pub fn into_store(self) -> S {
        self.store
    }

    pub fn counts(&self) -> EvalCounts {
        self.counts
    }

    /// Appends the (hold space, hold key) of every rule with a hold that judges `event`, for
    /// [`CounterStore::prefetch_holds`].
    pub fn touched_holds(&mut self, event: &Event<'_>, out: &mut Vec<(HoldSpace, Vec<u8>)>) {
        self.memo.reset();
        for (position, space) in self.hold_spaces.iter().enumerate() {
            let Some(space) = *space else { continue };
            if self.rules.in_scope(position, event, &mut self.memo)
                && self.rules.hold_key(position, event, &mut self.hold_key)
            {
                out.push((space, self.hold_key.clone()));
            }
        }
    }

    /// Lists the (window, key) of every counter `event` would count, and of every counter a
    /// rule may read for it, for [`CounterStore::prefetch`].
    pub fn touched_keys(&mut self, event: &Event<'_>, out: &mut Touched) {
        let key = &mut self.touched_key;
        self.memo.reset();
        for position in 0..self.rules.active_len() {
            if self.rules.touches(position, event, key, &mut self.memo) {
                out.insert(self.windows[position], key);
            }
        }
    }

    /// Appends the `apply` calls `evaluate` will make for `events` of `lane` (each with its
    /// offset), evaluated in this order and before anything else: the events behind the lane's
    /// watermark count nowhere, the others into every counter they feed, in file order (for
    /// [`CounterStore::count_ahead`]), each with whether its key includes the event's message
    /// key (`Planned::follows_message_key`). Changes nothing.
    pub fn plan_counts<'e>(
        &mut self,
        lane: u64,
        events: impl IntoIterator<Item = (&'e Event<'e>, i64, Option<&'e [u8]>)>,
        out: &mut Vec<Planned>,
    ) {
        let mut newest = self.newest(lane);
        for (event, offset, message_key) in events {
            // As `behind_watermark` will find, event by event.
            match newest {
                Some(n)
                    if self
                        .bounds
                        .watermark(n)
                        .is_some_and(|watermark| event.ts < watermark) =>
                {
                    continue
                }
                Some(n) => newest = Some(n.max(event.ts)),
                None => newest = Some(event.ts),
            }
            self.memo.reset();
            for position in 0..self.rules.active_len() {
                if let Plan::Observe(delta) =
                    self.rules
                        .plan(position, event, &mut self.keys[position], &mut self.memo)
                {
                    // A `last` window's delta carries its value: never counted ahead.
                    if delta == Delta::Last {
                        continue;
                    }
                    let origin = InputPosition { lane, offset };
                    let follows_message_key = message_key.is_some_and(|m| {
                        self.rules.counter_follows_message_key(position, event, m)
                    });
                    out.push(Planned {
                        window: self.windows[position],
                        key: self.keys[position].clone(),
                        ts_ms: event.ts,
                        delta,
                        origin,
                        follows_message_key,
                    });
                }
            }
        }
    }

    /// Counts `event`, read from `origin` (its input lane and position there), into every
    /// counter it feeds (in file order), then judges it with every rule (in file order) and
    /// returns the hits. An event behind its lane's watermark is late for every counter.
    pub fn evaluate(
        &mut self,
        event: &Event<'_>,
        origin: InputPosition,
    ) -> Result<Decision, StoreError> {
        self.counts.events += 1;
        let behind = self.behind_watermark(origin.lane, event.ts);
        if behind {
            self.counts.behind_watermark += 1;
        }
        self.store.set_origin(Some(origin));
        for &position in &self.last_positions {
            self.last_values[position] = None;
        }
        // Every counter's plan and key first, so the store can start fetching the event's
        // keys together; then the counting, in file order.
        plan_event(
            &self.rules,
            (!behind).then_some((&self.store, &self.windows[..])),
            event,
            &mut self.keys,
            &mut self.plans,
            &mut self.memo,
        );
        let active = self.rules.active_len();
        for position in 0..active {
            self.outcomes[position] = self.count(position, event, behind, self.plans[position])?;
        }
        let decision = self.judge(event)?;
        if !decision.is_empty() {
            self.counts.decisions += 1;
        }
        Ok(decision)
    }

    /// Counts `event` into the active counter at `position` as `plan` (its plan for the event)
    /// says; its outcome for the event (counted, late, or left to be read on first reference).
    #[inline]
    fn count(
        &mut self,
        position: usize,
        event: &Event<'_>,
        behind: bool,
        plan: Plan,
    ) -> Result<Outcome, StoreError> {
        Ok(match plan {
            Plan::NoMatch => {
                if behind {
                    Outcome::Unknown
                } else {
                    Outcome::Unread
                }
            }
            Plan::Skip(reason) => {
                *match reason {
                    SkipReason::Dimension => &mut self.counts.skipped_dimension,
                    SkipReason::SumField => &mut self.counts.skipped_sum_field,
                    SkipReason::SumRange => &mut self.counts.skipped_sum_range,
                    SkipReason::DistinctField => &mut self.counts.skipped_distinct_field,
                    SkipReason::LastField | SkipReason::ValueTooLong => {
                        &mut self.counts.skipped_last_field
                    }
                } += 1;
                self.counter_counts[position].skipped[reason.index()] += 1;
                // A skipped event did not feed the counter: a rule reads it (if its key
                // can be formed).
                if behind || reason == SkipReason::Dimension {
                    Outcome::Unknown
                } else {
                    Outcome::Unread
                }
            }
            Plan::Observe(_) if behind => {
                self.counts.late += 1;
                self.counter_counts[position].late += 1;
                Outcome::Unknown
            }
            Plan::Observe(delta) => {
                let observed = match delta {
                    Delta::Last => {
                        // Planned only for a field it keeps.
                        let Some(value) = self.rules.last_value(position, event) else {
                            return Ok(Outcome::Unknown);
                        };
                        let (observed, previous) = self.store.apply_last(
                            self.windows[position],
                            &self.keys[position],
                            event.ts,
                            value,
                        )?;
                        self.last_values[position] = previous;
                        observed
                    }
                    delta => self.store.apply(
                        self.windows[position],
                        &self.keys[position],
                        event.ts,
                        delta,
                    )?,
                };
                match observed.applied {
                    // Counted into a window that held nothing before it.
                    Applied::Empty => {
                        self.counter_counts[position].counted += 1;
                        Outcome::Unknown
                    }
                    Applied::Late => {
                        self.counts.late += 1;
                        self.counter_counts[position].late += 1;
                        Outcome::Unknown
                    }
                    Applied::Counted(value) => {
                        self.counter_counts[position].counted += 1;
                        Outcome::Known {
                            value,
                            degraded: observed.degraded,
                            dropped: observed.state_dropped,
                            counted: true,
                        }
                    }
                    Applied::Capped(value) => {
                        self.counter_counts[position].counted += 1;
                        self.counts.capped += 1;
                        self.counter_counts[position].capped += 1;
                        Outcome::Known {
                            value,
                            degraded: observed.degraded,
                            dropped: observed.state_dropped,
                            counted: true,
                        }
                    }
                }
            }
        })
    }

    /// Judges `event` in the order within one event that docs/rules.md gives: every rule that
    /// does not call `score()`, in file order, against the holds as they stood before this
    /// event; rollouts; suppression below the highest priority of a firing enforce-mode `final`
    /// rule; the score; the rules that call `score()`, likewise; then the holds of the hits fired
    /// by their condition — none when an enforce-mode allow hit allows the event. Counters the
    /// event did not feed are read on first reference.
    fn judge(&mut self, event: &Event<'_>) -> Result<Decision, StoreError> {
        let mut decision = Decision::default();
        // Active position of each hit, in step with `decision.hits`.
        let mut positions: SmallVec<[usize; 8]> = SmallVec::new();
        let rules = &self.rules;
        let mut judge = Judge {
            event,
            rules,
            store: &mut self.store,
            windows: &self.windows,
            keys: &mut self.keys,
            outcomes: &mut self.outcomes,
            last_values: &mut self.last_values,
            reads: &mut self.counts.reads,
            error: None,
            score: None,
        };
        let mut score_rules = false;
        for (position, index) in rules.active().enumerate() {
            if rules.rule(index).calls_score {
                score_rules = true;
                continue;
            }
            if let Some(hit) = judge_rule(
                &mut judge,
                &self.hold_spaces,
                (position, index),
                &mut self.memo,
                &mut self.hold_key,
                &mut self.rule_counts,
                &mut self.counts.on_dropped_state,
            )? {
                decision.hits.push(hit);
                positions.push(position);
            }
        }
        // A firing enforce-mode `final` rule suppresses every rule of lower priority.
        let top = decision
            .hits
            .iter()
            .filter(|h| h.mode == Mode::Enforce && rules.rule(h.rule).is_final)
            .map(|h| rules.rule(h.rule).priority)
            .max();
        if let Some(top) = top {
            let mut kept = 0;
            for i in 0..decision.hits.len() {
                if rules.rule(decision.hits[i].rule).priority >= top {
                    decision.hits.swap(kept, i);
                    positions.swap(kept, i);
                    kept += 1;
                }
            }
            decision.hits.truncate(kept);
            positions.truncate(kept);
        }
        if rules.is_scoring() {
            let score = decision
                .hits
                .iter()
                .filter(|h| h.mode == Mode::Enforce)
                .filter_map(|h| rules.rule(h.rule).score)
                .fold(0i64, i64::saturating_add);
            decision.score = Some(score);
        }
        if score_rules {
            judge.score = Some(decision.score.unwrap_or(0));
            let before = decision.hits.len();
            for (position, index) in rules.active().enumerate() {
                let rule = rules.rule(index);
                if !rule.calls_score || top.is_some_and(|top| rule.priority < top) {
                    continue;
                }
                if let Some(hit) = judge_rule(
                    &mut judge,
                    &self.hold_spaces,
                    (position, index),
                    &mut self.memo,
                    &mut self.hold_key,
                    &mut self.rule_counts,
                    &mut self.counts.on_dropped_state,
                )? {
                    decision.hits.push(hit);
                    positions.push(position);
                }
            }
            if decision.hits.len() > before {
                // Hits in rule-file order.
                let mut order: Vec<(Hit, usize)> =
                    decision.hits.drain(..).zip(positions.drain(..)).collect();
                order.sort_by_key(|(hit, _)| hit.rule);
                for (hit, position) in order {
                    decision.hits.push(hit);
                    positions.push(position);
                }
            }
        }
        // The action is needed only for an event with a hold to set.
        let sets_hold = decision
            .hits
            .iter()
            .zip(&positions)
            .any(|(hit, &position)| {
                hit.reason == Some(Reason::When) && self.hold_spaces[position].is_some()
            });
        let allowed = sets_hold && decision.action(rules) == Some(crate::rules::Action::Allow);
        for (hit, &position) in decision.hits.iter_mut().zip(&positions) {
            let rule = rules.rule(hit.rule);
            if hit.reason == Some(Reason::When) {
                if let (Some(space), Some(hold)) = (self.hold_spaces[position], &rule.hold) {
                    if rules.hold_key(position, event, &mut self.hold_key) {
                        judge.set_hold(hit, space, hold, &self.hold_key, allowed)?;
                    }
                }
            }
            self.rule_counts[position].hits += 1;
            if hit.mode == Mode::Shadow {
                self.rule_counts[position].shadow_hits += 1;
            }
            if hit.degraded {
                self.counts.degraded_hits += 1;
            }
        }
        if let Some(e) = judge.error {
            return Err(e);
        }
        Ok(decision)
    }
}

/// Every active counter's plan and key for `event` (its `match` results in `memo`), asking
/// `store` (unless the event is late for every counter) to start fetching the keys it will
/// count: the misses of an event's several keys then overlap instead of following one another.
fn plan_event<S: CounterStore>(
    rules: &RuleSet,
    store: Option<(&S, &[WindowId])>,
    event: &Event<'_>,
    keys: &mut [Vec<u8>],
    plans: &mut Vec<Plan>,
    memo: &mut ScopeMemo,
) {
    memo.reset();
    plans.clear();
    for (position, key) in keys.iter_mut().enumerate().take(rules.active_len()) {
        let plan = rules.plan(position, event, key, memo);
        if let (Plan::Observe(_), Some((store, windows))) = (plan, store) {
            store.fetch_ahead(windows[position], key);
        }
        plans.push(plan);
    }
}

/// One rule's hit on the event `judge` judges, if it fires: its scope, its condition or limit,
/// its hold as it stood before the event, and its rollout (shadow mode outside it).
#[inline]
fn judge_rule<'a: 'e, 'e, S: CounterStore>(
    judge: &mut Judge<'a, 'e, S>,
    hold_spaces: &[Option<HoldSpace>],
    (position, index): (usize, usize),
    memo: &mut ScopeMemo,
    hold_key: &mut Vec<u8>,
    rule_counts: &mut [RuleCounts],
    on_dropped_state: &mut u64,
) -> Result<Option<Hit>, StoreError> {
    let (rules, event) = (judge.rules, judge.event);
    if !rules.in_scope(position, event, memo) {
        return Ok(None);
    }
    rule_counts[position].matched += 1;
    let rule = rules.rule(index);
    let candidate = match rule.form {
        Form::V1 {
            counter, threshold, ..
        } => judge.v1_candidate(rule, index, counter, threshold),
        Form::V2 => judge.v2_candidate(rule, index),
    };
    let Some(mut hit) = candidate else {
        return Ok(None);
    };
    if let (Some(space), Some(_)) = (hold_spaces[position], &rule.hold) {
        let keyed = rules.hold_key(position, event, hold_key);
        judge.check_hold(&mut hit, space, rule.on_store_error, keyed, hold_key)?;
    }
    if hit.on_dropped_state {
        rule_counts[position].on_dropped_state += 1;
        *on_dropped_state += 1;
    }
    if !hit.fires {
        return Ok(None);
    }
    let mut hit = hit.hit;
    // Outside its rollout (or without a rollout key), a rule is in shadow mode.
    if let Some(rollout) = &rule.rollout {
        if rules
            .rollout_bucket(position, event)
            .is_none_or(|bucket| bucket >= rollout.basis_points)
        {
            hit.mode = Mode::Shadow;
        }
    }
    Ok(Some(hit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn set(text: &str) -> RuleSet {
        RuleSet::from_sources([("r.toml", text)]).unwrap()
    }

    #[test]
    fn a_reload_says_which_counters_keep_their_state() {
        let before = "[[counter]]\nid='a'\ndimensions=['u']\nwindow='1m'\n[[counter]]\nid='b'\ndimensions=['u']\nwindow='1m'\n[[counter]]\nid='c'\ndimensions=['u']\nwindow='1m'\n[[rule]]\nid='r'\naction='block'\nwhen='$a + $b + $c > 1'\n";
        let after = "[[counter]]\nid='a'\ndimensions=['u']\nwindow='1m'\n[[counter]]\nid='b'\ndimensions=['u']\nwindow='2m'\n[[counter]]\nid='c'\ndimensions=['u', 'v']\nwindow='1m'\n[[counter]]\nid='d'\ndimensions=['u']\nwindow='1m'\n[[rule]]\nid='r'\naction='block'\nwhen='$a + $b + $c + $d > 1'\n";
        let mut engine = Engine::new(set(before), MemoryStore::new());
        let (_, changes) = engine.reload_rules(set(after));
        assert_eq!(changes.kept, ["a"]);
        assert_eq!(changes.fresh, ["b", "c", "d"]);
        assert!(changes.redefined.is_empty());
        let (_, changes) = engine.reload_rules(set(&after.replace(
            "id='a'\ndimensions=['u']\n",
            "id='a'\nmatch='x == 1'\ndimensions=['u']\n",
        )));
        assert_eq!(changes.kept, ["a", "b", "c", "d"]);
        assert_eq!(changes.redefined, ["a"]);
    }

    /// A hold dropped at the store's bound is not taken as "not held": each rule's
    /// `on_store_error` decides (`block` fires with reason `state_dropped`, `local` and `allow`
    /// do not fire), and the judgement is counted. Through `AnyStore`, as replay and the worker
    /// run it (it once left the question to the trait's default, "never dropped").
    #[test]
    fn a_hold_dropped_at_the_bound_is_judged_by_the_rules_policy() {
        use crate::rules::Reason;
        use crate::store::AnyStore;
        let rules = |policy: &str| {
            set(&format!(
                "[[rule]]\nid='r'\naction='block'\nwhen='amount > 100'\nhold='1h'\nhold_key=['u']\non_store_error='{policy}'\n"
            ))
        };
        for (policy, fires) in [("block", true), ("local", false), ("allow", false)] {
            let store = AnyStore::Memory(MemoryStore::new().with_max_keys(16));
            let mut engine =
                Engine::new(rules(policy), store).with_time(TimeBounds::OFF, Arc::new(SystemClock));
            let line = |u: &str, ts: i64, amount: u32| {
                format!(r#"{{"ts":{ts},"u":"{u}","amount":{amount}}}"#)
            };
            let judge = |engine: &mut Engine<AnyStore>, text: String, offset: i64| {
                let projection = engine.rules().projection().clone();
                let event = crate::event::decode(text.as_bytes(), &projection).unwrap();
                engine
                    .evaluate(&event, InputPosition { lane: 0, offset })
                    .unwrap()
            };
            // The victim's hold ends first; 64 later holds push it out.
            let first = judge(&mut engine, line("victim", 1_000, 500), 0);
            assert_eq!(first.hits[0].held_until, Some(3_601_000));
            for i in 0..64 {
                judge(&mut engine, line(&format!("u{i}"), 2_000 + i, 500), 1 + i);
            }
            let later = judge(&mut engine, line("victim", 5_000, 1), 100);
            match later.hits.first() {
                Some(hit) => {
                    assert!(fires, "{policy}");
                    assert_eq!(
                        (hit.reason, hit.degraded),
                        (Some(Reason::StateDropped), true)
                    );
                }
                None => assert!(!fires, "{policy}"),
            }
            assert_eq!(engine.counts().on_dropped_state, 1, "{policy}");
            // Once every dropped hold has ended, nothing is in doubt.
            let after = judge(&mut engine, line("victim", 3_700_000, 1), 101);
            assert!(after.hits.is_empty(), "{policy}");
            assert_eq!(engine.counts().on_dropped_state, 1, "{policy}");
        }
    }

    /// Holds are set once the event's action is decided: none when an enforce-mode allow rule
    /// allows the event (an allow-listed card puts no device in the penalty box), and none for
    /// a rule a `final` rule suppressed.
    #[test]
    fn holds_follow_the_decided_action() {
        let rules = set("[[rule]]\nid='device-box'\naction='block'\nwhen='amount < 10'\nhold='1h'\nhold_key=['device']\n[[rule]]\nid='qa-card'\naction='allow'\nwhen=\"card == 'qa'\"\n[[rule]]\nid='vip'\naction='allow'\npriority=5\nfinal=true\nwhen='vip == true'\n");
        let mut engine = Engine::new(rules, MemoryStore::new())
            .with_time(TimeBounds::OFF, Arc::new(SystemClock));
        let mut judge = |line: &str, offset: i64| {
            let projection = engine.rules().projection().clone();
            let event = crate::event::decode(line.as_bytes(), &projection).unwrap();
            let decision = engine
                .evaluate(&event, InputPosition { lane: 0, offset })
                .unwrap();
            let ids: Vec<(String, Option<i64>)> = decision
                .hits
                .iter()
                .map(|h| (engine.rules().rule(h.rule).id.clone(), h.held_until))
                .collect();
            ids
        };
        // The QA card's small payment fires device-box, but the event is allowed: no hold.
        let qa = judge(r#"{"ts":1000,"card":"qa","device":"d1","amount":1}"#, 0);
        assert_eq!(qa, [("device-box".into(), None), ("qa-card".into(), None)]);
        assert!(judge(r#"{"ts":2000,"card":"c1","device":"d1","amount":50}"#, 1).is_empty());
        // A VIP's small payment: device-box is suppressed (priority 0 < 5), no hold either.
        assert_eq!(
            judge(
                r#"{"ts":3000,"card":"c2","device":"d2","amount":1,"vip":true}"#,
                2
            ),
            [("vip".into(), None)]
        );
        assert!(judge(r#"{"ts":4000,"card":"c1","device":"d2","amount":50}"#, 3).is_empty());
        // Anyone else's small payment holds the device for an hour.
        assert_eq!(
            judge(r#"{"ts":5000,"card":"c3","device":"d3","amount":1}"#, 4),
            [("device-box".into(), Some(3_605_000))]
        );
        assert_eq!(
            judge(r#"{"ts":6000,"card":"c1","device":"d3","amount":50}"#, 5),
            [("device-box".into(), Some(3_605_000))]
        );
    }
}
