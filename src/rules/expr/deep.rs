//! Deep equality of arrays and objects (`==` / `!=`): elements in order, object keys in any
//! order, numbers by exact value, strict types. The composite values are compared from their JSON
//! text, built into a tree only when a comparison needs it; nesting deeper than
//! [`MAX_DEPTH`] makes the comparison unknown rather than recursing without bound.

use std::borrow::Cow;

use serde_json::value::RawValue;

use super::compiled::Literal;
use crate::event::Decimal;

/// Deepest nesting deep equality descends into; deeper values compare as unknown.
pub const MAX_DEPTH: usize = 64;

/// A JSON value as deep equality sees it; an object's members sorted by key.
#[derive(Debug, PartialEq)]
pub enum Tree<'t> {
    Null,
    Bool(bool),
    Num(Decimal),
    Str(Cow<'t, str>),
    Arr(Vec<Tree<'t>>),
    Obj(Vec<(Cow<'t, str>, Tree<'t>)>),
}

impl<'t> Tree<'t> {
    /// The tree of a JSON text the event parser has already validated; `None` past
    /// [`MAX_DEPTH`].
    pub fn from_json(text: &'t str) -> Option<Tree<'t>> {
        tree(text, 0)
    }

    /// A list literal's tree.
    pub fn from_literals(items: &'t [Literal]) -> Tree<'t> {
        Tree::Arr(items.iter().map(Tree::from_literal).collect())
    }

    pub fn from_literal(literal: &'t Literal) -> Tree<'t> {
        match literal {
            Literal::Null => Tree::Null,
            Literal::Bool(b) => Tree::Bool(*b),
            Literal::Num(d) => Tree::Num(d.clone()),
            Literal::Str(s) => Tree::Str(Cow::Borrowed(s)),
        }
    }
}

fn tree(text: &str, depth: usize) -> Option<Tree<'_>> {
    let text = text.trim_matches(|c: char| c.is_ascii_whitespace());
    Some(match text.as_bytes().first()? {
        b'n' => Tree::Null,
        b't' => Tree::Bool(true),
        b'f' => Tree::Bool(false),
        b'"' => Tree::Str(string(text)?),
        b'[' | b'{' if depth >= MAX_DEPTH => return None,
        b'[' => {
            let items: Vec<&RawValue> = serde_json::from_str(text).ok()?;
            Tree::Arr(
                items
                    .into_iter()
                    .map(|item| tree(item.get(), depth + 1))
                    .collect::<Option<_>>()?,
            )
        }
        b'{' => {
            // Keys are unique: the event parser refuses an object that names one twice.
            let mut members = members(text)?
                .into_iter()
                .map(|(key, value)| Some((key, tree(value.get(), depth + 1)?)))
                .collect::<Option<Vec<_>>>()?;
            members.sort_by(|a, b| a.0.cmp(&b.0));
            Tree::Obj(members)
        }
        _ => Tree::Num(Decimal::parse(text)?),
    })
}

/// A JSON string's value, borrowed when it has no escapes.
fn string(text: &str) -> Option<Cow<'_, str>> {
    let inner = text.get(1..text.len() - 1)?;
    if inner.contains('\\') {
        serde_json::from_str::<String>(text).ok().map(Cow::Owned)
    } else {
        Some(Cow::Borrowed(inner))
    }
}

/// An object's members with their values' text, in document order.
fn members(text: &str) -> Option<Vec<(Cow<'_, str>, &RawValue)>> {
    struct Members<'de>(Vec<(Cow<'de, str>, &'de RawValue)>);
    impl<'de> serde::Deserialize<'de> for Members<'de> {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Visit;
            impl<'de> serde::de::Visitor<'de> for Visit {
                type Value = Members<'de>;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("an object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<Self::Value, A::Error> {
                    let mut out = Vec::new();
                    while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                        out.push((key, map.next_value::<&'de RawValue>()?));
                    }
                    Ok(Members(out))
                }
            }
            d.deserialize_map(Visit)
        }
    }
    serde_json::from_str::<Members<'_>>(text).ok().map(|m| m.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(text: &str) -> Tree<'_> {
        Tree::from_json(text).unwrap_or_else(|| panic!("{text}"))
    }

    #[test]
    fn objects_compare_in_any_key_order_and_numbers_by_value() {
        assert_eq!(t(r#"{"zip":10001,"city":"NY"}"#), t(r#"{"city":"NY","zip":10001.0}"#));
        assert_ne!(t(r#"{"zip":10001}"#), t(r#"{"zip":"10001"}"#));
        assert_ne!(t(r#"{"zip":10001}"#), t(r#"{"zip":10001,"x":null}"#));
        assert_eq!(t(r#"[1,[2,{"a":"\u0041"}]]"#), t(r#"[1.0,[2e0,{"a":"A"}]]"#));
        assert_ne!(t("[1,2]"), t("[2,1]"));
        assert_eq!(
            t(r#"["gift"]"#),
            Tree::from_literals(&[Literal::Str("gift".into())])
        );
    }

    #[test]
    fn nesting_past_the_bound_is_unknown_not_a_stack_overflow() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(Tree::from_json(&deep), None);
        let fits = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(Tree::from_json(&fits).is_some());
    }
}
