//! Judging one event with one rule: the expression context over the event (fields from the
//! event, counters from what counting found, read from the store on first reference), and a
//! rule's candidate hit by its form (v1 `limit`, v2 `when`) and its hold.

use smallvec::SmallVec;

use crate::event::{Event, FieldValue};
use crate::rules::expr::{Context, Num, Val};
use crate::rules::model::Hold;
use crate::rules::{decide, Hit, Mode, OnStoreError, Reason, Rule, RuleSet};
use crate::store::{CounterStore, HoldSpace, Observed, StoreError, WindowId};
use crate::window::{Aggregate, LastValue};

/// A counter's state for the event being evaluated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Outcome {
    /// Not fed by the event and not read yet: read on first reference.
    Unread,
    /// Unknown: its key cannot be formed, or the event is late for it.
    Unknown,
    /// Counted, or read, with this raw value; `degraded` if computed from local state only,
    /// `dropped` if part of the key's window was dropped at the store's bound (a lower bound).
    Known {
        value: i64,
        degraded: bool,
        dropped: bool,
        counted: bool,
    },
}

/// A `last` counter's value as expressions see it.
fn last_val(value: &LastValue) -> Val<'static> {
    match value {
        LastValue::Bool(b) => Val::Bool(*b),
        LastValue::Num(d) => Val::Num(Num::exact(d.clone())),
        LastValue::Str(s) => Val::Str(std::borrow::Cow::Owned(s.to_string())),
    }
}

/// Expression context over one event: fields from the event; counters from the outcomes of
/// counting, read from the store on first reference.
pub(super) struct Judge<'a, 'e, S> {
    pub(super) event: &'e Event<'e>,
    pub(super) rules: &'a RuleSet,
    pub(super) store: &'a mut S,
    pub(super) windows: &'a [WindowId],
    pub(super) keys: &'a mut [Vec<u8>],
    pub(super) outcomes: &'a mut [Outcome],
    pub(super) last_values: &'a mut [Option<LastValue>],
    pub(super) reads: &'a mut u64,
    pub(super) error: Option<StoreError>,
    /// The event's score (micro-units) while the rules that call `score()` are judged.
    pub(super) score: Option<i64>,
}

impl<S: CounterStore> Judge<'_, '_, S> {
    /// The outcome of a counter for this event, reading it if needed.
    fn outcome(&mut self, counter: usize) -> Outcome {
        let Some(position) = self.rules.counter_position(counter) else {
            return Outcome::Unknown;
        };
        if self.outcomes[position] == Outcome::Unread {
            self.outcomes[position] =
                if !self
                    .rules
                    .counter_key(position, self.event, &mut self.keys[position])
                {
                    Outcome::Unknown
                } else {
                    *self.reads += 1;
                    let read = if self.rules.counter(counter).aggregate() == Aggregate::Last {
                        self.store
                            .read_last(self.windows[position], &self.keys[position], self.event.ts)
                            .map(|(observed, value)| {
                                self.last_values[position] = value;
                                observed
                            })
                    } else {
                        self.store
                            .read(self.windows[position], &self.keys[position], self.event.ts)
                    };
                    match read {
                        Ok(Observed {
                            applied,
                            degraded,
                            state_dropped,
                        }) => match applied.value() {
                            Some(value) => Outcome::Known {
                                value,
                                degraded,
                                dropped: state_dropped,
                                counted: false,
                            },
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

    fn event_time(&self) -> Option<i64> {
        Some(self.event.ts)
    }

    fn counter(&mut self, index: usize) -> Option<Num> {
        match self.outcome(index) {
            Outcome::Known { value, .. } => Some(Num::exact(decide::counter_value(
                self.rules.counter(index).aggregate(),
                value,
            ))),
            _ => None,
        }
    }

    fn counter_raw(&mut self, index: usize) -> Option<i64> {
        match self.outcome(index) {
            Outcome::Known { value, .. } => Some(value),
            _ => None,
        }
    }

    fn counter_value(&mut self, index: usize) -> Val<'e> {
        match self.outcome(index) {
            Outcome::Known { value, .. } => match self.rules.counter(index).aggregate() {
                Aggregate::Last => self
                    .rules
                    .counter_position(index)
                    .and_then(|p| self.last_values[p].as_ref())
                    .map_or(Val::Unknown, last_val),
                aggregate => Val::Num(Num::exact(decide::counter_value(aggregate, value))),
            },
            _ => Val::Unknown,
        }
    }

    fn since(&mut self, index: usize) -> Option<i64> {
        match self.outcome(index) {
            Outcome::Known { value, .. } => Some(self.event.ts.saturating_sub(value)),
            _ => None,
        }
    }

    fn score(&self) -> Option<Num> {
        self.score
            .map(|micros| Num::exact(crate::decimal::Decimal::from_micros(micros)))
    }
}

/// A rule's hit before it is known whether it fires.
pub(super) struct Candidate {
    pub(super) fires: bool,
    reason: Option<Reason>,
    /// Judged on state dropped at the store's bound (a lower bound, or an unknown hold).
    pub(super) on_dropped_state: bool,
    pub(super) hit: Hit,
}

/// How a rule judges on a value that is not exact — computed locally while the shared store is
/// unavailable (`degraded`), or a lower bound because state was dropped at the in-process bound
/// (`dropped`) — by its `on_store_error`: whether it fires (`condition` being what the value
/// says), and the reason it gives if the policy decided.
fn judge_inexact(
    condition: bool,
    degraded: bool,
    dropped: bool,
    policy: OnStoreError,
) -> (bool, Option<Reason>) {
    match (degraded || dropped, policy) {
        (false, _) | (true, OnStoreError::Local) => (condition, None),
        (true, OnStoreError::Allow) => (false, None),
        (true, OnStoreError::Block) if dropped => (true, Some(Reason::StateDropped)),
        (true, OnStoreError::Block) => (true, Some(Reason::StoreUnavailable)),
    }
}

impl Candidate {
    /// A rule with a hold judged while whether its key is held is not known (`dropped`: the
    /// hold may have been dropped at the bound; else the shared store is away): fired by its
    /// policy if its condition did not fire it, and marked degraded if it fires.
    fn on_unknown_hold(&mut self, policy: OnStoreError, dropped: bool) {
        if !self.fires {
            if let (true, reason) = judge_inexact(false, !dropped, dropped, policy) {
                self.fires = true;
                self.hit.reason = reason;
            }
        }
        if self.fires {
            self.hit.degraded = true;
        }
    }

    /// A v1-form rule whose counter did not count the event: it fires only if held.
    fn no(rule: usize, mode: Mode) -> Candidate {
        Candidate {
            fires: false,
            reason: None,
            on_dropped_state: false,
            hit: Hit {
                rule,
                mode,
                value: None,
                reason: None,
                degraded: false,
                counters: SmallVec::new(),
                held_until: None,
                values: Vec::new(),
            },
        }
    }
}

impl<'a: 'e, 'e, S: CounterStore> Judge<'a, 'e, S> {
    /// A v1-form rule (`window` + `limit`) at rule index `index`: fires only on an event its
    /// counter counted (v1 semantics); a held key fires it whatever its counter did. `None`:
    /// its counter is not active, the rule is passed over.
    #[inline]
    pub(super) fn v1_candidate(
        &self,
        rule: &Rule,
        index: usize,
        counter: usize,
        threshold: i64,
    ) -> Option<Candidate> {
        let counter_position = self.rules.counter_position(counter)?;
        Some(match self.outcomes[counter_position] {
            Outcome::Known {
                value,
                degraded,
                dropped,
                counted: true,
            } => {
                let (fires, reason) =
                    judge_inexact(value > threshold, degraded, dropped, rule.on_store_error);
                Candidate {
                    fires,
                    reason,
                    on_dropped_state: dropped,
                    hit: Hit {
                        rule: index,
                        mode: rule.mode,
                        value: Some(value),
                        reason,
                        degraded: degraded || dropped,
                        counters: SmallVec::new(),
                        held_until: None,
                        values: Vec::new(),
                    },
                }
            }
            _ => Candidate::no(index, rule.mode),
        })
    }

    /// A v2-form rule (`when`) at rule index `index`. `None`: it cannot fire, its record (and
    /// the reads it would list) is not needed.
    #[inline]
    pub(super) fn v2_candidate(&mut self, rule: &'a Rule, index: usize) -> Option<Candidate> {
        let holds = rule.when.as_ref().is_none_or(|when| when.expr.holds(self));
        if !holds && rule.hold.is_none() && rule.on_store_error != OnStoreError::Block {
            return None;
        }
        // Every counter the condition names, known ones in the record, whatever
        // evaluation short-circuited.
        let mut counters = SmallVec::new();
        let mut values = Vec::new();
        let (mut degraded, mut dropped) = (false, false);
        for &counter in rule.counters() {
            if let Outcome::Known {
                value,
                degraded: d,
                dropped: x,
                ..
            } = self.outcome(counter)
            {
                counters.push((counter, value));
                if self.rules.counter(counter).aggregate() == Aggregate::Last {
                    if let Some(v) = self
                        .rules
                        .counter_position(counter)
                        .and_then(|p| self.last_values[p].clone())
                    {
                        values.push((counter, v));
                    }
                }
                degraded |= d;
                dropped |= x;
            }
        }
        let (fires, reason) = judge_inexact(holds, degraded, dropped, rule.on_store_error);
        let reason = reason.or(Some(Reason::When));
        Some(Candidate {
            fires,
            reason,
            on_dropped_state: dropped,
            hit: Hit {
                rule: index,
                mode: rule.mode,
                value: None,
                reason,
                degraded: degraded || dropped,
                counters,
                held_until: None,
                values,
            },
        })
    }

    /// A rule with a hold, judged against the holds as they stood before this event: fired by
    /// its condition, its reason is `when` (the hold is set once the event's action is decided,
    /// [`Judge::set_hold`]); otherwise a key still held makes it fire. `keyed`: the event's
    /// hold key (`key`) could be formed.
    #[inline]
    pub(super) fn check_hold(
        &mut self,
        hit: &mut Candidate,
        space: HoldSpace,
        policy: OnStoreError,
        keyed: bool,
        key: &[u8],
    ) -> Result<(), StoreError> {
        if hit.fires
            && !matches!(
                hit.reason,
                Some(Reason::StoreUnavailable | Reason::StateDropped)
            )
        {
            hit.hit.reason = Some(Reason::When);
        } else if keyed {
            match self.store.held_until(space, key)? {
                Some(until) if self.event.ts < until => {
                    if !hit.fires {
                        hit.fires = true;
                        hit.hit.reason = Some(Reason::Held);
                    }
                    hit.hit.held_until = Some(until);
                }
                // "Not held" is not known, so the rule's policy decides, as for a value counted
                // then: the shared store is away and this process never saw the hold (another
                // worker may have set one), or a hold that may still run was dropped at the
                // in-process bound.
                _ if self.store.hold_unknown(space, key) => hit.on_unknown_hold(policy, false),
                _ if self.store.hold_dropped(space, key, self.event.ts) => {
                    hit.on_dropped_state = true;
                    hit.on_unknown_hold(policy, true);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A hit fired by its rule's condition: its hold starts (or extends) from this event, unless
    /// `allowed` (the event is allowed by an enforce-mode allow rule: no penalty box), when the
    /// hit shows the hold as it stands.
    pub(super) fn set_hold(
        &mut self,
        hit: &mut Hit,
        space: HoldSpace,
        hold: &Hold,
        key: &[u8],
        allowed: bool,
    ) -> Result<(), StoreError> {
        hit.held_until = if allowed {
            let held = self
                .store
                .held_until(space, key)?
                .filter(|&until| self.event.ts < until);
            if held.is_none() && self.store.hold_unknown(space, key) {
                hit.degraded = true;
            }
            held
        } else {
            // A hold the store cannot see now may run later than this one: the hit says its
            // `held_until` is what this process knows, not necessarily the hold in force.
            if self.store.hold_unknown(space, key) {
                hit.degraded = true;
            }
            let until = self.event.ts.saturating_add(hold.ms);
            Some(self.store.extend_hold(space, key, until)?)
        };
        Ok(())
    }
}
