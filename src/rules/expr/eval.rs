//! The evaluator: a compiled [`Expr`] over one event's fields and counters ([`Context`]), in
//! three-valued logic (true / false / unknown), with strict types and exact numbers; also the
//! constant value of an expression that reads nothing. The hot path: generic over the context,
//! no dynamic dispatch, no allocation except `lower()` of a string that needs it.

use std::borrow::Cow;
use std::net::IpAddr;

use hashbrown::HashSet;

use super::compiled::{Expr, Literal, Num, StrSet};
use super::deep::Tree;
use super::parse::BinOp;
use crate::event::{Decimal, FieldValue};
use crate::rules::lists::ListSet;

/// A value during evaluation.
#[derive(Debug, Clone, PartialEq)]
pub enum Val<'e> {
    Unknown,
    Null,
    Bool(bool),
    Num(Num),
    Str(Cow<'e, str>),
    /// An event array: its elements, and its JSON text (for deep `==`).
    Array(&'e [FieldValue<'e>], &'e str),
    /// An event object's JSON text.
    Object(&'e str),
    /// A list literal.
    List(&'e [Literal]),
}

impl Val<'_> {
    fn is_composite(&self) -> bool {
        matches!(self, Val::Array(..) | Val::Object(_) | Val::List(_))
    }

    /// The value as deep equality sees it; `None` for unknown (and past the nesting bound).
    fn tree(&self) -> Option<Tree<'_>> {
        Some(match self {
            Val::Unknown => return None,
            Val::Null => Tree::Null,
            Val::Bool(b) => Tree::Bool(*b),
            Val::Num(n) => Tree::Num(match &n.exact {
                Some(d) => d.clone(),
                None => Decimal::from_f64(n.float)?,
            }),
            Val::Str(s) => Tree::Str(Cow::Borrowed(s)),
            Val::Array(_, text) | Val::Object(text) => Tree::from_json(text)?,
            Val::List(items) => Tree::from_literals(items),
        })
    }
}

/// Where an expression gets field and counter values.
pub trait Context<'e> {
    fn field(&self, slot: usize) -> &'e FieldValue<'e>;
    /// The counter's value for this event, or `None` when it is unknown (late, key unusable).
    fn counter(&mut self, index: usize) -> Option<Num>;
    /// The same value on the counter's raw integer scale (micro-units for a sum).
    fn counter_raw(&mut self, index: usize) -> Option<i64>;
    /// This event's time (epoch ms), for `ts()`; `None` where there is no event.
    fn event_time(&self) -> Option<i64>;
    /// A counter's value as the expression sees it (a `last` counter's is any scalar).
    fn counter_value(&mut self, index: usize) -> Val<'e> {
        self.counter(index).map_or(Val::Unknown, Val::Num)
    }
    /// `since($c)`: this event's time minus the time of the `last` counter's value.
    fn since(&mut self, _index: usize) -> Option<i64> {
        None
    }
    /// `score()`: the event's score so far; `None` outside judging.
    fn score(&self) -> Option<Num> {
        None
    }
}

fn field_val<'e>(v: &'e FieldValue<'e>) -> Val<'e> {
    match v {
        FieldValue::Missing => Val::Unknown,
        FieldValue::Null => Val::Null,
        FieldValue::Bool(b) => Val::Bool(*b),
        FieldValue::Number(n) => Val::Num(Num::exact(n.exact.clone())),
        FieldValue::Str(s) => Val::Str(Cow::Borrowed(s.as_ref())),
        FieldValue::Object(text) => Val::Object(text),
        FieldValue::Array(items, text) => Val::Array(items, text),
    }
}

fn lit_val(l: &Literal) -> Val<'_> {
    match l {
        Literal::Null => Val::Null,
        Literal::Bool(b) => Val::Bool(*b),
        Literal::Num(d) => Val::Num(Num::exact(d.clone())),
        Literal::Str(s) => Val::Str(Cow::Borrowed(s)),
    }
}

/// Three-valued truth: `None` is unknown.
pub type Truth = Option<bool>;

pub(super) fn truth(v: &Val<'_>) -> Truth {
    match v {
        Val::Bool(b) => Some(*b),
        _ => None,
    }
}

fn truth_val(t: Truth) -> Val<'static> {
    t.map_or(Val::Unknown, Val::Bool)
}

/// Strict equality; `None` when either side is unknown.
fn equal(a: &Val<'_>, b: &Val<'_>) -> Truth {
    Some(match (a, b) {
        (Val::Unknown, _) | (_, Val::Unknown) => return None,
        // Arrays and objects deeply (unknown past the nesting bound); never equal to a scalar.
        // Equal texts are equal values (the fast path); else trees, one pass each.
        (Val::Array(_, a) | Val::Object(a), Val::Array(_, b) | Val::Object(b)) if a == b => true,
        (x, y) if x.is_composite() && y.is_composite() => x.tree()? == y.tree()?,
        (Val::Null, Val::Null) => true,
        (Val::Bool(x), Val::Bool(y)) => x == y,
        (Val::Num(x), Val::Num(y)) => match (&x.exact, &y.exact) {
            (Some(p), Some(q)) => p == q,
            _ => x.float == y.float,
        },
        (Val::Str(x), Val::Str(y)) => x == y,
        _ => false,
    })
}

fn order(a: &Val<'_>, b: &Val<'_>) -> Option<std::cmp::Ordering> {
    match (a, b) {
        (Val::Num(x), Val::Num(y)) => match (&x.exact, &y.exact) {
            (Some(p), Some(q)) => Some(p.cmp(q)),
            _ => x.float.partial_cmp(&y.float),
        },
        (Val::Str(x), Val::Str(y)) => Some(x.as_ref().cmp(y.as_ref())),
        _ => None,
    }
}

/// Whether a value equals a literal (strict types, numbers by decimal value).
fn equals_literal(v: &Val<'_>, l: &Literal) -> bool {
    match (v, l) {
        (Val::Null, Literal::Null) => true,
        (Val::Bool(a), Literal::Bool(b)) => a == b,
        (Val::Num(n), Literal::Num(d)) => match &n.exact {
            Some(e) => e == d,
            None => n.float == d.to_f64(),
        },
        (Val::Str(s), Literal::Str(t)) => s.as_ref() == t.as_str(),
        _ => false,
    }
}

/// The literal a value is, for a set lookup (`None`: it can be in no literal set).
fn as_literal_key(v: &Val<'_>) -> Option<Literal> {
    match v {
        Val::Null => Some(Literal::Null),
        Val::Bool(b) => Some(Literal::Bool(*b)),
        Val::Num(Num { exact: Some(d), .. }) => Some(Literal::Num(d.clone())),
        _ => None,
    }
}

fn negate_if(negated: bool, t: Truth) -> Truth {
    t.map(|b| b != negated)
}

/// Whether a value is in an `in [...]` set (`None`: unknown).
#[inline]
fn in_set(v: &Val<'_>, strings: &StrSet, set: &HashSet<Literal>) -> Truth {
    match v {
        Val::Unknown => None,
        Val::Str(s) => Some(strings.contains(s)),
        Val::Num(Num { exact: None, .. }) => Some(set.iter().any(|l| equals_literal(v, l))),
        other => Some(as_literal_key(other).is_some_and(|key| set.contains(&key))),
    }
}

/// Whether a value equals an item of an event array (`None`: unknown, or `field` is no array).
#[inline]
fn in_array<'e>(v: &Val<'_>, field: &'e FieldValue<'e>) -> Truth {
    match (v, field) {
        (Val::Unknown, _) => None,
        // An array or object: its tree built once, then compared with each composite item.
        (v, FieldValue::Array(items, _)) if v.is_composite() => {
            let tree = v.tree()?;
            Some(items.iter().any(|item| {
                let item = field_val(item);
                item.is_composite() && item.tree().is_some_and(|t| t == tree)
            }))
        }
        (_, FieldValue::Array(items, _)) => Some(
            items
                .iter()
                .any(|item| equal(v, &field_val(item)) == Some(true)),
        ),
        _ => None,
    }
}

/// Whether a value is in a loaded list. Strict types: a value of another type is simply not in
/// a string or number list; a cidr list needs a string address (else unknown).
#[inline]
fn in_list(v: Val<'_>, list: &ListSet) -> Truth {
    match (v, list) {
        (Val::Unknown, _) => None,
        (Val::Str(s), ListSet::Strings(set)) => Some(set.contains(s.as_ref())),
        (
            Val::Num(Num {
                exact: Some(ref d), ..
            }),
            ListSet::Numbers(set),
        ) => Some(set.contains(d)),
        (Val::Num(n), ListSet::Numbers(set)) => {
            Some(Decimal::from_f64(n.float).is_some_and(|d| set.contains(&d)))
        }
        (_, ListSet::Strings(_) | ListSet::Numbers(_)) => Some(false),
        (Val::Str(s), ListSet::Networks(nets)) => {
            s.parse::<IpAddr>().ok().map(|ip| nets.contains(ip))
        }
        (_, ListSet::Networks(_)) => None,
        // A map tests its keys.
        (Val::Str(s), ListSet::StringMap(map)) => Some(map.contains_key(s.as_ref())),
        (Val::Num(n), ListSet::NumberMap(map)) => {
            Some(exact_of(&n).is_some_and(|d| map.contains_key(&d)))
        }
        (_, ListSet::StringMap(_) | ListSet::NumberMap(_)) => Some(false),
    }
}

/// A number's exact value (a double made by arithmetic, by its shortest decimal).
fn exact_of(n: &Num) -> Option<Decimal> {
    match &n.exact {
        Some(d) => Some(d.clone()),
        None => Decimal::from_f64(n.float),
    }
}

/// `@map[key]`: the value for `key`; unknown when absent or of the other kind.
fn map_get<'l>(key: Val<'_>, list: &'l ListSet) -> Val<'l> {
    let found = match (key, list) {
        (Val::Str(s), ListSet::StringMap(map)) => map.get(s.as_ref()),
        (Val::Num(n), ListSet::NumberMap(map)) => exact_of(&n).and_then(|d| map.get(&d)),
        _ => None,
    };
    found.map_or(Val::Unknown, lit_val)
}

impl Expr {
    /// Evaluates to a value.
    pub fn eval<'e, 's: 'e, C: Context<'e> + ?Sized>(&'s self, cx: &mut C) -> Val<'e> {
        match self {
            Expr::Lit(l) => lit_val(l),
            Expr::Num(n) => Val::Num(n.clone()),
            Expr::Field(slot) => field_val(cx.field(*slot)),
            Expr::Ts => cx.event_time().map_or(Val::Unknown, |ts| {
                Val::Num(Num::exact(Decimal::from_i64(ts)))
            }),
            Expr::IpPrefix(ip, bits) => match ip.eval(cx) {
                // The network the address is in, in canonical form (RFC 5952 for IPv6).
                Val::Str(s) => s
                    .parse::<IpAddr>()
                    .ok()
                    .and_then(|ip| ipnet::IpNet::new(ip, *bits).ok())
                    .map_or(Val::Unknown, |net| {
                        Val::Str(Cow::Owned(net.trunc().to_string()))
                    }),
                _ => Val::Unknown,
            },
            Expr::List(items) => Val::List(items),
            Expr::Counter(index) => cx.counter_value(*index),
            Expr::Score => cx.score().map_or(Val::Unknown, Val::Num),
            Expr::MapGet { key, list } => map_get(key.eval(cx), list),
            Expr::Since(index) => cx.since(*index).map_or(Val::Unknown, |ms| {
                Val::Num(Num::exact(Decimal::from_i64(ms)))
            }),
            Expr::Neg(inner) => match inner.eval(cx) {
                Val::Num(n) => Val::Num(Num {
                    float: -n.float,
                    exact: n.exact.map(|d| -d),
                }),
                _ => Val::Unknown,
            },
            Expr::Bin(op @ (BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div), l, r) => {
                match (l.eval(cx), r.eval(cx)) {
                    (Val::Num(x), Val::Num(y)) => {
                        let (x, y) = (x.float, y.float);
                        let v = match op {
                            BinOp::Add => x + y,
                            BinOp::Sub => x - y,
                            BinOp::Mul => x * y,
                            _ if y == 0.0 => return Val::Unknown,
                            _ => x / y,
                        };
                        if v.is_nan() {
                            Val::Unknown
                        } else {
                            Val::Num(Num {
                                float: v,
                                exact: None,
                            })
                        }
                    }
                    _ => Val::Unknown,
                }
            }
            Expr::Lower(a) => match a.eval(cx) {
                Val::Str(s) if s.bytes().any(|b| b.is_ascii_uppercase()) || !s.is_ascii() => {
                    Val::Str(Cow::Owned(s.to_lowercase()))
                }
                Val::Str(s) => Val::Str(s),
                _ => Val::Unknown,
            },
            // Every other node is a test: its value is its truth.
            _ => truth_val(self.test(cx)),
        }
    }

    /// The truth of the expression (`None`: unknown, including every non-boolean value),
    /// computed without building intermediate values where the node is a test: a `match` or
    /// `when` is almost always a tree of tests.
    pub fn test<'e, 's: 'e, C: Context<'e> + ?Sized>(&'s self, cx: &mut C) -> Truth {
        match self {
            Expr::Not(inner) => inner.test(cx).map(|b| !b),
            Expr::Bin(BinOp::And, l, r) => {
                let a = l.test(cx);
                if a == Some(false) {
                    return Some(false);
                }
                match (a, r.test(cx)) {
                    (_, Some(false)) => Some(false),
                    (Some(true), Some(true)) => Some(true),
                    _ => None,
                }
            }
            Expr::Bin(BinOp::Or, l, r) => {
                let a = l.test(cx);
                if a == Some(true) {
                    return Some(true);
                }
                match (a, r.test(cx)) {
                    (_, Some(true)) => Some(true),
                    (Some(false), Some(false)) => Some(false),
                    _ => None,
                }
            }
            Expr::Bin(
                op @ (BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge),
                l,
                r,
            ) => {
                let (a, b) = (l.eval(cx), r.eval(cx));
                match op {
                    BinOp::Eq => equal(&a, &b),
                    BinOp::Ne => equal(&a, &b).map(|e| !e),
                    _ => order(&a, &b).map(|o| match op {
                        BinOp::Lt => o.is_lt(),
                        BinOp::Le => o.is_le(),
                        BinOp::Gt => o.is_gt(),
                        _ => o.is_ge(),
                    }),
                }
            }
            Expr::CounterCmp {
                cmp,
                index,
                floor,
                ceil,
            } => cx
                .counter_raw(*index)
                .map(|raw| cmp.holds(raw, *floor, *ceil)),
            Expr::FieldIsStr {
                negated,
                slot,
                text,
            } => match cx.field(*slot) {
                FieldValue::Missing => None,
                FieldValue::Str(s) => Some((s.as_ref() == text.as_ref()) != *negated),
                // Strict types: a value of any other type is not equal to a string.
                _ => Some(*negated),
            },
            Expr::InSet {
                negated,
                value,
                strings,
                set,
            } => negate_if(*negated, in_set(&value.eval(cx), strings, set)),
            Expr::InField {
                negated,
                value,
                field,
            } => negate_if(*negated, in_array(&value.eval(cx), cx.field(*field))),
            Expr::InCidr {
                negated,
                value,
                nets,
            } => {
                let found = match value.eval(cx) {
                    Val::Str(s) => s
                        .parse::<IpAddr>()
                        .ok()
                        .map(|ip| nets.iter().any(|n| n.contains(&ip))),
                    _ => None,
                };
                negate_if(*negated, found)
            }
            Expr::InList {
                negated,
                value,
                list,
            } => negate_if(*negated, in_list(value.eval(cx), list)),
            Expr::Exists(slot) => Some(!matches!(
                cx.field(*slot),
                FieldValue::Missing | FieldValue::Null
            )),
            Expr::CounterExists(index) => Some(!matches!(
                cx.counter_value(*index),
                Val::Unknown | Val::Null
            )),
            Expr::StartsWith(a, b) | Expr::EndsWith(a, b) | Expr::Contains(a, b) => {
                match (a.eval(cx), b.eval(cx)) {
                    (Val::Str(s), Val::Str(p)) => Some(match self {
                        Expr::StartsWith(..) => s.starts_with(p.as_ref()),
                        Expr::EndsWith(..) => s.ends_with(p.as_ref()),
                        _ => s.contains(p.as_ref()),
                    }),
                    _ => None,
                }
            }
            Expr::Matches(a, regex) => match a.eval(cx) {
                Val::Str(s) => Some(regex.is_match(&s)),
                _ => None,
            },
            // A value: true only if it is the boolean true.
            Expr::Lit(_)
            | Expr::Num(_)
            | Expr::List(_)
            | Expr::Field(_)
            | Expr::Counter(_)
            | Expr::Ts
            | Expr::Score
            | Expr::MapGet { .. }
            | Expr::Since(_)
            | Expr::IpPrefix(..)
            | Expr::Neg(_)
            | Expr::Bin(..)
            | Expr::Lower(_) => truth(&self.eval(cx)),
        }
    }

    /// Whether the expression is true (a `match` or `when` acts only on true).
    #[inline]
    pub fn holds<'e, 's: 'e, C: Context<'e> + ?Sized>(&'s self, cx: &mut C) -> bool {
        self.test(cx) == Some(true)
    }

    /// A constant value, when the expression reads nothing (for "can never fire" warnings).
    pub fn constant(&self) -> Option<Val<'_>> {
        struct NoInput;
        impl<'e> Context<'e> for NoInput {
            fn field(&self, _: usize) -> &'e FieldValue<'e> {
                &FieldValue::Missing
            }
            fn counter(&mut self, _: usize) -> Option<Num> {
                None
            }
            fn counter_raw(&mut self, _: usize) -> Option<i64> {
                None
            }
            fn event_time(&self) -> Option<i64> {
                None
            }
        }
        if self.reads_input() {
            return None;
        }
        Some(self.eval(&mut NoInput))
    }

    fn reads_input(&self) -> bool {
        match self {
            Expr::Lit(_) | Expr::Num(_) | Expr::List(_) => false,
            Expr::Field(_)
            | Expr::Counter(_)
            | Expr::Exists(_)
            | Expr::InField { .. }
            | Expr::FieldIsStr { .. }
            | Expr::CounterCmp { .. }
            | Expr::CounterExists(_)
            | Expr::Since(_)
            | Expr::Score
            | Expr::Ts => true,
            Expr::MapGet { key, .. } => key.reads_input(),
            Expr::Not(a)
            | Expr::Neg(a)
            | Expr::Lower(a)
            | Expr::Matches(a, _)
            | Expr::IpPrefix(a, _) => a.reads_input(),
            Expr::Bin(_, a, b)
            | Expr::StartsWith(a, b)
            | Expr::EndsWith(a, b)
            | Expr::Contains(a, b) => a.reads_input() || b.reads_input(),
            Expr::InSet { value, .. } | Expr::InCidr { value, .. } | Expr::InList { value, .. } => {
                value.reads_input()
            }
        }
    }
}
