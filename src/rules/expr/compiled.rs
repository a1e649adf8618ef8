//! The compiled form of an expression ([`Expr`]): field paths as projection slots, counters and
//! lists as indexes and shared sets, literals in the forms evaluation compares fastest; and the
//! identity by which equal `match` conjuncts are evaluated once per event.

use hashbrown::HashSet;
use ipnet::IpNet;
use regex::Regex;

use super::parse::BinOp;
use crate::event::{Decimal, FieldPath};
use crate::rules::lists::ListSet;

/// A number as an expression sees it: exact when it came from the event, a literal or a
/// counter; a double once arithmetic made it.
#[derive(Debug, Clone, PartialEq)]
pub struct Num {
    pub float: f64,
    pub exact: Option<Decimal>,
}

impl Num {
    pub fn exact(d: Decimal) -> Num {
        Num {
            float: d.to_f64(),
            exact: Some(d),
        }
    }
}

/// A literal scalar, hashed for `in [...]` sets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Literal {
    Null,
    Bool(bool),
    Num(Decimal),
    Str(String),
}

/// The comparison of a [`Expr::CounterCmp`], with the counter on the left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterCmp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

impl CounterCmp {
    /// `raw OP literal`, exactly, from the literal's scaled floor and ceiling.
    #[inline]
    pub(super) fn holds(self, raw: i64, floor: i64, ceil: i64) -> bool {
        match self {
            CounterCmp::Gt => raw > floor,
            CounterCmp::Ge => raw >= ceil,
            CounterCmp::Lt => raw < ceil,
            CounterCmp::Le => raw <= floor,
            CounterCmp::Eq => floor == ceil && raw == floor,
            CounterCmp::Ne => !(floor == ceil && raw == floor),
        }
    }
}

/// The strings of an `in [...]` set: a few compared in turn (faster than hashing), many hashed.
#[derive(Debug, Clone)]
pub enum StrSet {
    Few(Vec<Box<str>>),
    Many(HashSet<Box<str>, foldhash::fast::FixedState>),
}

impl StrSet {
    /// Up to this many strings are compared in turn.
    const FEW: usize = 8;

    pub(super) fn new(strings: Vec<Box<str>>) -> StrSet {
        if strings.len() <= StrSet::FEW {
            StrSet::Few(strings)
        } else {
            StrSet::Many(strings.into_iter().collect())
        }
    }

    pub fn is_empty(&self) -> bool {
        match self {
            StrSet::Few(few) => few.is_empty(),
            StrSet::Many(many) => many.is_empty(),
        }
    }

    #[inline]
    pub(super) fn contains(&self, s: &str) -> bool {
        match self {
            StrSet::Few(few) => few.iter().any(|t| t.as_ref() == s),
            StrSet::Many(many) => many.contains(s),
        }
    }
}

/// A compiled expression node.
#[derive(Debug, Clone)]
pub enum Expr {
    Lit(Literal),
    /// A number literal, with its double computed once.
    Num(Num),
    Field(usize),
    /// A list literal outside `in` (`tags == ['gift']`).
    List(Box<[Literal]>),
    Counter(usize),
    Not(Box<Expr>),
    Neg(Box<Expr>),
    Bin(BinOp, Box<Expr>, Box<Expr>),
    /// `field == 'text'` (or `!=`): the most common test, compared without building values.
    FieldIsStr {
        negated: bool,
        slot: usize,
        text: Box<str>,
    },
    /// `$counter OP number` (either way round), compared on the counter's raw integer scale:
    /// `floor` and `ceil` are the literal times 10^scale rounded down and up, so `raw > floor`
    /// is exactly `value > literal` (see [`CounterCmp`]).
    CounterCmp {
        cmp: CounterCmp,
        index: usize,
        floor: i64,
        ceil: i64,
    },
    /// `x in [...]`: string elements apart (looked up by `&str`, no allocation), the others by
    /// literal.
    InSet {
        negated: bool,
        value: Box<Expr>,
        strings: StrSet,
        set: HashSet<Literal>,
    },
    InField {
        negated: bool,
        value: Box<Expr>,
        field: usize,
    },
    InCidr {
        negated: bool,
        value: Box<Expr>,
        nets: Vec<IpNet>,
    },
    InList {
        negated: bool,
        value: Box<Expr>,
        list: std::sync::Arc<ListSet>,
    },
    Exists(usize),
    StartsWith(Box<Expr>, Box<Expr>),
    EndsWith(Box<Expr>, Box<Expr>),
    Contains(Box<Expr>, Box<Expr>),
    Matches(Box<Expr>, Box<Regex>),
    Lower(Box<Expr>),
    /// `ts()`: the event's time in epoch ms.
    Ts,
    /// `score()`: the event's score from the rules judged before.
    Score,
    /// `@map[key]`: the value for that key (unknown if absent or of the other kind).
    MapGet {
        key: Box<Expr>,
        list: std::sync::Arc<ListSet>,
    },
    /// `exists($c)`: the counter's value is known and not null.
    CounterExists(usize),
    /// `since($c)`: this event's time minus the time of the value a `last` counter holds.
    Since(usize),
    /// `ip_prefix(ip, bits)`: the network of that many leading bits, as a string.
    IpPrefix(Box<Expr>, u8),
}

/// A parsed, resolved expression with what it reads.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub expr: Expr,
    /// Counters it refers to, in order of first reference.
    pub counters: Vec<usize>,
    /// Field paths it reads, for summaries.
    pub paths: Vec<FieldPath>,
    /// It calls `score()`.
    pub calls_score: bool,
}

impl Expr {
    /// Splits a top-level `a && b && …` into its conjuncts, in order (one item otherwise): an
    /// expression is true exactly when each of them is.
    pub fn conjuncts(&self) -> Vec<&Expr> {
        match self {
            Expr::Bin(BinOp::And, l, r) => {
                let mut all = l.conjuncts();
                all.extend(r.conjuncts());
                all
            }
            other => vec![other],
        }
    }

    /// A text equal for two expressions exactly when they are the same computation over the
    /// same inputs (lists by identity, sets in sorted order): conjuncts with the same identity
    /// are evaluated once per event, however many counters and rules repeat them.
    pub fn identity(&self) -> String {
        let mut out = String::new();
        self.write_identity(&mut out);
        out
    }

    fn write_identity(&self, out: &mut String) {
        use std::fmt::Write;
        let sub = |out: &mut String, tag: &str, children: &[&Expr]| {
            out.push_str(tag);
            out.push('(');
            for child in children {
                child.write_identity(out);
                out.push(',');
            }
            out.push(')');
        };
        match self {
            Expr::Lit(_)
            | Expr::Num(_)
            | Expr::List(_)
            | Expr::Field(_)
            | Expr::Counter(_)
            | Expr::Exists(_)
            | Expr::FieldIsStr { .. }
            | Expr::CounterCmp { .. }
            | Expr::CounterExists(_)
            | Expr::Since(_)
            | Expr::Score
            | Expr::Ts => {
                let _ = write!(out, "{self:?}");
            }
            Expr::IpPrefix(a, bits) => sub(out, &format!("ip_prefix{bits}"), &[a]),
            Expr::MapGet { key, list } => sub(
                out,
                &format!("map{:p}", std::sync::Arc::as_ptr(list)),
                &[key],
            ),
            Expr::InField {
                negated,
                value,
                field,
            } => sub(out, &format!("in_field{negated}{field}"), &[value]),
            Expr::Not(a) => sub(out, "not", &[a]),
            Expr::Neg(a) => sub(out, "neg", &[a]),
            Expr::Lower(a) => sub(out, "lower", &[a]),
            Expr::Bin(op, a, b) => sub(out, &format!("{op:?}"), &[a, b]),
            Expr::StartsWith(a, b) => sub(out, "starts_with", &[a, b]),
            Expr::EndsWith(a, b) => sub(out, "ends_with", &[a, b]),
            Expr::Contains(a, b) => sub(out, "contains", &[a, b]),
            Expr::Matches(a, regex) => sub(out, &format!("matches{:?}", regex.as_str()), &[a]),
            Expr::InSet {
                negated,
                value,
                strings,
                set,
            } => {
                let mut members: Vec<String> = match strings {
                    StrSet::Few(few) => few.iter().map(|s| format!("{s:?}")).collect(),
                    StrSet::Many(many) => many.iter().map(|s| format!("{s:?}")).collect(),
                };
                members.extend(set.iter().map(|l| format!("{l:?}")));
                members.sort_unstable();
                sub(out, &format!("in{negated}{members:?}"), &[value]);
            }
            Expr::InCidr {
                negated,
                value,
                nets,
            } => sub(out, &format!("cidr{negated}{nets:?}"), &[value]),
            Expr::InList {
                negated,
                value,
                list,
            } => {
                sub(
                    out,
                    &format!("list{negated}{:p}", std::sync::Arc::as_ptr(list)),
                    &[value],
                );
            }
        }
    }
}
