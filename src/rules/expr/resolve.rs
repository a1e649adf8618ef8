//! The resolver: a syntax tree → the compiled [`Expr`], with field paths turned into projection
//! slots, `$counter` and `@list` into what [`Names`] gives, literal sets hashed, regular
//! expressions and networks compiled, and the common tests given their fast nodes
//! (`field == 'text'`, `$counter > number`).

use hashbrown::HashSet;
use ipnet::IpNet;

use super::compiled::{Compiled, CounterCmp, Expr, Literal, Num, StrSet};
use super::error::{err, ExprError};
use super::parse::{Ast, BinOp};
use crate::event::{quote_prefix, shorten, FieldPath, Projection};
use crate::rules::lists::{parse_network, ListSet};

/// What an expression may refer to, resolved at compile time.
pub trait Names {
    /// The index of counter `id`, or an error message.
    fn counter(&self, id: &str) -> Result<usize, String>;
    /// How many decimal places a counter's raw value has (6 for a sum's micro-units, else 0).
    fn counter_scale(&self, _index: usize) -> i32 {
        0
    }
    /// Whether a counter's aggregate is `last` (what `since()` takes).
    fn counter_is_last(&self, _index: usize) -> bool {
        false
    }
    /// The list `id`, or an error message.
    fn list(&self, id: &str) -> Result<std::sync::Arc<ListSet>, String>;
}

/// Resolves a parsed expression. `fields_only`: where it stands when it may read fields only
/// (`"a match"`, `"a key entry"`), `None` for a rule's `when`.
pub(super) fn resolve(
    ast: &(Ast, usize),
    projection: &mut Projection,
    names: &dyn Names,
    fields_only: Option<&'static str>,
) -> Result<Compiled, ExprError> {
    let mut resolver = Resolver {
        projection,
        names,
        fields_only,
        counters: Vec::new(),
        paths: Vec::new(),
        calls_score: false,
    };
    let expr = resolver.resolve(ast)?;
    Ok(Compiled {
        expr,
        counters: resolver.counters,
        paths: resolver.paths,
        calls_score: resolver.calls_score,
    })
}

struct Resolver<'a> {
    projection: &'a mut Projection,
    names: &'a dyn Names,
    fields_only: Option<&'static str>,
    counters: Vec<usize>,
    paths: Vec<FieldPath>,
    calls_score: bool,
}

impl Resolver<'_> {
    /// A `$counter` reference: its index, noted as read.
    fn counter(&mut self, id: &str, at: usize) -> Result<usize, ExprError> {
        if let Some(site) = self.fields_only {
            return err(
                at,
                format!(
                    "{site} cannot use counters (${}): test it in the rule's `when`",
                    shorten(id)
                ),
            );
        }
        let index = self.names.counter(id).or_else(|m| err(at, m))?;
        if !self.counters.contains(&index) {
            self.counters.push(index);
        }
        Ok(index)
    }

    fn field(&mut self, path: &FieldPath) -> usize {
        if !self.paths.contains(path) {
            self.paths.push(path.clone());
        }
        self.projection.slot(path)
    }

    fn resolve(&mut self, (ast, at): &(Ast, usize)) -> Result<Expr, ExprError> {
        let at = *at;
        Ok(match ast {
            Ast::Num(d) => Expr::Num(Num::exact(d.clone())),
            Ast::Str(s) => Expr::Lit(Literal::Str(s.clone())),
            Ast::Bool(b) => Expr::Lit(Literal::Bool(*b)),
            Ast::Null => Expr::Lit(Literal::Null),
            // A list literal stands wherever a value may (compared deeply by `==`).
            Ast::List(items) => Expr::List(items.iter().map(literal).collect::<Result<_, _>>()?),
            Ast::Path(p) => Expr::Field(self.field(p)),
            Ast::Counter(id) => Expr::Counter(self.counter(id, at)?),
            Ast::MapGet(id, key) => {
                let list = self.names.list(id).or_else(|m| err(at, m))?;
                if !list.is_map() {
                    return err(
                        at,
                        format!(
                            "@{}[...] reads a map, and {} is a {} list (write `x in @{}`)",
                            shorten(id),
                            quote_prefix(id),
                            list.kind().as_str(),
                            shorten(id)
                        ),
                    );
                }
                Expr::MapGet {
                    key: Box::new(self.resolve(key)?),
                    list,
                }
            }
            Ast::ListRef(id) => {
                self.names.list(id).or_else(|m| err(at, m))?;
                return err(
                    at,
                    format!("@{} can only follow 'in' or 'not in'", shorten(id)),
                );
            }
            Ast::Not(inner) => Expr::Not(Box::new(self.resolve(inner)?)),
            Ast::Neg(inner) => Expr::Neg(Box::new(self.resolve(inner)?)),
            Ast::Bin(op, l, r) => {
                let (l, r) = (self.resolve(l)?, self.resolve(r)?);
                match (op, l, r) {
                    // A `last` counter's raw value is a time: compared by its value instead.
                    (op, Expr::Counter(index), Expr::Num(n))
                        if counter_cmp(*op, false).is_some()
                            && n.exact.is_some()
                            && !self.names.counter_is_last(index) =>
                    {
                        self.counter_cmp(counter_cmp(*op, false), index, n)
                    }
                    (op, Expr::Num(n), Expr::Counter(index))
                        if counter_cmp(*op, true).is_some()
                            && n.exact.is_some()
                            && !self.names.counter_is_last(index) =>
                    {
                        self.counter_cmp(counter_cmp(*op, true), index, n)
                    }
                    (BinOp::Eq | BinOp::Ne, Expr::Field(slot), Expr::Lit(Literal::Str(text)))
                    | (BinOp::Eq | BinOp::Ne, Expr::Lit(Literal::Str(text)), Expr::Field(slot)) => {
                        Expr::FieldIsStr {
                            negated: *op == BinOp::Ne,
                            slot,
                            text: text.into_boxed_str(),
                        }
                    }
                    (op, l, r) => Expr::Bin(*op, Box::new(l), Box::new(r)),
                }
            }
            Ast::In {
                negated,
                value,
                set,
            } => {
                let value = Box::new(self.resolve(value)?);
                let negated = *negated;
                match &set.0 {
                    Ast::List(items) => {
                        let (mut strings, mut literals) =
                            (HashSet::<Box<str>>::new(), HashSet::new());
                        for item in items {
                            match literal(item)? {
                                Literal::Str(s) => {
                                    strings.insert(s.into_boxed_str());
                                }
                                other => {
                                    literals.insert(other);
                                }
                            }
                        }
                        Expr::InSet {
                            negated,
                            value,
                            strings: StrSet::new(strings.into_iter().collect()),
                            set: literals,
                        }
                    }
                    Ast::Path(p) => Expr::InField {
                        negated,
                        value,
                        field: self.field(p),
                    },
                    Ast::ListRef(id) => Expr::InList {
                        negated,
                        value,
                        list: self.names.list(id).or_else(|m| err(set.1, m))?,
                    },
                    Ast::Call(name, args) if name == "cidr" => Expr::InCidr {
                        negated,
                        value,
                        nets: networks(args, set.1)?,
                    },
                    _ => {
                        return err(
                            set.1,
                            "'in' needs a list [...], an event array field, @list or cidr(...)",
                        )
                    }
                }
            }
            Ast::Call(name, args) => self.call(name, args, at)?,
        })
    }

    /// `$counter cmp literal` on the raw scale, or the general comparison when the scaled
    /// literal does not fit 64 bits (then a raw integer cannot decide it exactly).
    fn counter_cmp(&self, cmp: Option<CounterCmp>, index: usize, literal: Num) -> Expr {
        let (Some(cmp), Some(exact)) = (cmp, literal.exact.clone()) else {
            unreachable!("checked by the caller")
        };
        let scale = self.names.counter_scale(index);
        let floor = exact.floor_scaled(scale);
        let ceil = (-&exact).floor_scaled(scale).checked_neg();
        match ceil {
            Some(ceil)
                if floor != i64::MAX
                    && floor != i64::MIN
                    && ceil != i64::MAX
                    && ceil != i64::MIN + 1 =>
            {
                Expr::CounterCmp {
                    cmp,
                    index,
                    floor,
                    ceil,
                }
            }
            _ => {
                let op = match cmp {
                    CounterCmp::Lt => BinOp::Lt,
                    CounterCmp::Le => BinOp::Le,
                    CounterCmp::Gt => BinOp::Gt,
                    CounterCmp::Ge => BinOp::Ge,
                    CounterCmp::Eq => BinOp::Eq,
                    CounterCmp::Ne => BinOp::Ne,
                };
                Expr::Bin(
                    op,
                    Box::new(Expr::Counter(index)),
                    Box::new(Expr::Num(literal)),
                )
            }
        }
    }

    fn call(&mut self, name: &str, args: &[(Ast, usize)], at: usize) -> Result<Expr, ExprError> {
        let arity = |n: usize| -> Result<(), ExprError> {
            if args.len() == n {
                Ok(())
            } else {
                err(
                    at,
                    format!(
                        "{name}() takes {n} argument{}, found {}",
                        if n == 1 { "" } else { "s" },
                        args.len()
                    ),
                )
            }
        };
        Ok(match name {
            "exists" => {
                arity(1)?;
                match &args[0].0 {
                    Ast::Path(p) => Expr::Exists(self.field(p)),
                    Ast::Counter(id) => Expr::CounterExists(self.counter(id, args[0].1)?),
                    _ => return err(args[0].1, "exists() takes a field path or a $counter"),
                }
            }
            "since" => {
                arity(1)?;
                match &args[0].0 {
                    Ast::Counter(id) => {
                        let index = self.counter(id, args[0].1)?;
                        if !self.names.counter_is_last(index) {
                            return err(
                                args[0].1,
                                format!("since() takes a counter with aggregate \"last\", and ${} is not one", shorten(id)),
                            );
                        }
                        Expr::Since(index)
                    }
                    _ => return err(args[0].1, "since() takes a $counter with aggregate \"last\""),
                }
            }
            "score" => {
                arity(0)?;
                if let Some(site) = self.fields_only {
                    return err(at, format!("{site} cannot use score(): test it in the rule's `when`"));
                }
                self.calls_score = true;
                Expr::Score
            }
            "starts_with" | "ends_with" | "contains" => {
                arity(2)?;
                let (a, b) = (Box::new(self.resolve(&args[0])?), Box::new(self.resolve(&args[1])?));
                match name {
                    "starts_with" => Expr::StartsWith(a, b),
                    "ends_with" => Expr::EndsWith(a, b),
                    _ => Expr::Contains(a, b),
                }
            }
            "lower" => {
                arity(1)?;
                Expr::Lower(Box::new(self.resolve(&args[0])?))
            }
            "matches" => {
                arity(2)?;
                let Ast::Str(pattern) = &args[1].0 else {
                    return err(args[1].1, "matches() takes a regular expression as a string literal");
                };
                let regex = regex::RegexBuilder::new(pattern).size_limit(1 << 20).build().or_else(|e| {
                    let first = e.to_string().lines().last().unwrap_or("invalid").trim().trim_start_matches("error: ").to_owned();
                    err(args[1].1, format!("invalid regular expression: {first}"))
                })?;
                Expr::Matches(Box::new(self.resolve(&args[0])?), Box::new(regex))
            }
            "ts" => {
                arity(0)?;
                Expr::Ts
            }
            "ip_prefix" => {
                arity(2)?;
                let bits = match &args[1].0 {
                    Ast::Num(d) => d.as_i64().filter(|b| (0..=128).contains(b)),
                    _ => None,
                };
                let Some(bits) = bits else {
                    return err(args[1].1, "ip_prefix() takes the prefix length as an integer literal from 0 to 128");
                };
                Expr::IpPrefix(Box::new(self.resolve(&args[0])?), bits as u8)
            }
            "cidr" => return err(at, "cidr(...) can only follow 'in' or 'not in'"),
            other => {
                return err(
                    at,
                    format!("unknown function {}; expected exists, starts_with, ends_with, contains, matches, lower, ip_prefix, ts, since, score or cidr", quote_prefix(other)),
                )
            }
        })
    }
}

/// The counter comparison `op` is, with the counter on the left (`flipped`: it was on the right).
fn counter_cmp(op: BinOp, flipped: bool) -> Option<CounterCmp> {
    Some(match (op, flipped) {
        (BinOp::Lt, false) | (BinOp::Gt, true) => CounterCmp::Lt,
        (BinOp::Le, false) | (BinOp::Ge, true) => CounterCmp::Le,
        (BinOp::Gt, false) | (BinOp::Lt, true) => CounterCmp::Gt,
        (BinOp::Ge, false) | (BinOp::Le, true) => CounterCmp::Ge,
        (BinOp::Eq, _) => CounterCmp::Eq,
        (BinOp::Ne, _) => CounterCmp::Ne,
        _ => return None,
    })
}

fn literal((ast, at): &(Ast, usize)) -> Result<Literal, ExprError> {
    Ok(match ast {
        Ast::Num(d) => Literal::Num(d.clone()),
        Ast::Str(s) => Literal::Str(s.clone()),
        Ast::Bool(b) => Literal::Bool(*b),
        Ast::Null => Literal::Null,
        _ => {
            return err(
                *at,
                "list elements must be literals (numbers, strings, true, false, null)",
            )
        }
    })
}

fn networks(args: &[(Ast, usize)], at: usize) -> Result<Vec<IpNet>, ExprError> {
    if args.is_empty() {
        return err(at, "cidr() needs at least one network");
    }
    args.iter()
        .map(|(ast, at)| match ast {
            Ast::Str(s) => parse_network(s).ok_or_else(|| ExprError {
                offset: *at,
                message: format!("invalid network {}: expected an IPv4 or IPv6 address or CIDR like \"10.0.0.0/8\"", quote_prefix(s)),
            }),
            _ => err(*at, "cidr() takes networks as string literals"),
        })
        .collect()
}
