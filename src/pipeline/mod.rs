//! The pipeline: decode → plan → count → decide → record. The only module that knows every stage:
//! [`Engine`] evaluates one event, [`replay`] a JSON-lines stream, and [`worker`] runs the Kafka
//! worker around the same engine.

pub mod backtest;
pub mod worker;

use std::io::{self, BufRead, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::{Clock, SystemClock};
use smallvec::SmallVec;

use crate::event::{decode, BadEvent, Event, FieldValue, TimeBounds};
use crate::rules::expr::{Context, Num};
use crate::rules::{decide, Decision, Form, Hit, OnStoreError, Plan, Reason, RuleSet, Scope, ScopeMemo, SkipReason, Source};
use crate::store::{CounterStore, HoldSpace, Observed, Origin, StateStats, StoreError, WindowId};
use crate::window::Applied;

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
    /// Counter values read without counting (a rule referring to a counter the event did not feed).
    pub reads: u64,
    /// Events with at least one hit.
    pub decisions: u64,
    /// Hits made on values counted locally while the shared store was unavailable.
    pub degraded_hits: u64,
}

impl EvalCounts {
    pub fn skipped(&self) -> u64 {
        self.skipped_dimension + self.skipped_sum_field + self.skipped_sum_range + self.skipped_distinct_field
    }
}

/// What happened to one rule's evaluations, for per-rule metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuleCounts {
    /// Events in the rule's scope (its `match` held).
    pub matched: u64,
    pub hits: u64,
}

/// What happened to one counter's observations, for per-counter metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterCounts {
    pub late: u64,
    /// Distinct values not recorded: the key's window held `max_distinct` values.
    pub capped: u64,
    /// Skips by reason, indexed by [`SkipReason::index`].
    pub skipped: [u64; 4],
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

/// A counter's state for the event being evaluated.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Outcome {
    /// Not fed by the event and not read yet: read on first reference.
    Unread,
    /// Unknown: its key cannot be formed, or the event is late for it.
    Unknown,
    /// Counted, or read, with this raw value; `degraded` if computed from local state only.
    Known { value: i64, degraded: bool, counted: bool },
}

/// Evaluates events against a rule set over a counter store.
pub struct Engine<S> {
    rules: RuleSet,
    store: S,
    /// The store window of each active counter, by active position.
    windows: Vec<WindowId>,
    /// Per active counter: its key for the current event, and its outcome.
    keys: Vec<Vec<u8>>,
    outcomes: Vec<Outcome>,
    counts: EvalCounts,
    /// Per active rule, since the last [`Engine::take_rule_counts`].
    rule_counts: Vec<RuleCounts>,
    /// Per active counter, since the last [`Engine::take_counter_counts`].
    counter_counts: Vec<CounterCounts>,
    bounds: TimeBounds,
    clock: Arc<dyn Clock>,
    /// The newest accepted event time of each input lane (a Kafka partition; the whole input in
    /// replay): its watermark follows it.
    newest: Vec<(u64, i64)>,
    /// Per active rule: its hold space in the store (`None`: no hold).
    hold_spaces: Vec<Option<HoldSpace>>,
    /// The hold key of the rule being judged.
    hold_key: Vec<u8>,
    /// `match` results for the event being evaluated (and for prefetching).
    memo: ScopeMemo,
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
    hold_ms.saturating_mul(2).max(by_lateness).clamp(MIN_HOLD_TTL_MS, MAX_HOLD_TTL_MS)
}

/// Expression context over one event: fields from the event; counters from the outcomes of
/// counting, read from the store on first reference.
struct Judge<'a, 'e, S> {
    event: &'e Event<'e>,
    rules: &'a RuleSet,
    store: &'a mut S,
    windows: &'a [WindowId],
    keys: &'a mut [Vec<u8>],
    outcomes: &'a mut [Outcome],
    reads: &'a mut u64,
    error: Option<StoreError>,
}

impl<S: CounterStore> Judge<'_, '_, S> {
    /// The outcome of a counter for this event, reading it if needed.
    fn outcome(&mut self, counter: usize) -> Outcome {
        let Some(position) = self.rules.counter_position(counter) else { return Outcome::Unknown };
        if self.outcomes[position] == Outcome::Unread {
            self.outcomes[position] = if !self.rules.counter_key(position, self.event, &mut self.keys[position]) {
                Outcome::Unknown
            } else {
                *self.reads += 1;
                match self.store.read(self.windows[position], &self.keys[position], self.event.ts) {
                    Ok(Observed { applied, degraded }) => match applied.value() {
                        Some(value) => Outcome::Known { value, degraded, counted: false },
                        None => Outcome::Unknown,
                    },
                    Err(e) => {
                        self.error.get_or_insert(e);
                        Outcome::Unknown
                    }
                }
            };
        }
        self.outcomes[position]
    }
}

impl<'e, S: CounterStore> Context<'e> for Judge<'_, 'e, S> {
    fn field(&self, slot: usize) -> &'e FieldValue<'e> {
        self.event.field(slot)
    }

    fn counter(&mut self, index: usize) -> Option<Num> {
        match self.outcome(index) {
            Outcome::Known { value, .. } => {
                Some(Num::exact(decide::counter_value(self.rules.counter(index).aggregate(), value)))
            }
            _ => None,
        }
    }

    fn counter_raw(&mut self, index: usize) -> Option<i64> {
        match self.outcome(index) {
            Outcome::Known { value, .. } => Some(value),
            _ => None,
        }
    }
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
            counts: EvalCounts::default(),
            rule_counts: Vec::new(),
            counter_counts: Vec::new(),
            bounds: TimeBounds::default(),
            clock: Arc::new(SystemClock),
            newest: Vec::new(),
            hold_spaces: Vec::new(),
            hold_key: Vec::with_capacity(64),
            memo: ScopeMemo::default(),
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

    /// Opens the hold space of every active rule with a hold (by rule id: a reloaded rule keeps
    /// its holds).
    fn open_hold_spaces(&mut self) {
        let lateness = self.bounds.max_lateness_ms;
        let mut spaces = Vec::with_capacity(self.rules.active().len());
        for index in self.rules.active() {
            let rule = self.rules.rule(index);
            spaces.push(rule.hold.as_ref().map(|hold| self.store.open_holds(&rule.id, hold_ttl_ms(hold.ms, lateness))));
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
        self.newest.iter().find(|(l, _)| *l == lane).map(|&(_, n)| n)
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
                if self.bounds.watermark(*newest).is_some_and(|watermark| ts < watermark) {
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
            let old = self.rules.active_counters().map(|i| self.rules.counter(i)).find(|c| c.id == new.id);
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
    pub fn replace_rules(&mut self, rules: RuleSet) -> RuleSet {
        self.windows = rules
            .active_counters()
            .map(|index| {
                let counter = rules.counter(index);
                self.store.open_window(&counter.id, counter.window)
            })
            .collect();
        self.keys = vec![Vec::with_capacity(64); self.windows.len()];
        self.outcomes = vec![Outcome::Unread; self.windows.len()];
        self.counter_counts = vec![CounterCounts::default(); self.windows.len()];
        self.rule_counts = vec![RuleCounts::default(); rules.active().len()];
        self.memo = rules.scope_memo();
        let old = std::mem::replace(&mut self.rules, rules);
        self.open_hold_spaces();
        old
    }

    /// Per-rule counts since the last call, as (rule index, counts) of the active rules.
    pub fn take_rule_counts(&mut self) -> impl Iterator<Item = (usize, RuleCounts)> + '_ {
        let active: Vec<usize> = self.rules.active().collect();
        let counts = std::mem::replace(&mut self.rule_counts, vec![RuleCounts::default(); active.len()]);
        active.into_iter().zip(counts).filter(|(_, c)| *c != RuleCounts::default())
    }

    /// Per-counter counts since the last call, as (counter index, counts) of the active counters.
    pub fn take_counter_counts(&mut self) -> impl Iterator<Item = (usize, CounterCounts)> + '_ {
        let active: Vec<usize> = self.rules.active_counters().collect();
        let counts = std::mem::replace(&mut self.counter_counts, vec![CounterCounts::default(); active.len()]);
        active.into_iter().zip(counts).filter(|(_, c)| *c != CounterCounts::default())
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
            if self.rules.in_scope(position, event, &mut self.memo) && self.rules.hold_key(position, event, &mut self.hold_key) {
                out.push((space, self.hold_key.clone()));
            }
        }
    }

    /// Appends the (window, key) of every counter `event` would count, and of every counter a
    /// rule may read for it, for [`CounterStore::prefetch`].
    pub fn touched_keys(&mut self, event: &Event<'_>, out: &mut Vec<(WindowId, Vec<u8>)>) {
        let mut key = Vec::new();
        self.memo.reset();
        for position in 0..self.rules.active_len() {
            let wanted = match self.rules.plan(position, event, &mut key, &mut self.memo) {
                Plan::Observe(_) => true,
                Plan::Skip(SkipReason::Dimension) => false,
                Plan::Skip(_) => self.rules.is_read(position),
                Plan::NoMatch => self.rules.is_read(position) && self.rules.counter_key(position, event, &mut key),
            };
            if wanted {
                out.push((self.windows[position], key.clone()));
            }
        }
    }

    /// Counts `event`, read from `origin` (its input lane and position there), into every
    /// counter it feeds (in file order), then judges it with every rule (in file order) and
    /// returns the hits. An event behind its lane's watermark is late for every counter.
    pub fn evaluate(&mut self, event: &Event<'_>, origin: Origin) -> Result<Decision, StoreError> {
        self.counts.events += 1;
        let behind = self.behind_watermark(origin.lane, event.ts);
        if behind {
            self.counts.behind_watermark += 1;
        }
        self.store.set_origin(Some(origin));
        self.memo.reset();
        for position in 0..self.rules.active_len() {
            self.outcomes[position] = match self.rules.plan(position, event, &mut self.keys[position], &mut self.memo) {
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
                    let observed = self.store.apply(self.windows[position], &self.keys[position], event.ts, delta)?;
                    match observed.applied {
                        Applied::Late => {
                            self.counts.late += 1;
                            self.counter_counts[position].late += 1;
                            Outcome::Unknown
                        }
                        Applied::Counted(value) => Outcome::Known { value, degraded: observed.degraded, counted: true },
                        Applied::Capped(value) => {
                            self.counts.capped += 1;
                            self.counter_counts[position].capped += 1;
                            Outcome::Known { value, degraded: observed.degraded, counted: true }
                        }
                    }
                }
            };
        }
        let mut decision = Decision::default();
        let rules = &self.rules;
        let mut judge = Judge {
            event,
            rules,
            store: &mut self.store,
            windows: &self.windows,
            keys: &mut self.keys,
            outcomes: &mut self.outcomes,
            reads: &mut self.counts.reads,
            error: None,
        };
        for (position, index) in rules.active().enumerate() {
            if !rules.in_scope(position, event, &mut self.memo) {
                continue;
            }
            self.rule_counts[position].matched += 1;
            let rule = rules.rule(index);
            let mut hit = match rule.form {
                Form::V1 { counter, threshold, .. } => {
                    let Some(counter_position) = rules.counter_position(counter) else { continue };
                    // Fires only on an event its counter counted (v1 semantics); a held key fires
                    // it whatever its counter did.
                    match judge.outcomes[counter_position] {
                        Outcome::Known { value, degraded, counted: true } => {
                            let (fires, reason) = match (degraded, rule.on_store_error) {
                                (false, _) | (true, OnStoreError::Local) => (value > threshold, None),
                                (true, OnStoreError::Allow) => (false, None),
                                (true, OnStoreError::Block) => (true, Some(Reason::StoreUnavailable)),
                            };
                            Candidate { fires, reason, hit: Hit { rule: index, value: Some(value), reason, degraded, counters: SmallVec::new(), held_until: None } }
                        }
                        _ => Candidate::no(index),
                    }
                }
                Form::V2 => {
                    let holds = rule.when.as_ref().is_none_or(|when| when.expr.holds(&mut judge));
                    if !holds && rule.hold.is_none() && rule.on_store_error != OnStoreError::Block {
                        // It cannot fire: its record (and the reads it would list) is not needed.
                        continue;
                    }
                    // Every counter the condition names, known ones in the record, whatever
                    // evaluation short-circuited.
                    let mut counters = SmallVec::new();
                    let mut degraded = false;
                    for &counter in rule.counters() {
                        if let Outcome::Known { value, degraded: d, .. } = judge.outcome(counter) {
                            counters.push((counter, value));
                            degraded |= d;
                        }
                    }
                    let (fires, reason) = match (degraded, rule.on_store_error) {
                        (false, _) | (true, OnStoreError::Local) => (holds, Some(Reason::When)),
                        (true, OnStoreError::Allow) => (false, None),
                        (true, OnStoreError::Block) => (true, Some(Reason::StoreUnavailable)),
                    };
                    Candidate { fires, reason, hit: Hit { rule: index, value: None, reason, degraded, counters, held_until: None } }
                }
            };
            if let (Some(space), Some(hold)) = (self.hold_spaces[position], &rule.hold) {
                let keyed = rules.hold_key(position, event, &mut self.hold_key);
                if hit.fires && hit.reason != Some(Reason::StoreUnavailable) {
                    // Fired by its condition: the hold starts (or extends) from this event.
                    hit.hit.reason = Some(Reason::When);
                    if keyed {
                        let until = event.ts.saturating_add(hold.ms);
                        hit.hit.held_until = Some(judge.store.extend_hold(space, &self.hold_key, until)?);
                    }
                } else if keyed {
                    if let Some(until) = judge.store.held_until(space, &self.hold_key)? {
                        if event.ts < until {
                            if !hit.fires {
                                hit.fires = true;
                                hit.hit.reason = Some(Reason::Held);
                            }
                            hit.hit.held_until = Some(until);
                        }
                    }
                }
            }
            let hit = hit.fires.then_some(hit.hit);
            if let Some(hit) = hit {
                self.rule_counts[position].hits += 1;
                if hit.degraded {
                    self.counts.degraded_hits += 1;
                }
                decision.hits.push(hit);
            }
        }
        if let Some(e) = judge.error {
            return Err(e);
        }
        if !decision.is_empty() {
            self.counts.decisions += 1;
        }
        Ok(decision)
    }
}

/// A rule's hit before it is known whether it fires.
struct Candidate {
    fires: bool,
    reason: Option<Reason>,
    hit: Hit,
}

impl Candidate {
    /// A v1-form rule whose counter did not count the event: it fires only if held.
    fn no(rule: usize) -> Candidate {
        Candidate {
            fires: false,
            reason: None,
            hit: Hit { rule, value: None, reason: None, degraded: false, counters: SmallVec::new(), held_until: None },
        }
    }
}

/// Longest input line read by default (as `worker.max_event_bytes`): 1 MiB.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// Options of `vigil replay`.
#[derive(Debug, Clone, Copy)]
pub struct ReplayOptions {
    /// Longer lines are bad lines (`too_large`), skipped without being held in memory.
    pub max_event_bytes: usize,
    /// Also print a record (action `allow`, no hits) for events without any hit.
    pub emit_allow: bool,
    /// The input's lane: observations are tagged with it and their line number, so a store that
    /// records applied positions counts each line once however often its flush is retried or the
    /// same input replayed (see [`input_lane`]).
    pub lane: u64,
    /// At the end, how long to keep trying a shared store that is unavailable, so that what was
    /// counted locally meanwhile reaches it.
    pub store_wait: Duration,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions { max_event_bytes: DEFAULT_MAX_EVENT_BYTES, emit_allow: false, lane: 0, store_wait: Duration::ZERO }
    }
}

/// One line as [`read_line_bounded`] read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineRead {
    /// The input ended: nothing was read.
    End,
    /// A line (with its newline, if any) was appended.
    Line,
    /// A line of this many bytes (newline excluded) was longer than the limit: it was consumed
    /// and nothing was appended.
    TooLarge(usize),
}

/// Appends the next line of `input` to `out` unless it is longer than `limit` bytes, in which
/// case it is read through and dropped: memory stays bounded whatever the input (a stream
/// without a single newline included).
pub fn read_line_bounded(input: &mut impl BufRead, out: &mut Vec<u8>, limit: usize) -> io::Result<LineRead> {
    let start = out.len();
    let mut size = 0usize;
    let mut too_large = false;
    loop {
        let buf = match input.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            break;
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        let content = if done { take - 1 } else { take };
        size = size.saturating_add(content);
        if !too_large && size > limit {
            too_large = true;
            out.truncate(start);
        }
        if !too_large {
            out.extend_from_slice(&buf[..take]);
        }
        input.consume(take);
        if done {
            return Ok(if too_large { LineRead::TooLarge(size) } else { LineRead::Line });
        }
    }
    Ok(match (too_large, out.len() > start) {
        (true, _) => LineRead::TooLarge(size),
        (false, true) => LineRead::Line,
        (false, false) => LineRead::End,
    })
}

/// The lane of a replay input with identity `identity` (its content digest, or a name the user
/// chose): the top bit is set, so it never equals a Kafka partition's lane.
pub fn input_lane(identity: &[u8]) -> u64 {
    let digest = blake3::hash(identity);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(first) | (1 << 63)
}

/// What a replay did.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplaySummary {
    pub lines: u64,
    pub bad_lines: u64,
    pub counts: EvalCounts,
    pub elapsed: Duration,
    /// (counter, key) states held at the end, and the most held after any batch: the state a
    /// replay keeps (bounded by the lateness bound, not by the input's length).
    pub live_keys: usize,
    pub peak_live_keys: usize,
    /// The most bytes of local state estimated after any batch (in-process store; 0 otherwise).
    pub peak_state_bytes: usize,
    /// What the store dropped to stay within its bound of keys.
    pub state: StateStats,
}

impl ReplaySummary {
    pub fn events_per_second(&self) -> f64 {
        self.counts.events as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

impl std::fmt::Display for ReplaySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.counts;
        write!(
            f,
            "replay: {} events read, {} decisions, {} bad lines, {} late ({} events behind the watermark), \
             {} skipped ({} dimension, {} sum field, {} sum range, {} distinct field), {} counter reads, \
             {} distinct values over max_distinct, {} live keys (peak {}{}), {:.3}s, {:.0} events/s",
            c.events,
            c.decisions,
            self.bad_lines,
            c.late,
            c.behind_watermark,
            c.skipped(),
            c.skipped_dimension,
            c.skipped_sum_field,
            c.skipped_sum_range,
            c.skipped_distinct_field,
            c.reads,
            c.capped,
            self.live_keys,
            self.peak_live_keys,
            PeakState(self),
            self.elapsed.as_secs_f64(),
            self.events_per_second(),
        )
    }
}

/// ", ~12.5 MiB of state", and the keys the bound evicted, if any.
struct PeakState<'s>(&'s ReplaySummary);

impl std::fmt::Display for PeakState<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.0;
        if s.peak_state_bytes > 0 {
            write!(f, ", ~{:.1} MiB of state", s.peak_state_bytes as f64 / 1_048_576.0)?;
        }
        if s.state.evicted_keys > 0 || s.state.evicted_holds > 0 {
            write!(f, "; {} keys and {} holds evicted at the bound", s.state.evicted_keys, s.state.evicted_holds)?;
        }
        Ok(())
    }
}

/// An error that stops a replay: the output or input failed, or the store did.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ReplayError {
    pub fn code(&self) -> &'static str {
        match self {
            ReplayError::Io(_) => "io",
            ReplayError::Store(e) => e.code(),
        }
    }
}

/// Lines read and decoded together, so a store can load the keys they touch in one round trip.
const REPLAY_BATCH: usize = 1024;

/// A batch stops taking lines past this many bytes (plus one line of at most `max_event_bytes`).
const REPLAY_BATCH_BYTES: usize = 4 << 20;

/// Why a replay line gave no event.
enum Rejected {
    Bad(BadEvent),
    TooLarge(usize),
}

/// Replays JSON lines from `input`: one decision record per line to `output`, one line per bad
/// input line to `diagnostics`. Streams in batches of lines: memory is bounded by the batch, the
/// longest line and the live keys.
pub fn replay<S: CounterStore>(
    engine: &mut Engine<S>,
    mut input: impl BufRead,
    mut output: impl Write,
    mut diagnostics: impl Write,
    options: ReplayOptions,
) -> Result<ReplaySummary, ReplayError> {
    let started = Instant::now();
    let mut summary = ReplaySummary::default();
    let mut evictions_said = None::<Instant>;
    let mut batch = Vec::with_capacity(REPLAY_BATCH * 256);
    let mut ends = Vec::with_capacity(REPLAY_BATCH);
    let mut touched = Vec::new();
    let mut touched_holds = Vec::new();
    let mut record = Vec::with_capacity(1024);
    loop {
        wait_while_saturated(engine.store_mut())?;
        batch.clear();
        ends.clear();
        // A batch ends at REPLAY_BATCH lines or REPLAY_BATCH_BYTES bytes, whichever comes first:
        // with lines of up to `max_event_bytes`, memory per batch stays bounded.
        while ends.len() < REPLAY_BATCH && batch.len() < REPLAY_BATCH_BYTES {
            match read_line_bounded(&mut input, &mut batch, options.max_event_bytes)? {
                LineRead::End => break,
                LineRead::Line => ends.push(Ok(batch.len())),
                LineRead::TooLarge(size) => ends.push(Err(size)),
            }
        }
        if ends.is_empty() {
            break;
        }
        let first_line = summary.lines + 1;
        summary.lines += ends.len() as u64;
        let mut events = Vec::with_capacity(ends.len());
        let mut start = 0;
        for end in &ends {
            let end = match end {
                Ok(end) => *end,
                Err(size) => {
                    events.push(Some(Err(Rejected::TooLarge(*size))));
                    continue;
                }
            };
            let text = trim_line(&batch[start..end]);
            start = end;
            events.push(if text.iter().all(u8::is_ascii_whitespace) {
                None
            } else {
                Some(decode(text, engine.rules().projection()).and_then(|event| engine.admit(&event).map(|()| event)).map_err(Rejected::Bad))
            });
        }
        if engine.store().prefetches() {
            touched.clear();
            for event in events.iter().flatten().flatten() {
                engine.touched_keys(event, &mut touched);
            }
            engine.store_mut().prefetch(&touched)?;
            touched_holds.clear();
            for event in events.iter().flatten().flatten() {
                engine.touched_holds(event, &mut touched_holds);
            }
            engine.store_mut().prefetch_holds(&touched_holds)?;
        }
        for (line, event) in (first_line..).zip(&events) {
            let event = match event {
                None => continue,
                Some(Ok(event)) => event,
                Some(Err(rejected)) => {
                    summary.bad_lines += 1;
                    match rejected {
                        Rejected::Bad(bad) => report_bad_line(&mut diagnostics, line, bad)?,
                        Rejected::TooLarge(size) => writeln!(
                            diagnostics,
                            "line {line}: bad event (too_large): line of {size} bytes is longer than max_event_bytes ({})",
                            options.max_event_bytes
                        )?,
                    }
                    continue;
                }
            };
            let decision = engine.evaluate(event, Origin { lane: options.lane, offset: line as i64 })?;
            engine.store_mut().tick()?;
            if !decision.is_empty() || options.emit_allow {
                record.clear();
                decide::write_record(&mut record, engine.rules(), event, &decision, Source::Line(line));
                record.push(b'\n');
                output.write_all(&record)?;
            }
        }
        summary.peak_live_keys = summary.peak_live_keys.max(engine.store().live_keys());
        summary.peak_state_bytes = summary.peak_state_bytes.max(engine.store().state_stats().bytes);
        warn_on_evictions(&mut diagnostics, engine.store().state_stats(), &mut summary.state, &mut evictions_said)?;
    }
    output.flush()?;
    flush_within(engine.store_mut(), options.store_wait)?;
    summary.counts = engine.counts();
    summary.live_keys = engine.store().live_keys();
    summary.peak_live_keys = summary.peak_live_keys.max(summary.live_keys);
    summary.state = engine.store().state_stats();
    summary.peak_state_bytes = summary.peak_state_bytes.max(summary.state.bytes);
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// Says on stderr, at most every ten seconds, that the store started evicting keys at its bound
/// (decisions on evicted keys are no longer exact).
fn warn_on_evictions(
    diagnostics: &mut impl Write,
    now: StateStats,
    known: &mut StateStats,
    said: &mut Option<Instant>,
) -> io::Result<()> {
    if (now.evicted_keys, now.evicted_holds) != (known.evicted_keys, known.evicted_holds)
        && said.is_none_or(|at| at.elapsed() >= Duration::from_secs(10))
    {
        writeln!(
            diagnostics,
            "replay: the counter state is at its bound of keys (--max-keys): {} keys and {} holds evicted so far, \
             oldest first; their counts restart from nothing",
            now.evicted_keys, now.evicted_holds
        )?;
        *known = now;
        *said = Some(Instant::now());
    }
    Ok(())
}

/// While the store's local state is at its bound (a long outage of the shared store), lets it
/// write behind instead of counting more; says so every ten seconds.
fn wait_while_saturated<S: CounterStore>(store: &mut S) -> Result<(), StoreError> {
    let mut said = None::<Instant>;
    while store.saturated() {
        if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
            eprintln!("replay: local counter state is full while the counter store is unavailable; waiting for it");
            said = Some(Instant::now());
        }
        store.tick()?;
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Flushes the store, trying again for up to `wait` while it is unavailable.
fn flush_within<S: CounterStore>(store: &mut S, wait: Duration) -> Result<(), StoreError> {
    let deadline = Instant::now() + wait;
    let mut said = false;
    loop {
        match store.flush() {
            Ok(()) => return Ok(()),
            Err(StoreError::Unavailable(reason)) if Instant::now() < deadline => {
                if !said {
                    eprintln!("replay: the counter store is unavailable ({reason}); waiting up to {}s to write what was counted", wait.as_secs());
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

fn trim_line(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

fn report_bad_line(diagnostics: &mut impl Write, line: u64, bad: &BadEvent) -> io::Result<()> {
    writeln!(diagnostics, "line {line}: bad event ({}): {bad}", bad.code())
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
        let (_, changes) = engine.reload_rules(set(&after.replace("id='a'\ndimensions=['u']\n", "id='a'\nmatch='x == 1'\ndimensions=['u']\n")));
        assert_eq!(changes.kept, ["a", "b", "c", "d"]);
        assert_eq!(changes.redefined, ["a"]);
    }
}
