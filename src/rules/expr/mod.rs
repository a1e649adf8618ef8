//! Expressions: `match` and `when` strings, parsed once with a span on every node, resolved
//! against the event projection and the counters, and evaluated per event in three-valued logic
//! (true / false / unknown). Pure.
//!
//! Text → `lex` (tokens) → `parse` (syntax tree, by precedence climbing) → `resolve` (names to
//! slots and indexes: the compiled [`Expr`], in `compiled`) → `eval` (per event).

mod compiled;
mod deep;
mod error;
mod eval;
mod lex;
mod parse;
mod resolve;

use crate::event::Projection;

pub use compiled::{Compiled, CounterCmp, Expr, Literal, Num, StrSet};
pub use error::ExprError;
pub use eval::{Context, Truth, Val};
pub use parse::{BinOp, MAX_NESTING};
pub use resolve::Names;

/// Parses and resolves `text`. `allow_counters` is false for a `match`.
pub fn compile(
    text: &str,
    projection: &mut Projection,
    names: &dyn Names,
    allow_counters: bool,
) -> Result<Compiled, ExprError> {
    let ast = parse::parse(text)?;
    let site = if allow_counters {
        None
    } else {
        Some("a match")
    };
    resolve::resolve(&ast, projection, names, site)
}

/// Parses and resolves a key entry (`dimensions`, `hold_key`, `rollout_key`, `entity`, a
/// distinct tuple): an expression over the event's fields, without counters or `score()`.
pub fn compile_key(
    text: &str,
    projection: &mut Projection,
    names: &dyn Names,
) -> Result<Compiled, ExprError> {
    let ast = parse::parse(text)?;
    resolve::resolve(&ast, projection, names, Some("a key entry"))
}

#[cfg(test)]
mod tests {
    use super::eval::truth;
    use super::*;
    use crate::event::Decimal;
    use crate::event::{decode, quote_prefix, FieldValue};
    use crate::rules::lists::ListSet;

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
            self.counters[index].clone()
        }
        fn event_time(&self) -> Option<i64> {
            Some(self.event.ts)
        }
        fn counter_raw(&mut self, index: usize) -> Option<i64> {
            self.counters[index]
                .as_ref()
                .map(|n| n.exact.as_ref().and_then(Decimal::as_i64).unwrap())
        }
    }

    /// Evaluates `expr` on `event`: Some(true/false) or None (unknown).
    fn eval(expr: &str, event: &str) -> Option<bool> {
        let mut p = Projection::new();
        let c = compile(expr, &mut p, &Counters, true).unwrap_or_else(|e| panic!("{expr}: {e:?}"));
        let e = decode(event.as_bytes(), &p).unwrap();
        let mut cx = Cx {
            event: &e,
            counters: [Some(Num::exact(Decimal::from_i64(6))), None],
        };
        truth(&c.expr.eval(&mut cx))
    }

    /// `ts()` is the event's time; `ip_prefix(ip, bits)` the canonical network string, unknown
    /// for a non-IP or a length past the address's.
    #[test]
    fn ts_and_ip_prefix() {
        let event = r#"{"ts":1700000000000,"ip":"203.0.113.77","v6":"2001:DB8:0:0:1::1",
            "mapped":"::ffff:1.2.3.4","bad":"not-an-ip","n":7}"#;
        for (expr, want) in [
            ("ts() == 1700000000000", Some(true)),
            ("ts() - 1000 > 1699999999999", Some(false)),
            ("ip_prefix(ip, 24) == '203.0.113.0/24'", Some(true)),
            ("ip_prefix(ip, 32) == '203.0.113.77/32'", Some(true)),
            ("ip_prefix(v6, 32) == '2001:db8::/32'", Some(true)),
            ("ip_prefix(mapped, 120) == '::ffff:1.2.3.0/120'", Some(true)),
            ("ip_prefix(ip, 33) == '203.0.113.0/24'", None),
            ("ip_prefix(bad, 24) == 'x'", None),
            ("ip_prefix(n, 24) == 'x'", None),
            ("ip_prefix(missing, 24) == 'x'", None),
        ] {
            assert_eq!(eval(expr, event), want, "{expr}");
        }
        assert_eq!(
            error("ip_prefix(ip, bits) == 'x'", true),
            (
                14,
                "ip_prefix() takes the prefix length as an integer literal from 0 to 128"
                    .to_owned()
            )
        );
        assert_eq!(
            error("ts(1) > 0", true).1,
            "ts() takes 0 arguments, found 1"
        );
    }

    /// `@map[key]` is the key's value (unknown when absent or of the other kind); `x in @map`
    /// tests the keys.
    #[test]
    fn maps_look_up_values_and_test_keys() {
        struct Maps;
        impl Names for Maps {
            fn counter(&self, id: &str) -> Result<usize, String> {
                Err(format!("unknown counter {id}"))
            }
            fn list(&self, id: &str) -> Result<std::sync::Arc<ListSet>, String> {
                use crate::rules::lists::ListKind;
                let mut set = match id {
                    "limits" => ListSet::new(ListKind::StringMap),
                    "points" => ListSet::new(ListKind::NumberMap),
                    _ => ListSet::new(ListKind::String),
                };
                match id {
                    "limits" => assert!(set.add_file("m-1,500\nm-2,\"gold\"\n").is_empty()),
                    "points" => assert!(set.add_file("7995,3\n").is_empty()),
                    _ => set.add("a").unwrap(),
                }
                Ok(std::sync::Arc::new(set))
            }
        }
        let eval = |expr: &str, event: &str| {
            let mut p = Projection::new();
            let c = compile(expr, &mut p, &Maps, true).unwrap();
            let e = decode(event.as_bytes(), &p).unwrap();
            let mut cx = Cx {
                event: &e,
                counters: [None, None],
            };
            truth(&c.expr.eval(&mut cx))
        };
        let event =
            r#"{"ts":1,"m":"m-1","g":"m-2","x":"m-9","amount":600,"mcc":7995.0,"smcc":"7995"}"#;
        for (expr, want) in [
            ("amount > @limits[m]", Some(true)),
            ("@limits[g] == 'gold'", Some(true)),
            ("amount > @limits[g]", None),
            ("amount > @limits[x]", None),
            ("m in @limits", Some(true)),
            ("x in @limits", Some(false)),
            ("x not in @limits", Some(true)),
            ("@points[mcc] == 3", Some(true)),
            ("@points[smcc] == 3", None),
            ("smcc in @points", Some(false)),
            ("@points[mcc + 0] == 3", Some(true)),
        ] {
            assert_eq!(eval(expr, event), want, "{expr}");
        }
        let mut p = Projection::new();
        let e = compile("@plain[x] == 1", &mut p, &Maps, true).unwrap_err();
        assert_eq!(
            (e.offset, e.message.as_str()),
            (
                0,
                "@plain[...] reads a map, and \"plain\" is a string list (write `x in @plain`)"
            )
        );
    }

    /// `==` / `!=` compare arrays and objects deeply; a list literal stands wherever a value may.
    #[test]
    fn arrays_and_objects_compare_deeply() {
        let event = r#"{"ts":1,"tags":["gift"],"two":["gift","rush"],
            "ship":{"zip":10001,"city":"NY"},"bill":{"city":"NY","zip":10001.0},
            "other":{"zip":"10001","city":"NY"},"n":[[1,{"a":[2]}]],"m":[[1.0,{"a":[2e0]}]],
            "pair":[1,2],"arrs":[[3],[1.0,2]]}"#;
        for (expr, want) in [
            ("tags == tags", Some(true)),
            ("!(tags == tags)", Some(false)),
            ("ship == ship", Some(true)),
            ("ship == bill", Some(true)),
            ("ship != bill", Some(false)),
            ("ship == other", Some(false)),
            ("tags == ['gift']", Some(true)),
            ("['gift'] == tags", Some(true)),
            ("two == ['gift']", Some(false)),
            ("two == ['gift', 'rush']", Some(true)),
            ("two == ['rush', 'gift']", Some(false)),
            ("n == m", Some(true)),
            ("['a', 1] == ['a', 1.0]", Some(true)),
            ("tags == 'gift'", Some(false)),
            ("ship == null", Some(false)),
            ("missing == ['gift']", None),
            ("tags < ['z']", None),
            ("pair in arrs", Some(true)),
            ("tags in arrs", Some(false)),
        ] {
            assert_eq!(eval(expr, event), want, "{expr}");
        }
        // Nesting past the bound is unknown, not a stack overflow (the same text is equal).
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        let other = format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000));
        let line = format!(r#"{{"ts":1,"a":{deep},"b":{other}}}"#);
        assert_eq!(eval("a == b", &line), None);
        assert_eq!(eval("a == a", &line), Some(true));
        assert_eq!(eval("a in [1]", &line), Some(false));
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
        assert_eq!(
            eval("ip in cidr('192.168.0.0/16', '10.1.2.3')", ev),
            Some(true)
        );
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
        assert_eq!(
            eval("matches(lower(email), '@example\\\\.com$')", ev),
            Some(true)
        );
        assert_eq!(
            eval(
                "headers.`x-forwarded-for` == null",
                r#"{"ts":1,"headers":{"x-forwarded-for":null}}"#
            ),
            Some(true)
        );
        assert_eq!(eval("`in` == 1", r#"{"ts":1,"in":1}"#), Some(true));
        assert_eq!(
            eval(
                "'\\u{1F600}' == '\\uD83D\\uDE00' && 'a\\tb' == \"a\\tb\"",
                ev
            ),
            Some(true)
        );
    }

    #[test]
    fn errors_point_at_their_column() {
        assert_eq!(
            error("a < b < c", true),
            (
                6,
                "comparisons do not chain: combine them with '&&' or parentheses".into()
            )
        );
        assert_eq!(
            error("amount > ", true),
            (
                9,
                "expected a value, found the end of the expression".into()
            )
        );
        assert_eq!(
            error("$nope > 1", true),
            (0, "unknown counter \"nope\"".into())
        );
        assert_eq!(error("x && $fails > 1", false).0, 5);
        assert_eq!(
            error("ip in @bad", true),
            (6, "unknown list \"bad\"".into())
        );
        assert_eq!(error("foo(x)", true).1, "unknown function \"foo\"; expected exists, starts_with, ends_with, contains, matches, lower, ip_prefix, ts, since, score or cidr");
        assert_eq!(
            error("x == 'a\\q'", true),
            (7, "invalid escape '\\q'".into())
        );
        assert_eq!(
            error("x = 1", true),
            (2, "'=' is not an operator: write '=='".into())
        );
        assert_eq!(error("matches(x, '(')", true).0, 11);
        assert_eq!(
            error("exists('x')", true),
            (7, "exists() takes a field path or a $counter".into())
        );
        assert_eq!(error("ip in cidr('10.0.0.0/33')", true).0, 11);
        assert_eq!(error("in == 1", true).0, 0);
        assert_eq!(error("x == 'open", true), (5, "unterminated string".into()));
        assert_eq!(error("", true), (0, "empty expression".into()));
    }
}
