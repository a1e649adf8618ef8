//! Expressions: `match` and `when` strings, parsed once with a span on every node, resolved
//! against the event projection and the counters, and evaluated per event in three-valued logic
//! (true / false / unknown). Pure.
//!
//! Text → `lex` (tokens) → `parse` (syntax tree, by precedence climbing) → `resolve` (names to
//! slots and indexes: the compiled [`Expr`], defined here with the module's API) → `eval` (per
//! event).

mod eval;
mod lex;
mod parse;
mod resolve;

use hashbrown::HashSet;
use ipnet::IpNet;
use regex::Regex;

use super::lists::ListSet;
use crate::event::{Decimal, FieldPath, Projection};

pub use eval::{Context, Num, Truth, Val};
pub use parse::{BinOp, MAX_NESTING};
pub use resolve::Names;

/// A syntax or name error at a byte offset of the expression text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExprError {
    pub offset: usize,
    pub message: String,
}

fn err<T>(offset: usize, message: impl Into<String>) -> Result<T, ExprError> {
    Err(ExprError { offset, message: message.into() })
}

/// Parses and resolves `text`. `allow_counters` is false for a `match`.
pub fn compile(text: &str, projection: &mut Projection, names: &dyn Names, allow_counters: bool) -> Result<Compiled, ExprError> {
    let ast = parse::parse(text)?;
    resolve::resolve(&ast, projection, names, allow_counters)
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
    fn holds(self, raw: i64, floor: i64, ceil: i64) -> bool {
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

    fn new(strings: Vec<Box<str>>) -> StrSet {
        if strings.len() <= StrSet::FEW {
            StrSet::Few(strings)
        } else {
            StrSet::Many(strings.into_iter().collect())
        }
    }

    #[inline]
    fn contains(&self, s: &str) -> bool {
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
    Counter(usize),
    Not(Box<Expr>),
    Neg(Box<Expr>),
    Bin(BinOp, Box<Expr>, Box<Expr>),
    /// `field == 'text'` (or `!=`): the most common test, compared without building values.
    FieldIsStr { negated: bool, slot: usize, text: Box<str> },
    /// `$counter OP number` (either way round), compared on the counter's raw integer scale:
    /// `floor` and `ceil` are the literal times 10^scale rounded down and up, so `raw > floor`
    /// is exactly `value > literal` (see [`CounterCmp`]).
    CounterCmp { cmp: CounterCmp, index: usize, floor: i64, ceil: i64 },
    /// `x in [...]`: string elements apart (looked up by `&str`, no allocation), the others by
    /// literal.
    InSet { negated: bool, value: Box<Expr>, strings: StrSet, set: HashSet<Literal> },
    InField { negated: bool, value: Box<Expr>, field: usize },
    InCidr { negated: bool, value: Box<Expr>, nets: Vec<IpNet> },
    InList { negated: bool, value: Box<Expr>, list: std::sync::Arc<ListSet> },
    Exists(usize),
    StartsWith(Box<Expr>, Box<Expr>),
    EndsWith(Box<Expr>, Box<Expr>),
    Contains(Box<Expr>, Box<Expr>),
    Matches(Box<Expr>, Box<Regex>),
    Lower(Box<Expr>),
}

/// A parsed, resolved expression with what it reads.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub expr: Expr,
    /// Counters it refers to, in order of first reference.
    pub counters: Vec<usize>,
    /// Field paths it reads, for summaries.
    pub paths: Vec<FieldPath>,
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
            Expr::Lit(_) | Expr::Num(_) | Expr::Field(_) | Expr::Counter(_) | Expr::Exists(_) | Expr::FieldIsStr { .. } | Expr::CounterCmp { .. } => {
                let _ = write!(out, "{self:?}");
            }
            Expr::InField { negated, value, field } => sub(out, &format!("in_field{negated}{field}"), &[value]),
            Expr::Not(a) => sub(out, "not", &[a]),
            Expr::Neg(a) => sub(out, "neg", &[a]),
            Expr::Lower(a) => sub(out, "lower", &[a]),
            Expr::Bin(op, a, b) => sub(out, &format!("{op:?}"), &[a, b]),
            Expr::StartsWith(a, b) => sub(out, "starts_with", &[a, b]),
            Expr::EndsWith(a, b) => sub(out, "ends_with", &[a, b]),
            Expr::Contains(a, b) => sub(out, "contains", &[a, b]),
            Expr::Matches(a, regex) => sub(out, &format!("matches{:?}", regex.as_str()), &[a]),
            Expr::InSet { negated, value, strings, set } => {
                let mut members: Vec<String> = match strings {
                    StrSet::Few(few) => few.iter().map(|s| format!("{s:?}")).collect(),
                    StrSet::Many(many) => many.iter().map(|s| format!("{s:?}")).collect(),
                };
                members.extend(set.iter().map(|l| format!("{l:?}")));
                members.sort_unstable();
                sub(out, &format!("in{negated}{members:?}"), &[value]);
            }
            Expr::InCidr { negated, value, nets } => sub(out, &format!("cidr{negated}{nets:?}"), &[value]),
            Expr::InList { negated, value, list } => {
                sub(out, &format!("list{negated}{:p}", std::sync::Arc::as_ptr(list)), &[value]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::eval::truth;
    use super::*;
    use crate::event::{decode, quote_prefix, FieldValue};

    struct Counters;
    impl Names for Counters {
        fn counter(&self, id: &str) -> Result<usize, String> {
            match id {
                "fails" => Ok(0),
                "sum-1" => Ok(1),
                other => Err(format!("unknown counter {}", quote_prefix(other))),
            }
        }
        fn list(&self, id: &str) -> Result<std::sync::Arc<ListSet>, String> {
            Err(format!("unknown list {}", quote_prefix(id)))
        }
    }

    struct Cx<'e> {
        event: &'e crate::event::Event<'e>,
        counters: [Option<Num>; 2],
    }
    impl<'e> Context<'e> for Cx<'e> {
        fn field(&self, slot: usize) -> &'e FieldValue<'e> {
            self.event.field(slot)
        }
        fn counter(&mut self, index: usize) -> Option<Num> {
            self.counters[index]
        }
        fn counter_raw(&mut self, index: usize) -> Option<i64> {
            self.counters[index].map(|n| n.exact.and_then(Decimal::as_i64).unwrap())
        }
    }

    /// Evaluates `expr` on `event`: Some(true/false) or None (unknown).
    fn eval(expr: &str, event: &str) -> Option<bool> {
        let mut p = Projection::new();
        let c = compile(expr, &mut p, &Counters, true).unwrap_or_else(|e| panic!("{expr}: {e:?}"));
        let e = decode(event.as_bytes(), &p).unwrap();
        let mut cx = Cx { event: &e, counters: [Some(Num::exact(Decimal::from_i64(6))), None] };
        truth(&c.expr.eval(&mut cx))
    }

    fn error(expr: &str, allow_counters: bool) -> (usize, String) {
        let mut p = Projection::new();
        let e = compile(expr, &mut p, &Counters, allow_counters).unwrap_err();
        (e.offset, e.message)
    }

    #[test]
    fn three_valued_logic() {
        let ev = r#"{"ts":1,"a":true,"b":false}"#;
        assert_eq!(eval("a && b", ev), Some(false));
        assert_eq!(eval("missing && b", ev), Some(false));
        assert_eq!(eval("b && missing", ev), Some(false));
        assert_eq!(eval("a && missing", ev), None);
        assert_eq!(eval("a || missing", ev), Some(true));
        assert_eq!(eval("missing || a", ev), Some(true));
        assert_eq!(eval("b || missing", ev), None);
        assert_eq!(eval("!missing", ev), None);
        assert_eq!(eval("not b", ev), Some(true));
        assert_eq!(eval("!(missing == 1)", ev), None);
        assert_eq!(eval("!missing == true", ev), None);
        // Non-booleans are unknown to logic.
        assert_eq!(eval("1 && a", ev), None);
        assert_eq!(eval("'x' || b", ev), None);
    }

    #[test]
    fn strict_types_and_exact_numbers() {
        let ev = r#"{"ts":1,"n":1.0000000000000001,"one":1.0,"s":"1","z":null,"x":0.1,"y":0.2}"#;
        assert_eq!(eval("one == 1", ev), Some(true));
        assert_eq!(eval("n == 1", ev), Some(false));
        assert_eq!(eval("n > 1", ev), Some(true));
        assert_eq!(eval("s == 1", ev), Some(false));
        assert_eq!(eval("s != 1", ev), Some(true));
        assert_eq!(eval("s < 2", ev), None);
        assert_eq!(eval("z == null", ev), Some(true));
        assert_eq!(eval("z != 1", ev), Some(true));
        assert_eq!(eval("exists(z)", ev), Some(false));
        assert_eq!(eval("exists(s)", ev), Some(true));
        assert_eq!(eval("missing != 1", ev), None);
        assert_eq!(eval("x + y > 0.3", ev), Some(true));
        assert_eq!(eval("x + y == 0.30000000000000004", ev), Some(true));
        assert_eq!(eval("one / 0 > 1", ev), None);
        assert_eq!(eval("-one == -1", ev), Some(true));
        assert_eq!(eval("2 * 3 - 1 == 5", ev), Some(true));
        assert_eq!(eval("$fails > 5", ev), Some(true));
        assert_eq!(eval("$sum-1 > 5", ev), None);
        assert_eq!(eval("$fails / 4 == 1.5", ev), Some(true));
    }

    #[test]
    fn membership_and_functions() {
        let ev = r#"{"ts":1,"c":"FR","n":3,"tags":["vip",3],"ip":"10.1.2.3","ip6":"2001:db8::1","mapped":"::ffff:10.0.0.1","email":"Bob@Example.COM"}"#;
        assert_eq!(eval("c in ['FR', 'DE']", ev), Some(true));
        assert_eq!(eval("c not in ['FR', 'DE']", ev), Some(false));
        assert_eq!(eval("n in ['3']", ev), Some(false));
        assert_eq!(eval("n in [3.0]", ev), Some(true));
        assert_eq!(eval("missing in [1]", ev), None);
        assert_eq!(eval("'vip' in tags", ev), Some(true));
        assert_eq!(eval("n in tags", ev), Some(true));
        assert_eq!(eval("'x' in tags", ev), Some(false));
        assert_eq!(eval("'x' in c", ev), None);
        assert_eq!(eval("ip in cidr('10.0.0.0/8')", ev), Some(true));
        assert_eq!(eval("ip in cidr('192.168.0.0/16', '10.1.2.3')", ev), Some(true));
        assert_eq!(eval("ip6 in cidr('2001:db8::/32')", ev), Some(true));
        assert_eq!(eval("mapped in cidr('10.0.0.0/8')", ev), Some(false));
        assert_eq!(eval("c in cidr('10.0.0.0/8')", ev), None);
        assert_eq!(eval("n not in cidr('10.0.0.0/8')", ev), None);
        assert_eq!(eval("lower(email) == 'bob@example.com'", ev), Some(true));
        assert_eq!(eval("ends_with(lower(email), '.com')", ev), Some(true));
        assert_eq!(eval("starts_with(email, 'Bob')", ev), Some(true));
        assert_eq!(eval("contains(email, '@')", ev), Some(true));
        assert_eq!(eval("contains(n, '3')", ev), None);
        assert_eq!(eval("matches(email, '@example\\\\.com$')", ev), Some(false));
        assert_eq!(eval("matches(lower(email), '@example\\\\.com$')", ev), Some(true));
        assert_eq!(eval("headers.`x-forwarded-for` == null", r#"{"ts":1,"headers":{"x-forwarded-for":null}}"#), Some(true));
        assert_eq!(eval("`in` == 1", r#"{"ts":1,"in":1}"#), Some(true));
        assert_eq!(eval("'\\u{1F600}' == '\\uD83D\\uDE00' && 'a\\tb' == \"a\\tb\"", ev), Some(true));
    }

    #[test]
    fn errors_point_at_their_column() {
        assert_eq!(error("a < b < c", true), (6, "comparisons do not chain: combine them with '&&' or parentheses".into()));
        assert_eq!(error("amount > ", true), (9, "expected a value, found the end of the expression".into()));
        assert_eq!(error("$nope > 1", true), (0, "unknown counter \"nope\"".into()));
        assert_eq!(error("x && $fails > 1", false).0, 5);
        assert_eq!(error("ip in @bad", true), (6, "unknown list \"bad\"".into()));
        assert_eq!(error("foo(x)", true).1, "unknown function \"foo\"; expected exists, starts_with, ends_with, contains, matches, lower or cidr");
        assert_eq!(error("x == 'a\\q'", true), (7, "invalid escape '\\q'".into()));
        assert_eq!(error("x = 1", true), (2, "'=' is not an operator: write '=='".into()));
        assert_eq!(error("matches(x, '(')", true).0, 11);
        assert_eq!(error("exists('x')", true), (7, "exists() takes a field path".into()));
        assert_eq!(error("ip in cidr('10.0.0.0/33')", true).0, 11);
        assert_eq!(error("in == 1", true).0, 0);
        assert_eq!(error("x == 'open", true), (5, "unterminated string".into()));
        assert_eq!(error("", true), (0, "empty expression".into()));
    }
}
